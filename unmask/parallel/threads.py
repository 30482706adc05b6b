"""Torch's intra-op threads on a CPU: one thread for a tiny model unless the user chose.

A tiny model's matmuls are too small to split over threads, and on a machine whose cores
are shared with other work a thread that waits for a descheduled peer stalls every op at
OpenMP's barrier. On this project's 2-core machine the quickstart model (0.8M parameters)
trained 1.5x faster with one thread than with two when nothing else ran, and 10-30x faster
when another process kept one core busy; `unmask generate` took 0.04-0.4 s against 1-9 s
(benchmarks/results/threads.md). Torch's default is every core. So `auto` (train.num_threads,
and `unmask generate` / `eval`) uses one thread for a model under `TINY_MODEL_PARAMS` on a
CPU, unless OMP_NUM_THREADS is set: a thread count the user chose is kept.
"""

from __future__ import annotations

import os

import torch

TINY_MODEL_PARAMS = 5_000_000
"""Below this many parameters a CPU model runs on one thread under `auto`."""


def auto_threads(params: int, device_type: str) -> int | None:
    """The thread count `auto` picks for a model of `params` parameters on `device_type`, or
    None to keep torch's (OMP_NUM_THREADS set, a GPU, or a model large enough to split)."""
    if os.environ.get("OMP_NUM_THREADS") or device_type != "cpu":
        return None
    return 1 if params < TINY_MODEL_PARAMS else None


def set_threads(setting: int | str, params: int, device_type: str) -> str | None:
    """Apply `setting` (`auto` or a thread count) for a model of `params` parameters; return
    the line that says what changed (None when torch's count is kept)."""
    before = torch.get_num_threads()
    if setting == "auto":
        threads = auto_threads(params, device_type)
        if threads is None or threads == before:
            return None
        why = (
            f"auto: a {params / 1e6:.2f}M-parameter model on a CPU runs fastest on one; "
            "OMP_NUM_THREADS or train.num_threads sets another count"
        )
    else:
        threads, why = int(setting), "train.num_threads"
        if threads == before:
            return None
    torch.set_num_threads(threads)
    return f"torch threads: {threads} instead of {before} ({why})"
