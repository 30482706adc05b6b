"""What the benchmarks share: the machine a report was measured on, interleaved rounds and
medians with their spread over them, worker launches, and the report file.

Every benchmark runs as a script (`python benchmarks/X.py`), so its own folder is first on
sys.path and this module imports as `common`. Nothing here imports torch or unmask: the
benchmarks that time their own imports (data.py) can import it before starting the clock.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: the committed reports
RESULTS = Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------------------ machine


def cpu_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it ("unknown CPU" where it does not)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def machine(*packages: str) -> str:
    """The machine in one line: CPU, cores, Python and the installed version of each package
    named ("AMD EPYC, 2 cores, Python 3.11.7, torch 2.13.0+cpu")."""
    found = [f"{name} {version(name)}" for name in packages]
    return ", ".join([cpu_name(), f"{os.cpu_count()} cores", f"Python {platform.python_version()}",
                      *found])  # fmt: skip


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as the kernel prints them ("0.83 1.28 1.98")."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# ------------------------------------------------------------------------ rounds, medians


def rotated(items: list, round_index: int) -> list:
    """The variants in a different order each round (rotated by one per round), so a drift
    in the machine's load hits all of them alike."""
    k = round_index % len(items)
    return list(items[k:]) + list(items[:k])


def median_spread(values: list[float], fmt: str = "{:.2f}") -> tuple[str, str]:
    """(median, "min-max"), each formatted with `fmt` (a str.format pattern)."""
    lo, hi = min(values), max(values)
    return fmt.format(statistics.median(values)), f"{fmt.format(lo)}-{fmt.format(hi)}"


def with_spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """The median and "(min-max)" formatted with `fmt`; just the value when there is one
    (one round)."""
    if len(values) == 1:
        return fmt.format(values[0])
    median, spread = median_spread(values, fmt)
    return f"{median} ({spread})"


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of fn over `repeats` calls after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ------------------------------------------------------------------------------ workers


def run_workers(
    nproc: int, script: str | Path, *args: str | Path, timeout: float, env: dict | None = None
) -> None:
    """`script args` in `nproc` gloo processes (torchrun --standalone: a free port on this
    machine; one plain process when nproc is 1), the repository first on PYTHONPATH; exits
    with the tail of their stderr if they fail."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [sys.executable, *(launcher if nproc > 1 else []), str(script), *map(str, args)]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)
    if proc.returncode:
        sys.exit(proc.stderr[-4000:])


def run_one_thread(args: list[str | Path], log: Path) -> int:
    """`python args` from the repository with one torch thread (OMP_NUM_THREADS=1, so two
    such runs share a 2-core machine), stdout and stderr to `log`; the exit code."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        cmd = [sys.executable, *map(str, args)]
        return subprocess.run(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO
        ).returncode


# ------------------------------------------------------------------------------- report


def write_report(text: str, path: Path | str | None) -> None:
    """Write the report to `path` (its folder made) and say so; nothing when path is None
    (a --quick run writes no results file)."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")


def publish(text: str, path: Path | str | None) -> None:
    """Print the report, then `write_report` it."""
    print(text)
    write_report(text, path)
