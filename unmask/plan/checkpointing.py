"""`train.activation_checkpointing: auto`: the least recomputation whose planned peak fits.

Recomputing activations costs a third more dense work (full checkpointing runs every
layer's forward twice), so a run should recompute only what its memory needs. `unmask
train` asks the planner (the run's own model and parallel layout, sharded on the meta
device under a fake process group: shards.py, memory.py) for each rank's peak with no
checkpointing, selective (every `activation_checkpointing_every`-th layer) and full, and
takes the first whose peak is within the usable share of the device's memory
(planner.USABLE_MEMORY of it); it says which at start-up, with the three peaks.
"""

from __future__ import annotations

from dataclasses import replace

from unmask.config import RunConfig
from unmask.diffusion.registry import head_share
from unmask.errors import InputError
from unmask.plan.devices import DEVICES, Device, resolve_device
from unmask.plan.memory import memory_terms
from unmask.plan.planner import USABLE_MEMORY, planned_ranks, run_shape
from unmask.plan.shards import planned_model_config, shard_model

#: the choices in order of recomputation: the first that fits wins
CHOICES = ("none", "selective", "full")


def checkpointing_is_auto(cfg: RunConfig) -> bool:
    """Whether the run leaves activation checkpointing to `resolve_checkpointing`."""
    t = cfg.train
    return t.activation_checkpointing in (None, "auto") and (
        "gradient_checkpointing" not in t.model_fields_set
    )


def planned_peaks(cfg: RunConfig, world_size: int, device: Device) -> dict[str, float]:
    """The largest planned peak over the planned ranks (bytes), for each of CHOICES."""
    planned = planned_model_config(cfg)
    shape = run_shape(planned, world_size, device, head_share(cfg.diffusion.objective))
    flags = {"none": False, "selective": cfg.train.activation_checkpointing_every, "full": True}
    peaks = dict.fromkeys(CHOICES, 0.0)
    for rank in planned_ranks(world_size, None):
        sharded = shard_model(planned, world_size, rank)
        for choice in CHOICES:
            terms = memory_terms(sharded, replace(shape, checkpointing=flags[choice]))
            peaks[choice] = max(peaks[choice], terms.peak)
    return peaks


def training_device(cfg: RunConfig) -> Device:
    """The device this process will train on, as the planner describes it: the visible
    GPU's row of the device table (by name; an unknown one priced as an H100), with the
    card's own memory, or this machine's CPU and RAM."""
    import torch

    wants_cuda = cfg.train.device in ("auto", "cuda")
    if wants_cuda and torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        kind = next((k for k in DEVICES if k != "cpu" and k in name.lower()), "h100")
        memory = torch.cuda.get_device_properties(0).total_memory
        return replace(DEVICES[kind], label=name, memory_bytes=float(memory))
    return resolve_device("cpu")


def resolve_checkpointing(cfg: RunConfig, world_size: int, device: Device
                          ) -> tuple[RunConfig, str]:  # fmt: skip
    """(cfg with activation_checkpointing decided, the start-up line saying how); cfg as it
    is and "" when the run decides it itself (module docstring). A layout the planner
    cannot plan keeps none, and the line says why."""
    if not checkpointing_is_auto(cfg):
        return cfg, ""
    gib = 2**30
    try:
        peaks = planned_peaks(cfg, world_size, device)
    except InputError as err:
        choice, why = "none", f"the planner cannot plan this run: {err}"
    except Exception as err:  # the planner's failure must not stop a run it only advises
        choice, why = "none", f"the planner failed on this run ({type(err).__name__}: {err})"
    else:
        limit = USABLE_MEMORY * device.memory_bytes
        choice = next((c for c in CHOICES if peaks[c] <= limit), "full")
        why = (f"planned peak per rank {', '.join(f'{c} {peaks[c] / gib:.1f}' for c in CHOICES)}"
               f" GiB, of {device.memory_bytes / gib:.1f} GiB on {device.label} "
               f"({USABLE_MEMORY:.0%} usable)")  # fmt: skip
        if peaks["full"] > limit:
            why += "; not even full fits: `unmask plan` says what would"
    train = cfg.train.model_copy(update={"activation_checkpointing": choice})
    return cfg.model_copy(update={"train": train}), (
        f"activation checkpointing: {choice} (auto: {why})")  # fmt: skip
