"""The step plan of a run: total steps, warmup, and the logging / eval / save intervals,
derived once from the config and the data size (pure arithmetic, tested directly)."""

import math
from dataclasses import dataclass

from unmask.config import RunConfig
from unmask.errors import InputError
from unmask.optim.schedule import resolve_warmup


def every(value: float, total: int) -> int:
    """An interval in steps from an int count or a fraction (< 1) of the total; 0 = never."""
    if value <= 0:
        return 0
    if value < 1:
        return max(1, math.ceil(value * total))
    return int(value)


@dataclass
class Plan:
    """Step counts derived once from the config and the data size."""

    total_steps: int
    warmup_steps: int
    logging_every: int
    eval_every: int
    save_every: int
    tokens_per_step: int


def make_plan(cfg: RunConfig, num_rows: int | None, world_size: int = 1) -> Plan:
    """num_rows: training rows per epoch, None for a stream (then max_steps is needed)."""
    t = cfg.train
    rows_per_step = t.per_device_train_batch_size * t.gradient_accumulation_steps * world_size
    if t.max_steps > 0:
        total = t.max_steps
    elif num_rows is None:
        raise InputError(
            "data.streaming: the stream's length is unknown, so num_train_epochs cannot size "
            "the run; set train.max_steps"
        )
    else:
        total = math.ceil(t.num_train_epochs * num_rows / rows_per_step)
    if total <= 0:
        raise InputError("nothing to train: set train.max_steps > 0 or train.num_train_epochs > 0")
    return Plan(
        total_steps=total,
        warmup_steps=resolve_warmup(cfg.optim.warmup_steps, cfg.optim.warmup_ratio, total),
        logging_every=every(t.logging_steps, total) or total,
        eval_every=every(t.eval_steps, total),
        save_every=every(t.save_steps, total),
        tokens_per_step=rows_per_step * cfg.data.packing_length,
    )
