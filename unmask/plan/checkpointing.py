"""`train.activation_checkpointing: auto`: the least recomputation whose planned peak fits.

Recomputing activations costs a third more dense work (full checkpointing runs every
layer's forward twice), so a run should recompute only what its memory needs. The planner's
memory walk (memory.py) gives each rank's peak with no checkpointing, selective (every
`activation_checkpointing_every`-th layer) and full; the first whose peak is within the
usable share of the device's memory (planner.USABLE_MEMORY of it) wins, and the start-up
log says which, with the three peaks.

Two callers:
- the trainer, once its model is built and sharded (`choose_for_trainer`, which `unmask
  train` passes to the Trainer: `Trainer(cfg, decide_checkpointing=...)`): the peaks
  are those of the rank's real shards, the largest over the ranks (an all-reduce), so
  every rank decides alike; checkpointing is a flag each forward reads, set after the
  build;
- `unmask plan` (`resolve_checkpointing`), before it plans: on the meta device, under a
  fake process group, in a process with no other (torch caches DTensor sharding results by
  mesh layout, and a fake rank's would leak into a real run of the same process: planning
  stays out of training processes).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from unmask.config import RunConfig
from unmask.diffusion.registry import head_share
from unmask.errors import InputError
from unmask.models.build import build_model, resolve_model
from unmask.models.config import ModelConfig
from unmask.plan.devices import DEVICES, Device, resolve_device
from unmask.plan.memory_models import memory_terms
from unmask.plan.planner import USABLE_MEMORY, planned_ranks, run_shape
from unmask.plan.shards import (
    describe_shards,
    parallel_of,
    planned_model_config,
    routing_of,
    shard_model,
)
from unmask.train.mfu import flop_model
from unmask.train.setup import checkpointing_is_auto

#: the choices in order of recomputation: the first that fits wins
CHOICES = ("none", "selective", "full")


def no_recompute(model) -> str:
    """Why a family whose shape says `recompute` False (DiffusionGemma) gets none."""
    return f"model_type {model.family.name}'s layers do not recompute yet"


def flags(cfg: RunConfig) -> dict[str, bool | int]:
    """Each choice as the model's checkpointing flag."""
    return {"none": False, "selective": cfg.train.activation_checkpointing_every, "full": True}


def choose(peaks: dict[str, float], device: Device) -> tuple[str, str]:
    """(the first of CHOICES whose peak fits the device, why, in words)."""
    gib = 2**30
    limit = USABLE_MEMORY * device.memory_bytes
    choice = next((c for c in CHOICES if peaks[c] <= limit), "full")
    why = (f"planned peak per rank {', '.join(f'{c} {peaks[c] / gib:.1f}' for c in CHOICES)} "
           f"GiB, of {device.memory_bytes / gib:.1f} GiB on {device.label} "
           f"({USABLE_MEMORY:.0%} usable)")  # fmt: skip
    if peaks["full"] > limit:
        why += "; not even full fits: `unmask plan` says what would"
    return choice, why


def training_device(device: torch.device) -> Device:
    """The planner's description of the device a process trains on: the GPU's row of the
    device table (by name; an unknown one priced as an H100), with the card's own memory;
    or this machine's CPU and RAM."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        kind = next((k for k in DEVICES if k != "cpu" and k in name.lower()), "h100")
        memory = torch.cuda.get_device_properties(device).total_memory
        return replace(DEVICES[kind], label=name, memory_bytes=float(memory))
    return resolve_device("cpu")


def choose_for_trainer(trainer) -> tuple[bool | int, str]:
    """The trainer's checkpointing flag for auto and the start-up line: the memory walk over
    this rank's real shards (its model and optimizer as built), the largest peak of each
    choice over the ranks. A run the planner does not model (a wrapped transformers
    encoder, a 4-bit base, sequence parallelism) keeps none, and the line says why."""
    try:
        return _choose_for_trainer(trainer)
    except Exception as err:  # the same on every rank: each reaches here before any collective
        why = str(err) if isinstance(err, InputError) else f"{type(err).__name__}: {err}"
        return (
            False,
            f"activation checkpointing: none (auto: the planner cannot plan this run: {why})",
        )


def _choose_for_trainer(trainer) -> tuple[bool | int, str]:
    cfg, model = trainer.cfg, trainer.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    built = getattr(base, "config", None)  # a pretrained folder's architecture, as loaded
    # a canvas decoder never recomputes: decided before the planner (which refuses its tp)
    resolved = trainer.parallel.model
    if isinstance(built, ModelConfig):  # the architecture as loaded, the run's fields
        resolved = replace(resolved, arch=built)
    if not resolved.shape.recompute:  # the family's shape says
        return False, f"activation checkpointing: none (auto: {no_recompute(resolved)})"
    if isinstance(built, ModelConfig):
        cfg = cfg.model_copy(update={"model": resolved.planned()})
    layout, world = trainer.parallel.dims, trainer.dist.world_size
    pipeline = trainer.pipeline_plan
    device = training_device(trainer.device)
    with torch.device("meta"):  # the whole model's FLOPs and parameters (under PP: one
        whole = build_model(cfg.model) if pipeline is not None else None  # stage here)
    counted = whole if whole is not None else model
    sharded = describe_shards(model, routing_of(trainer.optimizer), layout, trainer.dist.rank,
                              pipeline, trainer.dist.pp_rank, flop_model(counted),
                              sum(p.numel() for p in counted.parameters()),
                              resolved.shape)  # fmt: skip
    shape = run_shape(planned_model_config(cfg), world, device,
                      head_share(cfg.diffusion.objective))  # fmt: skip
    peaks = torch.tensor([memory_terms(sharded, replace(shape, checkpointing=flags(cfg)[c])).peak
                          for c in CHOICES], dtype=torch.float64)  # fmt: skip
    if trainer.sharded:
        on_device = peaks.to(trainer.device)
        dist.all_reduce(on_device, op=dist.ReduceOp.MAX)
        peaks = on_device.cpu()
    choice, why = choose(dict(zip(CHOICES, peaks.tolist())), device)
    return flags(cfg)[choice], f"activation checkpointing: {choice} (auto: {why})"


def planned_peaks(cfg: RunConfig, world_size: int, device: Device) -> dict[str, float]:
    """The largest planned peak over the planned ranks (bytes), for each of CHOICES, on the
    meta device (the planner's build: a process without a process group)."""
    planned = planned_model_config(cfg)
    shape = run_shape(planned, world_size, device, head_share(cfg.diffusion.objective))
    peaks = dict.fromkeys(CHOICES, 0.0)
    for rank in planned_ranks(world_size, None):
        sharded = shard_model(planned, world_size, rank)
        for choice in CHOICES:
            terms = memory_terms(sharded, replace(shape, checkpointing=flags(cfg)[choice]))
            peaks[choice] = max(peaks[choice], terms.peak)
    return peaks


def resolve_checkpointing(cfg: RunConfig, world_size: int, device: Device
                          ) -> tuple[RunConfig, str]:  # fmt: skip
    """`unmask plan`'s decision: (cfg with activation_checkpointing decided, the line saying
    how); cfg as it is and "" when the config decides itself. A run the planner cannot plan
    raises its InputError here (the plan itself would, in the same words: one line, not a
    notice and then the error)."""
    if not checkpointing_is_auto(cfg.train):
        return cfg, ""
    planned = planned_model_config(cfg)
    resolved = resolve_model(planned.model)
    if not resolved.shape.recompute:
        parallel_of(planned, world_size)  # a bad layout's line first (no notice before it)
        choice, why = "none", no_recompute(resolved)
    else:
        choice, why = choose(planned_peaks(cfg, world_size, device), device)
    train = cfg.train.model_copy(update={"activation_checkpointing": choice})
    return cfg.model_copy(update={"train": train}), (
        f"activation checkpointing: {choice} (auto: {why})")  # fmt: skip
