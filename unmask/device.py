"""The device a command runs on (`resolve_device`), without importing torch.distributed:
`unmask generate`, `eval` and `export` open checkpoints on it, and the trainer places its
model there, so reading a folder pays for no sharding code at start-up."""

from __future__ import annotations

import torch

from unmask.errors import InputError


def resolve_device(name: str) -> torch.device:
    """auto: cuda when a CUDA device is visible, else cpu; cuda without one: an InputError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("device is 'cuda' but no CUDA device is visible; use auto or cpu")
    return torch.device(name)


__all__ = ["resolve_device"]
