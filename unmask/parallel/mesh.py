"""Process group and device mesh from the launcher's environment.

torchrun and ``accelerate launch`` set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; ``srun`` without torchrun sets SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID
(then MASTER_ADDR/MASTER_PORT must be exported by the sbatch script). One process and no
launcher means world size 1: no process group, the plain single-process path.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from unmask.errors import InputError, NothingToTrain


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits: global rank, world size, rank on its node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


def launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Read rank/world size from torchrun/accelerate variables, else from SLURM's."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    elif "SLURM_NTASKS" in env and "SLURM_PROCID" in env and "MASTER_ADDR" in env:
        keys = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    else:
        return LaunchEnv()
    rank, world, local = (int(env.get(k, "0")) for k in keys)
    return LaunchEnv(rank=rank, world_size=world, local_rank=local)


@dataclass(frozen=True)
class MeshLayout:
    """Sizes of the mesh dims, torchtitan's order: pp x dp_replicate x dp_shard x cp x tp.

    pp: pipeline stages' ranks (the outermost dim: each pp rank holds its own decoder
    layers); dp_replicate: replica groups (HSDP); dp_shard: ranks FSDP2 shards parameters
    over; cp: ranks a sequence is split over (context parallelism); tp: ranks a layer's
    matrices are split over (tensor parallelism). Their product is the world size.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Ranks that read different rows of a batch (tp and cp peers read the same rows)."""
        return self.dp_replicate * self.dp_shard


def resolve_layout(
    world_size: int, dp_replicate: int, dp_shard: int, cp: int = 1, tp: int = 1, pp: int = 1
) -> MeshLayout:
    """The mesh sizes; dp_shard -1 = world_size / (pp * dp_replicate * cp * tp). One-line
    errors."""
    for key, value in (("tensor_parallel", tp), ("context_parallel", cp),
                       ("pipeline_parallel", pp)):  # fmt: skip
        if value < 1:
            raise InputError(f"parallel.{key} must be >= 1, got {value}")
    if dp_replicate < 1:
        raise InputError(f"parallel.dp_replicate must be >= 1, got {dp_replicate}")
    fixed = pp * dp_replicate * cp * tp
    if dp_shard == -1:
        if world_size % fixed:
            if fixed == dp_replicate:
                raise InputError(
                    f"parallel.dp_replicate={dp_replicate} does not divide the world size "
                    f"{world_size}; set dp_replicate to a divisor of the number of processes"
                )
            named = (("pipeline_parallel", pp), ("dp_replicate", dp_replicate),
                     ("context_parallel", cp), ("tensor_parallel", tp))  # fmt: skip
            what = " x ".join(f"parallel.{k}={v}" for k, v in named if v > 1)
            raise InputError(
                f"{what} does not divide the world size {world_size}; launch a multiple of "
                f"{fixed} processes or lower {'them' if ' x ' in what else 'it'}"
            )
        dp_shard = world_size // fixed
    if dp_shard < 1 or fixed * dp_shard != world_size:
        extra = "".join(
            f" x parallel.{k}={v}"
            for k, v in (("context_parallel", cp), ("tensor_parallel", tp))
            if v > 1
        )
        first = f"parallel.pipeline_parallel={pp} x " if pp > 1 else ""
        raise InputError(
            f"mesh {first}parallel.dp_replicate={dp_replicate} x parallel.dp_shard={dp_shard}{extra} = "
            f"{fixed * dp_shard} processes does not match the world size {world_size}; "
            "make their product the number of processes (dp_shard: -1 fills it in)"
        )
    return MeshLayout(dp_replicate, dp_shard, cp, tp, pp)


def init_process_group(env: LaunchEnv, device: torch.device, timeout_s: float) -> None:
    """nccl on CUDA, gloo on CPU; pins this process to its local GPU first."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(env.local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
        init_method="env://",
    )


def end_process(code: int) -> NoReturn:
    """Exit with `code`. A process that joined a process group destroys it when it ends
    well (as PyTorch asks), flushes its streams and leaves without interpreter
    finalization: gloo's worker threads drop a finished collective's tensors a moment after
    the caller's wait returns, and when that drop lands in Python's finalization it needs
    the GIL the exiting interpreter no longer gives, and the process aborts ("terminate
    called without an active exception", SIGABRT) after a run that succeeded
    (pytorch/pytorch#179291 describes it). Every file this package writes is closed by
    then; other processes use sys.exit."""
    if not (dist.is_available() and dist.is_initialized()):
        sys.exit(code)
    if code == 0:  # after a failure (a lost peer) a communicator may never finish closing
        dist.destroy_process_group()
    gc.collect()  # closes what only garbage still holds
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def build_mesh(device: torch.device, layout: MeshLayout) -> DeviceMesh:
    """The world mesh with all five dims (size-1 dims included, so every layout has the
    same names; pp outermost, so a pipeline's stages may sit on different nodes and
    every other dim inside one stage), plus torchtitan's flattened views: "dp"
    (dp_replicate, dp_shard: ranks that read different rows), "dp_shard_cp" (what FSDP2
    shards over) and "dp_cp" (ranks whose losses are summed)."""
    sizes = (layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp)
    mesh = init_device_mesh(device.type, sizes, mesh_dim_names=MESH_DIMS)
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    return mesh


#: expert parallelism's dims, unflattened from "dp_cp" (torchtitan's way: the experts split
#: over the ranks that read different rows or sequence slices, no mesh of their own): the
#: ranks that hold the same experts (ep_replica), then the ranks that split them (ep)
EXPERT_DIMS = ("ep_replica", "ep")


def expert_dims(layout: MeshLayout, expert_parallel: int) -> dict[str, tuple[int, int]]:
    """(size, stride in world ranks) of each of `EXPERT_DIMS` for expert_parallel ranks
    per group: "dp_cp" (dp_replicate x dp_shard x cp, tp innermost) cut into
    (dp_cp / ep, ep), ep innermost, within one pipeline stage (pp stays outermost). The rank
    order `expert_mesh` builds and the planner's traffic reads."""
    dp_cp = layout.dp * layout.cp
    return {"ep_replica": (dp_cp // expert_parallel, expert_parallel * layout.tp),
            "ep": (expert_parallel, layout.tp)}  # fmt: skip


def expert_mesh(mesh: DeviceMesh, expert_parallel: int) -> DeviceMesh:
    """This rank's (ep_replica, ep) grid (`expert_dims`): the world mesh's "dp_cp" dim of
    this rank's pipeline stage unflattened, so a stage's experts live on its own ranks and
    no second mesh is initialized."""
    dp_cp = sub_mesh(mesh, "dp_cp")
    sizes = (dp_cp.size() // expert_parallel, expert_parallel)
    return dp_cp._unflatten(0, sizes, EXPERT_DIMS)


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: dp_shard_cp, under dp_replicate when that is > 1 (HSDP)."""
    if mesh["dp_replicate"].size() > 1:
        return sub_mesh(mesh, "dp_replicate", "dp_shard_cp")
    return sub_mesh(mesh, "dp_shard_cp")


def sub_mesh(mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """mesh[names], without torch's note that slicing a flattened dim (dp, dp_shard_cp)
    from the root mesh will change in a later release (the mesh is built here, once)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[names if len(names) > 1 else names[0]]


def share_from_rank0(fn):
    """Run fn() on rank 0 only and give every rank its result; an InputError (or a
    NothingToTrain) raised on rank 0 is raised on every rank (so all stop with the same one
    line instead of hanging)."""
    if not dist.is_initialized():
        return fn()
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except (InputError, NothingToTrain) as err:
            box[0] = (type(err).__name__, str(err))
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind != "ok":
        raise {"InputError": InputError, "NothingToTrain": NothingToTrain}[kind](value)
    return value
