"""Process group and device mesh from the launcher's environment.

torchrun and ``accelerate launch`` set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; ``srun`` without torchrun sets SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID
(then MASTER_ADDR/MASTER_PORT must be exported by the sbatch script). One process and no
launcher means world size 1: no process group, the plain single-process path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from unmask.errors import InputError


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


def resolve_mesh_shape(world_size: int, dp_replicate: int, dp_shard: int) -> tuple[int, int]:
    """(replicate, shard) sizes; dp_shard -1 = world_size / dp_replicate. One-line errors."""
    if dp_replicate < 1:
        raise InputError(f"train.dp_replicate must be >= 1, got {dp_replicate}")
    if dp_shard == -1:
        if world_size % dp_replicate:
            raise InputError(
                f"train.dp_replicate={dp_replicate} does not divide the world size "
                f"{world_size}; set dp_replicate to a divisor of the number of processes"
            )
        dp_shard = world_size // dp_replicate
    if dp_shard < 1 or dp_replicate * dp_shard != world_size:
        raise InputError(
            f"mesh train.dp_replicate={dp_replicate} x train.dp_shard={dp_shard} = "
            f"{dp_replicate * dp_shard} processes does not match the world size {world_size}; "
            "make their product the number of processes (dp_shard: -1 fills it in)"
        )
    return dp_replicate, dp_shard


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


def build_mesh(device: torch.device, replicate: int, shard: int) -> DeviceMesh:
    """1-D ("dp_shard",) mesh for FSDP2, 2-D ("dp_replicate", "dp_shard") for HSDP."""
    if replicate == 1:
        return init_device_mesh(device.type, (shard,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(
        device.type, (replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard")
    )


def share_from_rank0(fn):
    """Run fn() on rank 0 only and give every rank its result; an InputError raised on rank
    0 is raised on every rank (so all stop with the same one line instead of hanging)."""
    if not dist.is_initialized():
        return fn()
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except InputError as err:
            box[0] = ("error", str(err))
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise InputError(value)
    return value
