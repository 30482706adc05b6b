"""The training process's side of a reward worker (unmask/rewards/worker.py): start it, hand
it batches of calls, take back their scores, and stop it when it does not answer in time.

The worker is a separate interpreter, started once and kept for the whole run; each call it
makes runs in a fork of it (about a millisecond, against tens of milliseconds for a fresh
interpreter, docs/rewards.md). Replies are JSON, never pickles, and every score is checked
again here. It gets an environment of allow-listed variables only (PASSED_ENV), and puts
itself behind the guards of isolation.py; the guards it could not have are said once.
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

from unmask.rewards import isolation

WORKER_SCRIPT = Path(__file__).with_name("worker.py")
HEADER = struct.Struct(">I")
#: seconds a worker may take to start and import the user's module
START_TIMEOUT_S = 60.0
#: seconds of slack on top of the calls' own limits before the worker counts as hung
SLACK_S = 10.0
#: False: workers make no namespace (what a kernel without them gives; for tests)
USE_NAMESPACES = True
#: largest |score| a reward may return: beyond it (or not finite) a call is a failure, so
#: that the float32 weighted total stays exact enough and finite
MAX_ABS_REWARD = 1e6
#: environment variables a worker gets from the training process (and LC_*), besides HOME
#: and TMPDIR (its folder) and the names in a reward's `env:`: none of them a secret
PASSED_ENV = frozenset(
    "PATH LANG LANGUAGE TZ TERM PYTHONPATH PYTHONHASHSEED PYTHONUTF8 PYTHONIOENCODING "
    "VIRTUAL_ENV LD_LIBRARY_PATH CUDA_VISIBLE_DEVICES OMP_NUM_THREADS MKL_NUM_THREADS "
    "OPENBLAS_NUM_THREADS HF_HOME HF_HUB_CACHE HF_HUB_OFFLINE TRANSFORMERS_OFFLINE".split()
)
#: what a guard that is missing leaves reward code free to do, by guard (docs/rewards.md)
_LEFT_OPEN = {
    "write_guard": "change files outside its folder",
    "network": "use the network",
    "udp": "use the network but TCP (UDP, for one)",
    "signals": "see and signal your other processes (the trainer too)",
    "own_proc": "read your other processes' environment in /proc",
    "call_namespaces": "leave processes behind that start their own session",
    "process_limit": "start processes without limit",
}
_said: set[str] = set()


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


def process_limit(parallel: int) -> int:
    """Most tasks (processes and threads) a worker and its calls may have at once: room for
    each call, the worker and a thread pool per CPU (torch, numpy) in each."""
    return (parallel + 1) * (64 + 2 * (os.cpu_count() or 1))


def worker_environment(root: str, names=()) -> dict[str, str]:
    """The worker's environment: PASSED_ENV, LC_* and `names` from this process's, HOME
    and TMPDIR set to its folder; nothing else (tokens, keys, passwords stay here)."""
    env = {k: v for k, v in os.environ.items()
           if k in PASSED_ENV or k.startswith("LC_") or k in names}  # fmt: skip
    return {**env, "HOME": root, "TMPDIR": root, "PYTHONDONTWRITEBYTECODE": "1"}


def left_open(guards: dict, network: bool) -> list[str]:
    """What reward code can do here that docs/rewards.md says the guards stop, given which
    guards the worker has (Worker.guards)."""
    no_network = network or guards.get("network_namespace")
    held = {
        "write_guard": guards.get("write_guard"),
        "network": no_network or guards.get("tcp_blocked"),
        "udp": no_network or not guards.get("tcp_blocked"),  # said instead of "network"
        "signals": guards.get("pid_namespace") or guards.get("signals_scoped"),
        "own_proc": guards.get("own_proc"),
        "call_namespaces": guards.get("call_namespaces"),
        "process_limit": guards.get("process_limit"),
    }
    return [_LEFT_OPEN[name] for name, holds in held.items() if not holds]


def notice_line(guards: dict, network: bool) -> str | None:
    """The line that names what reward code can do here because a guard could not be had
    (and why not), or None when every guard holds."""
    lost = left_open(guards, network)
    if not lost:
        return None
    why = "; ".join(guards.get("why", [])) or "not available here"
    return (f"unmask: reward workers run with fewer guards here ({why}): reward code may "
            f"{', '.join(lost)} (docs/rewards.md, What the sandbox is)")  # fmt: skip


def checked_result(result, limit: float = MAX_ABS_REWARD) -> list:
    """A worker's [score, None] or [None, error], checked: a score that is no finite number
    within ±limit, or anything else, becomes a failure."""
    if isinstance(result, list) and len(result) == 2:
        score, error = result
        if error is None and type(score) in (int, float):
            if not math.isfinite(score):
                return [None, f"returned {score}, not a finite number"]
            if abs(score) <= limit:
                return [float(score), None]
            return [None, f"returned {score:g}, beyond the reward limit of ±{limit:g}"]
        if score is None and isinstance(error, str):
            return [None, error]
    return [None, "the reward worker sent a malformed result"]


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
    if proc is not None:  # its pids cgroup: gone already unless the worker was killed
        isolation.remove_cgroup(isolation.cgroup_folder(proc.pid))
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


class Worker:
    """One worker process for one reward: `target` is `module:function` or "builtin:code";
    `network` lets its calls use the network, `env` names variables it gets besides
    PASSED_ENV."""

    def __init__(self, target: str, *, timeout_s: float, memory_mb: int, parallel: int,
                 options: dict | None = None, start_timeout_s: float | None = None,
                 network: bool = False, env=()):  # fmt: skip
        self.target, self.timeout_s, self.memory_mb = target, timeout_s, memory_mb
        self.parallel, self.options = parallel, options or {}
        self.network, self.env = network, tuple(env)
        self.start_timeout_s = start_timeout_s or START_TIMEOUT_S
        self.proc: subprocess.Popen | None = None
        self.root: str | None = None
        self.pid: int | None = None
        self.guards: dict = {}
        """What the worker's guards are (isolation.py names; "why": what it could not have)."""
        self._pending = 0
        self._unsendable: str | None = None
        self._finalizer = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the worker and load the function; WorkerError when it cannot."""
        self.close()
        self.root = tempfile.mkdtemp(prefix="unmask-reward-")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER_SCRIPT)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, cwd=self.root, start_new_session=True,
            env=worker_environment(self.root, self.env),
        )  # fmt: skip
        self.guards = {}
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.root)
        init = {"path": search_path(), "target": self.target, "root": self.root,
                "timeout_s": self.timeout_s, "memory_mb": self.memory_mb,
                "parallel": self.parallel, "options": self.options, "network": self.network,
                "namespaces": USE_NAMESPACES,
                "max_abs_reward": MAX_ABS_REWARD,
                "process_limit": process_limit(self.parallel)}  # fmt: skip
        reply = self._send(init) and self._receive(self.start_timeout_s)
        if not isinstance(reply, dict):
            why = self._gone(reply, self.start_timeout_s)
            self.close()
            raise WorkerError("start_failed", why)
        if "error" in reply:
            self.close()
            error = reply["error"]
            raise WorkerError(error["kind"], error["message"], error.get("names"))
        self.pid = reply["pid"]
        self.guards.update(reply["guards"])
        self._say_what_is_left_open()

    @property
    def write_guard(self) -> bool:
        return bool(self.guards.get("write_guard"))

    def _say_what_is_left_open(self) -> None:
        """notice_line on stderr, once per process and situation."""
        line = notice_line(self.guards, self.network)
        if line is not None and line not in _said:
            _said.add(line)
            print(line, file=sys.stderr)

    def submit(self, items: list[tuple[str, str, dict]]) -> None:
        """Send a batch of (prompt, completion, record) calls; collect() takes the scores."""
        if not self.alive:
            self.start()
        self._pending, self._unsendable = len(items), None
        try:
            data = pickle.dumps({"items": items}, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # noqa: BLE001 - a record holding a lambda, a socket, ...
            self._pending = -len(items)
            self._unsendable = f"its record cannot be sent to the reward worker ({err})"
            return
        if not self._send_bytes(data):
            self._pending = -len(items)  # collect() reports the dead worker

    def collect(self) -> list[list]:
        """[score, None] or [None, error] per submitted call. A worker that dies or does not
        answer within its calls' limits plus SLACK_S is killed (the next submit restarts
        it) and every call of the batch fails."""
        n = abs(self._pending)
        budget = math.ceil(n / self.parallel) * (self.timeout_s + 1.0) + SLACK_S
        reply = self._receive(budget) if self._pending > 0 else None
        self._pending = 0
        if self._unsendable is not None:
            return [[None, self._unsendable] for _ in range(n)]
        if isinstance(reply, dict) and len(reply.get("results", ())) == n:
            return [checked_result(result) for result in reply["results"]]
        error = self._gone(reply, budget)
        self.close()
        return [[None, error] for _ in range(n)]

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self.proc = self._finalizer = None
        self.root = self.pid = None
        self.guards = {}

    # --- pipes --------------------------------------------------------------------------

    def _send(self, message: dict) -> bool:
        return self._send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _send_bytes(self, data: bytes) -> bool:
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
