"""Values the host needs from the device, without the device waiting for the host.

A read of a CUDA tensor's value (`.item()`, a data-dependent shape such as `nonzero`)
blocks the host until the GPU has run everything queued before it; the queue drains and
the GPU idles while the host enqueues the next kernels. `HostCopy` instead starts an
asynchronous copy into pinned host memory the moment a small value exists (the count of
masked tokens, a step's non-finite flag) and reads it later: by then the copy has long
finished, because the work queued after it (the model's forward, the next step) keeps the
GPU busy; if the host is further ahead than that it waits for the copy, never for the
queue behind it. On a CPU the value is simply kept.

`host_read()` marks the reads of such host copies (and of values kept on the host on
purpose), so the sync audit (train/audit.py) tells them from device syncs on a CPU, where
every tensor is a host tensor.
"""

from __future__ import annotations

import contextlib
import threading

import torch

_reads = threading.local()


@contextlib.contextmanager
def host_read():
    """Reads of host memory made on purpose inside it are not device syncs."""
    depth = getattr(_reads, "depth", 0)
    _reads.depth = depth + 1
    try:
        yield
    finally:
        _reads.depth = depth


def in_host_read() -> bool:
    return getattr(_reads, "depth", 0) > 0


class HostCopy:
    """A small tensor copied to the host as soon as it is made (module doc): `tensor()`
    the host copy, `tolist()` / `item()` its values; `ready()` whether the copy is done."""

    def __init__(self, value: torch.Tensor):
        value = value.detach()
        if value.device.type == "cuda":
            self._host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self._host.copy_(value, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = value.clone(), None

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def tensor(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._host

    def tolist(self):
        with host_read():
            return self.tensor().tolist()

    def item(self):
        with host_read():
            return self.tensor().item()
