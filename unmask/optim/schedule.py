"""Learning-rate schedules with warmup: constant, linear, cosine, constant_with_warmup.

Pure functions of the step so tests and resume can check them directly; the trainer
wraps them in a LambdaLR, which scales every param group (Muon and AdamW alike).
"""

import math

import torch

SCHEDULES = ("constant", "linear", "cosine", "constant_with_warmup")


def resolve_warmup(warmup_steps: float, warmup_ratio: float, total_steps: int) -> int:
    """Warmup length in steps. `warmup_steps` >= 1 is a count, 0 < x < 1 a ratio of
    total steps; it wins over `warmup_ratio` when both are set (as in HF)."""
    if warmup_steps >= 1:
        return int(warmup_steps)
    if warmup_steps > 0:
        return math.ceil(warmup_steps * total_steps)
    return math.ceil(warmup_ratio * total_steps)


def lr_factor(step: int, kind: str, total_steps: int, warmup: int, min_ratio: float = 0.0) -> float:
    """Multiplier of the base learning rate before optimizer step `step` (0-based).

    Warmup is linear from 1/(warmup+1) up to 1 for every kind (a user who sets a warmup
    expects one, also with `constant`). After warmup: constant stays at 1; linear and
    cosine decay to `min_ratio` at `total_steps`.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"unknown lr_scheduler_type {kind!r}; expected one of {SCHEDULES}")
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind in ("constant", "constant_with_warmup"):
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if kind == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    kind: str,
    total_steps: int,
    warmup: int,
    min_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over every param group; its state_dict round-trips through checkpoints."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, kind, total_steps, warmup, min_ratio)
    )
