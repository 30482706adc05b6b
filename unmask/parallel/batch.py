"""Data-parallel batch sizes and each rank's rows of a global micro-batch."""

from __future__ import annotations

import torch

from unmask.errors import InputError


def per_rank_batch_size(per_device: int, world_size: int, split_batches: bool) -> int:
    """Rows per micro-batch on one rank.

    ``split_batches`` (accelerate's meaning): ``per_device`` is the global micro-batch and is
    divided by the world size; otherwise every rank takes ``per_device`` rows.
    """
    if not split_batches:
        return per_device
    if per_device % world_size:
        raise InputError(
            f"train.split_batches: per_device_train_batch_size={per_device} does not divide by "
            f"the world size {world_size}; use a multiple of {world_size} or split_batches=false"
        )
    return per_device // world_size


def rank_rows(batch: dict[str, torch.Tensor], rank: int, rows: int) -> dict[str, torch.Tensor]:
    """Rows [rank * rows, (rank + 1) * rows) of every (B, ...) tensor of a global batch."""
    return {k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()}
