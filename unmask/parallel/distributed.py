"""This process's place in a multi-process run, and the collectives the training loop uses.

``setup`` reads the launcher's environment, opens the process group and builds the device
mesh of the layout the trainer planned (parallel/dims.py `ParallelDims`). With one process it
returns a state with ``mesh=None`` and the caller takes its plain single-process path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from unmask.optim.distributed import quiet_dtensor_notes
from unmask.parallel.dims import ParallelDims
from unmask.parallel.mesh import LaunchEnv, init_process_group, launch_env, sub_mesh


@dataclass
class DistState:
    """This process's place in the run: its rank, device and the world mesh (None for a
    single process), laid out as `dims` (parallel/dims.py, the one owner of the layout)."""

    rank: int
    device: torch.device
    mesh: DeviceMesh | None
    dims: ParallelDims = ParallelDims()

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # places on mesh dims, looked up once: a DeviceMesh answers by searching its (host)
    # rank tensor, which a step asks for every micro-batch
    @cached_property
    def dp_rank(self) -> int:
        """Which rows of a global batch this rank reads: its place on the "dp" mesh dim
        (tp and cp peers read the same rows)."""
        return 0 if self.mesh is None else sub_mesh(self.mesh, "dp").get_local_rank()

    @property
    def dp_size(self) -> int:
        """How many ranks read different rows (the layout's dp)."""
        return self.dims.dp

    @cached_property
    def tp_rank(self) -> int:
        return 0 if self.mesh is None else self.mesh["tp"].get_local_rank()

    @cached_property
    def pp_rank(self) -> int:
        """This rank's place in its pipeline (0: holds the first stage)."""
        return 0 if self.mesh is None else self.mesh["pp"].get_local_rank()


def setup(
    device: torch.device,
    *,
    dims: ParallelDims,
    timeout_s: float = 1800,
    env: LaunchEnv | None = None,
) -> DistState:
    """Process group + mesh from the environment (torchrun, accelerate launch, srun), laid
    out as `dims`: the layout the trainer planned (train/setup.py `plan_parallel`), checked
    before any process group work."""
    env = env or launch_env()
    if env.world_size == 1:
        return DistState(0, device, None)
    if device.type == "cuda":
        device = torch.device("cuda", env.local_rank)
    init_process_group(env, device, timeout_s)
    return DistState(env.rank, device, dims.build_mesh(device), dims)


def all_reduce_sum(*values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Sum 0-d tensors over all ranks in one collective."""
    stacked = torch.stack([v.detach().float() for v in values])
    dist.all_reduce(stacked)
    return tuple(stacked.unbind(0))


@dataclass(frozen=True)
class CollectiveFailure:
    """A collective that failed because another process of the run is gone (`timed_out`
    False: its connection closed) or stopped answering within the process group's timeout
    (train.ddp_timeout); `detail` is the backend's own words, shortened to one clause."""

    timed_out: bool
    detail: str


# what gloo, NCCL and the c10d store say when a peer is gone, or silent past the timeout
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "remote worker crash", "remote process exited", "network error",
              "connection refused", "failed to recv", "got 0 bytes", "ncclremoteerror")  # fmt: skip
_PEER_SILENT = ("timed out", "timeout")
# a plain RuntimeError (or DistBackendError) counts only when it comes from these layers: the
# same phrases elsewhere (a DataLoader's "timed out") are not a lost peer
_COMM_LAYERS = ("gloo", "nccl", "c10d", "tcpstore", "processgroup")


def collective_failure(err: BaseException) -> CollectiveFailure | None:
    """Whether `err` (or an error it wraps: its cause or context, the per-rank failures of a
    torch.distributed.checkpoint CheckpointException) is a collective failing because a peer
    process is lost; None for anything else, which keeps its traceback.

    By type first: DistNetworkError and DistStoreError are the network and the rendezvous
    store failing. Gloo on CPU raises a plain RuntimeError ("Connection closed by peer ...",
    "Timed out waiting 1800000ms for recv operation to complete") and NCCL a DistBackendError,
    types that also carry usage errors (a size mismatch), so those count only when their
    message comes from a communication layer and says the peer closed or timed out."""
    for cause in _wrapped(err):
        if not isinstance(cause, RuntimeError):
            continue
        text = str(cause).lower()
        silent = any(phrase in text for phrase in _PEER_SILENT)
        network = isinstance(cause, dist.DistNetworkError | dist.DistStoreError)
        from_comm = any(layer in text for layer in _COMM_LAYERS)
        if network or (from_comm and (silent or any(p in text for p in _PEER_GONE))):
            return CollectiveFailure(silent, _first_clause(str(cause)))
    return None


def _wrapped(err: BaseException, depth: int = 0) -> list[BaseException]:
    """err, then what it wraps, depth-first (a few levels: chains are short)."""
    found = [err]
    if depth > 4:
        return found
    inner = [err.__cause__, err.__context__]
    inner += [pair[0] for pair in (getattr(err, "failures", None) or {}).values()]  # DCP
    for item in inner:
        if isinstance(item, BaseException) and item is not err:
            found += _wrapped(item, depth + 1)
    return found


def _first_clause(message: str) -> str:
    """A backend message without its source location ("[.../pair.cc:553] ") and past its
    first sentence: "Connection closed by peer [127.0.0.1]:62162"."""
    text = (message.strip().splitlines() or [""])[0]
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text)
    return re.split(r"\.\s", text, maxsplit=1)[0].rstrip(".")[:200]


def full_value(x):
    """The global value of a DTensor (e.g. a grad norm), else x."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def clip_grad_norm(parameters, max_norm: float, across=None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for gradients that live on several meshes (FSDP2 x TP:
    the layers' matrices on (dp, tp), the rest on dp alone, which one stack cannot hold):
    the norm of each mesh's gradients, combined; returns the total norm (a plain tensor).
    across: a process group whose ranks hold other parameters (the pipeline's stages): the
    squared norms are summed over it, so every stage clips by the whole model's norm."""
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    by_mesh: dict = {}
    for grad in grads:
        mesh = grad.device_mesh if isinstance(grad, DTensor) else None
        by_mesh.setdefault(id(mesh), []).append(grad)
    if len(by_mesh) <= 1 and across is None:
        return full_value(torch.nn.utils.clip_grad_norm_(params, max_norm))
    with quiet_dtensor_notes():  # a 2-D norm's reduction takes two all-reduces
        norms = [full_value(torch.nn.utils.get_total_norm(group)) for group in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    if across is not None:
        squared = (total.float() ** 2).reshape(1)
        dist.all_reduce(squared, group=across)
        total = squared[0].sqrt()
    if max_norm != float("inf"):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(coef.to(grad.dtype))
    return total
