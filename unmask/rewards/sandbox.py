"""The training process's side of a reward worker (unmask/rewards/worker.py): start it, hand
it batches of calls, take back their scores, and stop it when it does not answer in time.

The worker is a separate interpreter, started once and kept for the whole run; each call it
makes runs in a fork of it (about a millisecond, against tens of milliseconds for a fresh
interpreter, docs/rewards.md). Replies are JSON, never pickles.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

WORKER_SCRIPT = Path(__file__).with_name("worker.py")
HEADER = struct.Struct(">I")
#: seconds a worker may take to start and import the user's module
START_TIMEOUT_S = 60.0
#: seconds of slack on top of the calls' own limits before the worker counts as hung
SLACK_S = 10.0


class WorkerError(Exception):
    """The worker could not start or load its function: kind is one of module_missing,
    import_raised, attribute_missing, not_callable, start_failed."""

    def __init__(self, kind: str, message: str, names: list[str] | None = None):
        super().__init__(message)
        self.kind, self.message, self.names = kind, message, names or []


def search_path() -> list[str]:
    """Where the worker looks for user modules: the directory this process runs in, then
    this process's own sys.path (PYTHONPATH, site-packages), as absolute paths."""
    cwd = os.getcwd()
    out: list[str] = []
    for entry in [cwd, *sys.path]:
        entry = os.path.abspath(entry) if entry else cwd
        if entry not in out:
            out.append(entry)
    return out


def _stop(proc: subprocess.Popen | None, root: str | None) -> None:
    if proc is not None and proc.poll() is None:
        try:
            proc.stdin.close()  # the worker ends on end of input
            proc.wait(timeout=1.0)
        except (OSError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
    if proc is not None:
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


class Worker:
    """One worker process for one reward: `target` is `module:function` or "builtin:code"."""

    def __init__(self, target: str, *, timeout_s: float, memory_mb: int, parallel: int,
                 options: dict | None = None, start_timeout_s: float = START_TIMEOUT_S):  # fmt: skip
        self.target, self.timeout_s, self.memory_mb = target, timeout_s, memory_mb
        self.parallel, self.options, self.start_timeout_s = parallel, options or {}, start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.root: str | None = None
        self.pid: int | None = None
        self.write_guard = self.memory_limit = False
        self._pending = 0
        self._finalizer = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the worker and load the function; WorkerError when it cannot."""
        self.close()
        self.root = tempfile.mkdtemp(prefix="unmask-reward-")
        env = dict(os.environ, HOME=self.root, TMPDIR=self.root, PYTHONDONTWRITEBYTECODE="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER_SCRIPT)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, cwd=self.root, env=env, start_new_session=True,
        )  # fmt: skip
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.root)
        init = {"path": search_path(), "target": self.target, "root": self.root,
                "timeout_s": self.timeout_s, "memory_mb": self.memory_mb,
                "parallel": self.parallel, "options": self.options}  # fmt: skip
        reply = self._send(init) and self._receive(self.start_timeout_s)
        if not isinstance(reply, dict):
            self.close()
            raise WorkerError("start_failed", self._gone(reply, self.start_timeout_s))
        if "error" in reply:
            self.close()
            error = reply["error"]
            raise WorkerError(error["kind"], error["message"], error.get("names"))
        self.pid = reply["pid"]
        self.write_guard, self.memory_limit = reply["write_guard"], reply["memory_limit"]

    def submit(self, items: list[tuple[str, str, dict]]) -> None:
        """Send a batch of (prompt, completion, record) calls; collect() takes the scores."""
        if not self.alive:
            self.start()
        self._pending = len(items)
        if not self._send({"items": items}):
            self._pending = -len(items)  # collect() reports the dead worker

    def collect(self) -> list[list]:
        """[score, None] or [None, error] per submitted call. A worker that dies or does not
        answer within its calls' limits plus SLACK_S is killed (the next submit restarts
        it) and every call of the batch fails."""
        n = abs(self._pending)
        budget = math.ceil(n / self.parallel) * (self.timeout_s + 1.0) + SLACK_S
        reply = self._receive(budget) if self._pending > 0 else None
        self._pending = 0
        if isinstance(reply, dict) and len(reply.get("results", ())) == n:
            return reply["results"]
        error = self._gone(reply, budget)
        self.close()
        return [[None, error] for _ in range(n)]

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self.proc = self._finalizer = None
        self.root = self.pid = None

    # --- pipes --------------------------------------------------------------------------

    def _send(self, message: dict) -> bool:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.proc.stdin.write(HEADER.pack(len(data)) + data)
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def _receive(self, timeout_s: float) -> dict | str | None:
        """The next message, "timeout", or None when the worker closed its end."""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        buffer = b""
        need, header_read = HEADER.size, False
        while True:
            if len(buffer) == need:
                if header_read:
                    return json.loads(buffer[HEADER.size :])
                need += HEADER.unpack(buffer)[0]
                header_read = True
                continue
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return "timeout"
            chunk = os.read(fd, need - len(buffer))
            if not chunk:
                return None
            buffer += chunk

    def _gone(self, reply, timeout_s: float) -> str:
        if reply == "timeout":
            return f"the reward worker did not answer within {timeout_s:g} s and was stopped"
        if isinstance(reply, dict):
            return "the reward worker sent a malformed reply and was stopped"
        code = self.proc.wait() if self.proc is not None else None
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return f"the reward worker died ({how})"
