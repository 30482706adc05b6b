"""This process's place in a multi-process run, and the collectives the training loop uses.

``setup`` reads the launcher's environment, checks the mesh settings (one-line errors before
anything starts), opens the process group and builds the device mesh. With one process it
returns a state with ``mesh=None`` and the caller takes its plain single-process path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from unmask.errors import InputError
from unmask.parallel.mesh import (
    LaunchEnv,
    build_mesh,
    init_process_group,
    launch_env,
    resolve_mesh_shape,
)


@dataclass
class DistState:
    """This process's place in the run; mesh is None for a single process."""

    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        """' x 4 processes (FSDP2 over 4)' for the start-up line; '' for one process."""
        if self.mesh is None:
            return ""
        sizes = dict(zip(self.mesh.mesh_dim_names, self.mesh.shape))
        shard, replicate = sizes["dp_shard"], sizes.get("dp_replicate", 1)
        if shard == 1:
            how = f"replicated {replicate}x"
        elif replicate > 1:
            how = f"HSDP {replicate} x {shard}"
        else:
            how = f"FSDP2 over {shard}"
        return f" x {self.world_size} processes ({how})"


def setup(
    device: torch.device,
    *,
    shard: bool = True,
    dp_replicate: int = 1,
    dp_shard: int = -1,
    timeout_s: float = 1800,
    env: LaunchEnv | None = None,
) -> DistState:
    """Process group + mesh from the environment (torchrun, accelerate launch, srun).

    shard: shard parameters over the ranks (FSDP2 / HSDP with dp_replicate x dp_shard);
    False replicates them on every rank (dp_replicate = world size).
    """
    env = env or launch_env()
    if env.world_size == 1:
        return DistState(0, 1, device, None)
    if shard:
        replicate, shards = resolve_mesh_shape(env.world_size, dp_replicate, dp_shard)
    else:
        replicate, shards = env.world_size, 1
    if device.type == "cuda":
        device = torch.device("cuda", env.local_rank)
    init_process_group(env, device, timeout_s)
    mesh = build_mesh(device, replicate, shards)
    return DistState(env.rank, env.world_size, device, mesh)


def all_reduce_sum(*values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Sum 0-d tensors over all ranks in one collective."""
    stacked = torch.stack([v.detach().float() for v in values])
    dist.all_reduce(stacked)
    return tuple(stacked.unbind(0))


def full_value(x):
    """The global value of a DTensor (e.g. a grad norm), else x."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def resolve_device(name: str) -> torch.device:
    """auto: cuda when a CUDA device is visible, else cpu; cuda without one: an InputError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("device is 'cuda' but no CUDA device is visible; use auto or cpu")
    return torch.device(name)
