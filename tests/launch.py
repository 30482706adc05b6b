"""Starting real multi-process runs from a test: one torchrun command line for every test
that launches gloo processes on this machine, and the /proc look-ups that tests which signal
or kill a launched rank need.

Every launch is `torchrun --standalone` (a c10d rendezvous on localhost that picks a free
port itself, so parallel test workers never collide), one OpenMP thread per process (as
torchrun would default it; set explicitly so a caller's OMP_NUM_THREADS cannot change the
GEMM kernels a test compares against a one-process run), gloo in the workers, a bounded
wall time, and the output captured: a failed launch fails the test with the tail of both
of its streams.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).resolve().parent / "integration" / "dist_workers"
#: runs several `unmask train` configs in one launch (see its docstring)
TRAIN_WORKER = WORKERS / "train_worker.py"


def torchrun_command(nproc: int, *args: str | Path, flags: tuple[str, ...] = ()) -> list[str]:
    """The argv of a standalone torchrun launch of `nproc` processes on this machine;
    `args` is the script and its arguments (or "-m", module, ...), `flags` extra torchrun
    options (before the script)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", *flags, *map(str, args)]  # fmt: skip


def rank_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of launched ranks: this process's, plus `env`, with one OpenMP thread
    per rank."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}


def failure(proc: subprocess.CompletedProcess, tail: int = 3000) -> str:
    """What a failed launch printed: its exit code and the tail of stdout and stderr."""
    return (f"torchrun exited {proc.returncode}\n--- stdout (tail)\n{proc.stdout[-tail:]}\n"
            f"--- stderr (tail)\n{proc.stderr[-tail:]}")  # fmt: skip


def torchrun(
    nproc: int,
    *args: str | Path,
    timeout: float = 400,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    flags: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """Run `torchrun_command(nproc, *args)` to its end (at most `timeout` seconds) and
    assert it exited 0; returns the finished process (stdout and stderr as text)."""
    proc = subprocess.run(torchrun_command(nproc, *args, flags=flags), capture_output=True,
                          text=True, timeout=timeout, env=rank_env(env), cwd=cwd)  # fmt: skip
    assert proc.returncode == 0, failure(proc)
    return proc


def train_in_ranks(nproc: int, results: Path, *configs: Path, timeout: float = 400) -> dict:
    """Every config through `unmask train` in one launch of `nproc` ranks (train_worker.py);
    returns rank 0's {config name: {"rc", "stderr"}}."""
    torchrun(nproc, TRAIN_WORKER, results, *configs, timeout=timeout)
    return json.loads(Path(results).read_text())


def free_port() -> int:
    """A TCP port free on the loopback interface right now (for a rendezvous the test sets
    up itself: srun-style processes, two torchrun agents)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parent_of(pid: int) -> int | None:
    """The parent pid of a live process (field 4 of /proc/PID/stat), None if it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def children_of(pid: int) -> list[int]:
    """The live processes whose parent is `pid`."""
    return [int(e.name) for e in Path("/proc").iterdir()
            if e.name.isdigit() and parent_of(int(e.name)) == pid]  # fmt: skip


def descendants_of(pid: int) -> list[int]:
    """Every live process below `pid` (children, their children, ...)."""
    found, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        found += kids
        todo += kids
    return found


def rank_of(pid: int) -> int | None:
    """The RANK a launcher gave a process (from its environment), None if it has none."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None
