"""Whether a run is alive: the trainer's heartbeat file and the one status rule that reads it
(`unmask runs` and the server's runs view both call `run_status`).

While a run trains, its rank 0 keeps `heartbeat.json` in the run directory up to date: a
thread rewrites it every HEARTBEAT_SECONDS (so a step that takes minutes still beats),
atomically, with

    {"status": "running", "pid": 1234, "host": "node-3", "started": ..., "updated": ...,
     "step": 120, "step_time": ...}

(`step`: the last step finished, `step_time`: when, both epoch seconds). When train()
ends the file says how: `finished`, `stopped` (a stop signal, a checkpoint saved) or
`failed` (an error, its traceback printed).

The rule (`run_status`), in this order:
  - `finished`: the heartbeat says so, or (no heartbeat: an older run) final/ holds a model
    and the last logged step is the planned total;
  - `running`: the heartbeat says running, and its process is alive: on this host, the pid
    exists and started before the heartbeat did (a later one reused the number); on
    another host (a shared folder), the file was rewritten within STALE_SECONDS;
  - `crashed`: the heartbeat says running but its process is gone (the pid is not alive on
    this host, or the file is older than STALE_SECONDS on another one), or it says failed;
  - `stopped at step N`: the heartbeat says stopped, or (no heartbeat) checkpoint-N is the
    newest checkpoint and nothing was logged after it;
  - else `crashed` (no heartbeat, steps logged after the newest checkpoint or none saved).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

HEARTBEAT_FILE = "heartbeat.json"
#: seconds between two rewrites of the heartbeat while a run trains
HEARTBEAT_SECONDS = 5.0
#: a heartbeat not rewritten for this long, written on another host, is a dead run's
STALE_SECONDS = 60.0


def this_host() -> str:
    return socket.gethostname()


def read_heartbeat(run_dir: str | Path) -> dict | None:
    """The run's heartbeat record, or None (none written, or not a JSON object)."""
    try:
        record = json.loads((Path(run_dir) / HEARTBEAT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (signal 0 checks, sends nothing)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    except OSError:
        return False
    return _not_zombie(pid)


def _not_zombie(pid: int) -> bool:
    """False for a process that has exited but was not waited for (state Z in /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): kill(0) is the answer
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]


def process_started(pid: int) -> float | None:
    """When process pid started (epoch seconds, from /proc), or None where /proc does not
    say (macOS, a process gone)."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))  # fmt: skip
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def heartbeat_alive(record: dict, now: float | None = None) -> bool:
    """Whether the process that wrote a `running` heartbeat still runs (the module doc). On
    its host a live pid that started after the heartbeat did is another process (the pid
    was reused, after a reboot say): the run's is gone."""
    now = time.time() if now is None else now
    if record.get("host") == this_host():
        pid, started = record.get("pid"), record.get("started")
        if not pid_alive(pid):
            return False
        began = process_started(pid)
        reused = isinstance(started, (int, float)) and began is not None and began > started + 2
        return not reused  # 2 s of slack: /proc counts in clock ticks, clocks may be set
    updated = record.get("updated")
    return isinstance(updated, (int, float)) and now - updated <= STALE_SECONDS


def run_status(*, heartbeat: dict | None, finished_files: bool, saved: int | None,
               last_logged: int | None, now: float | None = None) -> str:  # fmt: skip
    """The status of a run (the module doc's rule). heartbeat: `read_heartbeat`;
    finished_files: final/ holds a model and the last logged step is the planned total;
    saved: the newest complete checkpoint's step; last_logged: the last logged step."""
    said = heartbeat.get("status") if heartbeat else None
    if said == "finished" or (said is None and finished_files):
        return "finished"
    if said == "running":
        return "running" if heartbeat_alive(heartbeat, now) else "crashed"
    if said == "failed":
        return "crashed"
    if saved is not None and (said == "stopped" or last_logged is None or last_logged <= saved):
        return f"stopped at step {saved}"
    return "crashed"


def mark_running(run_dir: str | Path) -> None:
    """One `running` record of this process, no thread: the trainer writes it with the run
    folder's config.yaml, so a run between its set-up and its first step reads `running`,
    and one that fails there reads `crashed` once its process is gone."""
    now = time.time()
    record = {"status": "running", "pid": os.getpid(), "host": this_host(), "started": now,
              "updated": now, "step": None, "step_time": None}  # fmt: skip
    for stale in Path(run_dir).glob(f".{HEARTBEAT_FILE}.*.tmp"):  # a killed writer's
        stale.unlink(missing_ok=True)
    _write_record(Path(run_dir) / HEARTBEAT_FILE, record)


def _write_record(path: Path, record: dict) -> None:
    """record as path's JSON, atomically (a reader never sees half a file); a full or
    vanished disk is not the run's business here: nothing is written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # hidden, as other temporaries
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:
        pass


class Heartbeat:
    """Keeps run_dir/heartbeat.json current while a run trains (the module doc). `beat(step)`
    after each step records it (no I/O: the thread writes); `end(status)` writes the last
    record and stops the thread. Also a context manager ending `failed` on an error."""

    def __init__(self, run_dir: str | Path, every: float = HEARTBEAT_SECONDS):
        self.path = Path(run_dir) / HEARTBEAT_FILE
        self.every = every
        now = time.time()
        self.record = {"status": "running", "pid": os.getpid(), "host": this_host(),
                       "started": now, "updated": now, "step": None, "step_time": None}  # fmt: skip
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._write()
        self._thread = threading.Thread(target=self._run, name="unmask-heartbeat", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        self.record["step"], self.record["step_time"] = step, time.time()

    def end(self, status: str) -> None:
        """The last record: finished, stopped or failed; the thread stops."""
        if self._done.is_set():
            return
        self._done.set()
        self._thread.join()
        self.record["status"] = status
        self._write()

    def __enter__(self) -> Heartbeat:
        return self

    def __exit__(self, kind, error, trace) -> None:
        self.end("failed" if kind is not None else "finished")

    def _run(self) -> None:
        while not self._done.wait(self.every):
            self._write()

    def _write(self) -> None:
        with self._lock:
            self.record["updated"] = time.time()
            _write_record(self.path, self.record)
