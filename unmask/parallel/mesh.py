"""The process group from the launcher's environment (the layout and its mesh: dims.py).

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
from torch.distributed.device_mesh import DeviceMesh

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
