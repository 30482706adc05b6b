"""Host memory on CPU runs: glibc malloc keeps freed blocks for reuse.

A training step frees its activations during backward while it allocates gradients of
other sizes; glibc serves blocks above its mmap threshold (which grows to 32 MiB as blocks
are freed) from fresh pages and keeps freed heap blocks mapped, so a process's resident
memory ends up near the sum of both rather than their maximum. A trim threshold of 0 makes
every free return the top of the heap to the OS (and fixes the mmap threshold at its
default, so large blocks are unmapped when freed). Elsewhere than glibc this does nothing.
"""

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt  # noqa: B018 - glibc has it, other C libraries may not
        libc.gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def trim_host_memory() -> bool:
    """Set glibc's trim threshold to 0 for this process; False where it is not glibc."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(M_TRIM_THRESHOLD, 0) == 1)
