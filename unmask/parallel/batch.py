"""Data-parallel batch sizes, and the random generator a rank draws its own rows' noise
from."""

from __future__ import annotations

import torch

from unmask.errors import InputError


def per_rank_batch_size(
    per_device: int, world_size: int, split_batches: bool, what: str = "the world size"
) -> int:
    """Rows per micro-batch on one rank.

    ``split_batches`` (accelerate's meaning): ``per_device`` is the global micro-batch and is
    divided by the world size (under TP / CP: the data-parallel size, named by ``what``);
    otherwise every rank takes ``per_device`` rows.
    """
    if not split_batches:
        return per_device
    if per_device % world_size:
        raise InputError(
            f"train.split_batches: per_device_train_batch_size={per_device} does not divide by "
            f"the world size {world_size}; use a multiple of {world_size} or split_batches=false"
            if what == "the world size"
            else f"train.split_batches: per_device_train_batch_size={per_device} does not "
            f"divide by {what} {world_size}; use a multiple of {world_size} or "
            "split_batches=false"
        )
    return per_device // world_size


def rank_generator(base: torch.Generator, where: tuple[int, int], rank: int) -> torch.Generator:
    """A generator for this rank's own draws at `where` = (step, micro-batch): seeded by
    (base's seed, where, rank), so draws are independent across ranks and identical after a
    resume, whatever state `base` is in."""
    step, micro = where
    seed = base.initial_seed() * 1_000_003 + (step * 4099 + micro) * 65_537 + rank
    own = torch.Generator(device=base.device)
    own.manual_seed(seed % (2**63))
    return own
