"""What the trainer needs to run on several processes, in one place.

``setup`` reads the launcher's environment, checks the mesh and batch settings (one-line
errors before anything starts), opens the process group and builds the device mesh.
With one process it returns a state with ``mesh=None`` and the trainer takes its plain
single-process path unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from unmask.parallel.batch import per_rank_batch_size, rank_rows
from unmask.parallel.fsdp import apply_fsdp
from unmask.parallel.mesh import (
    build_mesh,
    init_process_group,
    launch_env,
    resolve_mesh_shape,
    share_from_rank0,
)

__all__ = ["DistState", "setup", "share_from_rank0"]


@dataclass
class DistState:
    """This process's place in the run; mesh is None for a single process."""

    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh | None
    local_batch_size: int
    #: ranks the global batch grows with (1 under split_batches): make_plan's world_size
    batch_ranks: int

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

    @property
    def global_batch_size(self) -> int:
        """Rows of one micro-batch over all ranks."""
        return self.local_batch_size * self.world_size


def setup(train_cfg, device: torch.device) -> DistState:
    """Process group + mesh from the environment (torchrun, accelerate launch, srun)."""
    env = launch_env()
    t = train_cfg
    local = per_rank_batch_size(t.per_device_train_batch_size, env.world_size, t.split_batches)
    batch_ranks = 1 if t.split_batches else env.world_size
    if env.world_size == 1:
        return DistState(0, 1, device, None, local, batch_ranks)
    if t.fsdp2:
        replicate, shard = resolve_mesh_shape(env.world_size, t.dp_replicate, t.dp_shard)
    else:
        replicate, shard = env.world_size, 1
    if device.type == "cuda":
        device = torch.device("cuda", env.local_rank)
    init_process_group(env, device, t.ddp_timeout)
    mesh = build_mesh(device, replicate, shard)
    return DistState(env.rank, env.world_size, device, mesh, local, batch_ranks)


def shard_model(model: torch.nn.Module, state: DistState, train_cfg) -> None:
    apply_fsdp(
        model,
        state.mesh,
        bf16=train_cfg.bf16,
        reshard_after_forward=train_cfg.reshard_after_forward,
        gradient_checkpointing=train_cfg.gradient_checkpointing,
        torch_compile=train_cfg.torch_compile,
    )


def rank_batch(
    batch: dict, objective, generator: torch.Generator, state: DistState, where: tuple[int, int]
) -> tuple[dict, torch.Generator]:
    """This rank's rows of a global micro-batch, and the generator its objective should use.

    Plain MDLM/LLaDA pretraining: the noise (t, masks) of the whole global batch is drawn
    first from ``generator``, which every rank holds in the same state, and each rank keeps
    its rows' noise: a row gets the noise it would get in a one-process run of the same
    global batch, so losses do not depend on the world size. Objectives that draw more
    (SFT, Dream cutoffs, block diffusion) draw on their own rows from a generator seeded
    by (run seed, ``where`` = (step, micro-batch), rank): independent across ranks and
    identical after a resume.
    """
    from unmask.diffusion.objectives import MaskedDiffusionObjective

    rows = state.local_batch_size
    if type(objective) is MaskedDiffusionObjective:
        t, noisy, masked = objective.noise(batch, generator)
        batch = {**batch, "t": t, "noisy_input_ids": noisy, "masked": masked}
        return rank_rows(batch, state.rank, rows), generator
    step, micro = where
    seed = generator.initial_seed() * 1_000_003 + (step * 4099 + micro) * 65_537 + state.rank
    own = torch.Generator(device=generator.device)
    own.manual_seed(seed % (2**63))
    return rank_rows(batch, state.rank, rows), own


def sync_gradients(model: torch.nn.Module, sync: bool) -> None:
    """Reduce-scatter gradients only on the last micro-batch of a step."""
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is not None:
        setter(sync)


def all_reduce_sum(*values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Sum 0-d tensors over all ranks in one collective."""
    stacked = torch.stack([v.detach().float() for v in values])
    dist.all_reduce(stacked)
    return tuple(stacked.unbind(0))


def full_value(x):
    """The global value of a DTensor (e.g. a grad norm), else x."""
    return x.full_tensor() if isinstance(x, DTensor) else x


class SilentLogger:
    """The MetricsLogger interface, doing nothing: ranks other than 0 log nothing."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def print(self, *args, **kwargs) -> None:
        pass

    def advance(self, *args, **kwargs) -> None:
        pass

    def log(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gather the full (unsharded) state dict to CPU; collective, every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def save_full_model(model: torch.nn.Module, folder: Path) -> None:
    """Gather an FSDP2 model and write it as one HF folder from rank 0."""
    from unmask.models.transformer import DiffusionTransformer

    state = full_model_state(model)
    if dist.get_rank() == 0:
        with torch.device("meta"):
            plain = DiffusionTransformer(model.config)
        plain.to_empty(device="cpu")
        plain.tie_weights()
        plain.load_state_dict(state)
        plain.save_pretrained(str(folder))
    dist.barrier()
