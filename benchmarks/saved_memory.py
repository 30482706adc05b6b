"""What the activation-memory benchmarks share (context_parallel.py, sequence_parallel.py):
the bytes autograd saves for backward, and the process's resident memory and its peak.

Imported as `saved_memory` (a benchmark runs as a script, so its folder is on sys.path).
"""

from __future__ import annotations

from pathlib import Path

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a tensor subclass (a DTensor's local tensor, an async
    collective's result), whose storage is the memory it holds; a plain tensor itself."""
    while hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        t = getattr(t, names[0])
    return t


class SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the distinct storages autograd keeps for backward while active (parameter
    storages excluded: `params` holds their data pointers)."""

    def __init__(self, params: set[int]):
        self.params, self.storages = params, {}
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = local(t).untyped_storage()
        if storage.data_ptr() not in self.params:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self) -> SavedActivations:
        super().__enter__()
        return self

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def rss_bytes(field: str) -> int:
    """A /proc/self/status field in bytes: VmRSS (resident now), VmHWM (its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (False where the kernel does not allow it)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False
