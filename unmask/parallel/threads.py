"""Torch's intra-op threads on a CPU for a tiny model: one per idle core, unless the user chose.

Torch's default is one thread per core. A thread that waits for a descheduled peer stalls
every op at OpenMP's barrier, and a tiny model's ops are short, so on a machine whose cores
are taken by other work two threads are far slower than one. On this project's 2-core
machine, quickstart model (0.8M parameters), benchmarks/results/threads.md:

- idle: 2 threads train 1.7x faster than 1 (11.9 vs 6.8 steps/s), generation is the same;
- one core kept busy by another process: 1 thread trains 2.0x faster (6.9 vs 3.4 steps/s)
  and generates 2.3x faster;
- shared with other jobs (load average 3-10): 1 thread trained 5-12x faster and `unmask
  generate` took 0.05-0.4 s against 1.5-8 s.

So `auto` (train.num_threads, and `unmask generate` / `eval`) gives a model under
`TINY_MODEL_PARAMS` on a CPU as many threads as the machine has idle cores at start-up
(`busy_cores`; at least 1, at most torch's count), unless
OMP_NUM_THREADS is set: a count the user chose is kept. Larger models keep torch's count.
"""

from __future__ import annotations

import os
import time
from collections import deque

import torch

TINY_MODEL_PARAMS = 5_000_000
"""Below this many parameters `auto` fits a CPU model's threads to the idle cores."""


def busy_cores(window_s: float = 0.1) -> tuple[float, int] | None:
    """(cores busy with other work now, cores this process may use), or None where the OS
    tells neither. Busy: the smaller of the 1-minute load average (slow to fall after a job
    that just ended, a `pip install` say) and the busy share of all cores over `window_s`
    (/proc/stat; noisy alone)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    first = _cpu_jiffies()
    if first is not None:
        time.sleep(window_s)
        second = _cpu_jiffies()
        total, idle = second[0] - first[0], second[1] - first[1]
        if total > 0:
            load = min(load, (1 - idle / total) * (os.cpu_count() or 1))
    return load, cores or 1


def _cpu_jiffies() -> tuple[int, int] | None:
    """(all, idle + iowait) CPU time of every core since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as handle:
            fields = [int(x) for x in handle.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(fields), fields[3] + fields[4]) if len(fields) >= 5 else None


class IdleCores:
    """Cores idle of other work now, for a long-lived process (`unmask serve`): the busy
    share of all cores (/proc/stat) less this process's own CPU time, over windows of
    `window_s` seconds, and of the last `keep` windows the least (a core that was busy in
    the last few seconds is counted busy: other jobs pause and resume, and a thread count
    raised into a busy core stalls every forward). Re-measured when `idle()` is called
    `window_s` after the last measurement (reading /proc/stat: microseconds), so a caller
    may ask before every forward. None until the first window has passed, and where
    /proc/stat is missing."""

    def __init__(self, window_s: float = 1.0, keep: int = 3):
        self.window_s = window_s
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self.cores = len(affinity) if affinity else os.cpu_count() or 1
        self.recent: deque[float] = deque(maxlen=keep)
        self.last = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, int, int] | None:
        jiffies = _cpu_jiffies()
        return None if jiffies is None else (time.monotonic(), time.process_time(), *jiffies)

    def idle(self) -> float | None:
        if self.last is not None and time.monotonic() - self.last[0] >= self.window_s:
            now = self._sample()
            if now is not None:
                wall, own = now[0] - self.last[0], now[1] - self.last[1]
                total, idle = now[2] - self.last[2], now[3] - self.last[3]
                if total > 0 and wall > 0:
                    busy = (1 - idle / total) * (os.cpu_count() or 1)
                    self.recent.append(max(0.0, self.cores - max(0.0, busy - own / wall)))
                self.last = now
        return min(self.recent) if self.recent else None


def auto_threads(params: int, device_type: str) -> tuple[int, str] | None:
    """(threads, why) when `auto` lowers torch's thread count for a model of `params`
    parameters on `device_type`, else None (OMP_NUM_THREADS set, a GPU, a model large enough
    to split, or enough idle cores)."""
    if os.environ.get("OMP_NUM_THREADS") or device_type != "cpu" or params >= TINY_MODEL_PARAMS:
        return None
    current = torch.get_num_threads()
    measured = busy_cores() if current > 1 else None  # one thread: nothing to lower
    if measured is None:
        return None
    busy, cores = measured
    threads = max(1, min(current, round(cores - busy)))
    if threads >= current:
        return None
    return threads, (
        f"auto: a {params / 1e6:.2f}M-parameter model, {busy:.1f} of {cores} cores busy with "
        "other work: one thread per idle core; OMP_NUM_THREADS or train.num_threads sets "
        "another count"
    )


def set_threads(
    setting: int | str, params: int, device_type: str, resumed: int | None = None
) -> str | None:
    """Apply `setting` (`auto` or a thread count) for a model of `params` parameters; return
    the line that says what changed (None when torch's count is kept). `resumed`: the count
    the checkpoint being resumed was trained with, which `auto` keeps (on a CPU another
    count sums in another order, and the resumed run would not equal an uninterrupted one)."""
    before = torch.get_num_threads()
    if setting == "auto" and resumed is not None and device_type == "cpu":
        if resumed == before or os.environ.get("OMP_NUM_THREADS"):
            return None
        torch.set_num_threads(resumed)
        return (f"torch threads: {resumed} instead of {before} (auto: the count the resumed "
                "run was trained with, so it continues exactly)")  # fmt: skip
    if setting == "auto":
        chosen = auto_threads(params, device_type)
        if chosen is None:
            return None
        threads, why = chosen
    else:
        threads, why = int(setting), "train.num_threads"
        if threads == before:
            return None
    torch.set_num_threads(threads)
    return f"torch threads: {threads} instead of {before} ({why})"


def set_sampling_threads(model: torch.nn.Module, device: torch.device) -> None:
    """`auto` for a model loaded to sample or score (`unmask generate`, `unmask eval`): on a
    shared 2-core machine two threads made a quickstart-sized model's generation 2-40x
    slower. OMP_NUM_THREADS, when set, is kept."""
    set_threads("auto", sum(p.numel() for p in model.parameters()), device.type)
