"""Training runs started from the page (`unmask serve --allow-train`; docs/serving.md,
Training from the page): a queue that runs one `python -m unmask train` at a time, each in
a run folder of its own under --runs DIR, and the routes the page's Train tab calls.

A job names a run (`RUN_NAME`): its folder DIR/NAME must not exist yet (a user's run is
never overwritten), and is made when the job is queued, holding the job's config
(`JOB_CONFIG`, the validated config with train.output_dir set to the folder) and, once it
runs, the trainer's stdout and stderr (`JOB_LOG`). The config is parsed with
yaml.safe_load and validated in this process before anything is written: a bad key is a
400 with the one line `unmask train` prints. Refused as well (`refusals`), because a key
holder on another machine must not run code or read files as the server's user:
  - anything that imports code: the sampler hooks (`logits_hook`, `tokens_hook`, imported
    while the config is validated) and reward functions given as `module:function`;
  - a reward with `network: true` or `env:` (the network, the server's environment);
  - `train.report_to` other than tensorboard (wandb and trackio can send the run to a
    service with this machine's credentials);
  - a path the run would read (the dataset and its sources, the eval dataset, a tokenizer
    folder, model.pretrained, distill.teacher, a resume checkpoint) outside the runs folder,
    symlinks resolved; relative paths are read from the server's working folder, where
    the trainer runs.

Stop sends SIGTERM to the running job's process group: the trainer saves a checkpoint
after the step in progress and exits 0 (train/signals.py); a queued job is cancelled. The
server's own shutdown stops the running job the same way and waits up to `STOP_SECONDS` for
it (then kills it: the previous checkpoint stays intact, saves are renamed into place).

A job ends with its server whatever ends the server: each runs in a process group of its
own, asked for SIGTERM when the server is gone (Linux's PR_SET_PDEATHSIG, set by JOB_GUARD
before it execs the trainer), so a SIGKILLed server's job checkpoints and exits too.

The queue is kept in the runs folder (`JOBS_FILE`, rewritten on every change): a restarted
server lists the jobs, runs the queued ones, and marks a job that was running as ended (a
job still alive, its old server gone and its own end not reached, is followed until it
exits and can be stopped).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from unmask.config.compat import sections_to_tree, translate
from unmask.config.run import (
    apply_override,
    dump_config,
    parse_override,
    quickstart_yaml,
    validate_tree,
)
from unmask.errors import InputError
from unmask.rewards.spec import BUILTINS
from unmask.serve.protocol import RequestError, parse_request

#: a run's name: its folder's name under the runs folder
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
#: the job's config and its log, in its run folder
JOB_CONFIG, JOB_LOG = "job.yaml", "train.log"
#: the queue, in the runs folder: the jobs of this and earlier servers of the folder
JOBS_FILE = "train-jobs.json"
#: the repository's recipes (recipes/*.yaml), offered as "recipes/NAME" when present
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
RECIPE_PREFIX = "recipes/"
#: what the page may name the text it sends (the config it was picked from, a file's name)
SOURCE = re.compile(r"[^\x00-\x1f\x7f]{1,120}")
#: what starts a job on Linux (`_ending_with_server`): prctl(PR_SET_PDEATHSIG = 1, SIGTERM),
#: nothing run when the server (argv[1]) is gone already, then exec of the job's command
#: (argv[2:]; the death signal is kept across exec)
JOB_GUARD = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('unmask serve: the server that queued this job is gone')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)
#: what "pick a config" names the built-in quickstart (a folder's YAML files are the others)
QUICKSTART = "quickstart"
#: jobs waiting at once (more: 429), ended jobs listed (older ones are forgotten)
MAX_QUEUED, MAX_KEPT = 16, 100
#: bytes of a config (pasted, uploaded or picked) and of one log response
MAX_CONFIG_BYTES, LOG_CHUNK = 2**20, 2**16
#: overrides of one job
MAX_OVERRIDES = 64
#: seconds the server's shutdown waits for the running job to checkpoint and exit
STOP_SECONDS = 120.0
#: the reporters a job may use (the others reach services beyond this machine)
REPORTERS = ("tensorboard", "none")
#: keys that name code to import, anywhere in a config
HOOK_KEYS = ("logits_hook", "tokens_hook")
#: the 403 of every training route on a server started without --allow-train
OFF = ("training from the page is off; start the server with --allow-train (and --runs DIR) "
       "to queue runs here")  # fmt: skip

STATES = ("queued", "running", "finished", "failed", "stopped", "cancelled")


class TrainRequest(BaseModel):
    """POST /api/train: the run's name and its config (YAML text, or a name from the
    list GET /api/train gives), with `section.key=value` overrides."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    config_text: str | None = None
    config_name: str | None = None
    overrides: list[str] = Field(default_factory=list)
    source: str | None = None
    """With config_text: what the text is ("tiny.yaml (edited)", "run.yaml (uploaded)"),
    listed as the job's config; default "uploaded"."""


class TrainJob:
    """One queued run: its state (STATES), exit code and process."""

    def __init__(self, number: int, name: str, folder: Path, source: str):
        self.id, self.name, self.folder, self.source = str(number), name, folder, source
        self.state = "queued"
        self.exit_code: int | None = None
        self.stop_requested = False
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None  # the process (and its group) while it runs
        self.created, self.started, self.ended = time.time(), None, None

    @property
    def log(self) -> Path:
        return self.folder / JOB_LOG

    def view(self) -> dict[str, Any]:
        """What GET /api/train lists; has_metrics: the run has logged a step (the page asks
        for its curve only then)."""
        return {"id": self.id, "name": self.name, "state": self.state,
                "exit_code": self.exit_code, "source": self.source,
                "stopping": self.stop_requested and self.state == "running",
                "has_metrics": (self.folder / "metrics.jsonl").is_file(),
                "created": self.created, "started": self.started, "ended": self.ended}  # fmt: skip

    def record(self) -> dict[str, Any]:
        """The job as JOBS_FILE keeps it."""
        return {"id": self.id, "name": self.name, "source": self.source, "state": self.state,
                "exit_code": self.exit_code, "stop_requested": self.stop_requested,
                "pid": self.pid, "created": self.created, "started": self.started,
                "ended": self.ended}  # fmt: skip

    @classmethod
    def restored(cls, record: dict[str, Any], runs_dir: Path) -> TrainJob | None:
        """A job of JOBS_FILE, or None when the record is not one (a hand-edited file)."""
        try:
            name, number = str(record["name"]), int(record["id"])
            if not RUN_NAME.fullmatch(name) or record["state"] not in STATES:
                return None
            job = cls(number, name, runs_dir / name, str(record.get("source", "uploaded")))
            job.state, job.exit_code = record["state"], record.get("exit_code")
            job.stop_requested = bool(record.get("stop_requested"))
            pid = record.get("pid")
            job.pid = pid if isinstance(pid, int) and pid > 1 else None
            job.created = float(record.get("created") or 0.0)
            job.started, job.ended = record.get("started"), record.get("ended")
        except (KeyError, TypeError, ValueError):
            return None
        return job


def parse_config_text(text: str, where: str) -> dict:
    """The config tree of YAML text (config/run.py read_yaml's checks, without a file):
    InputError on YAML that is not valid, empty or not a mapping. where: "the config",
    "config 'NAME'"."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        at = f" at line {line + 1}" if line is not None else ""
        raise InputError(f"{where} is not valid YAML{at}") from None
    if data is None:
        raise InputError(f"{where} is empty; write the run's sections into it (model:, "
                         "data:, train:, ...)")  # fmt: skip
    if isinstance(data, list) and data and all(isinstance(e, dict) for e in data):
        return sections_to_tree(data, where)
    if not isinstance(data, dict):
        raise InputError(f"{where} must hold a mapping of sections")
    return data


def _section(tree: dict, name: str) -> dict:
    value = tree.get(name)
    return value if isinstance(value, dict) else {}


def _read_paths(tree: dict) -> list[tuple[str, str]]:
    """(key, path) of each file or folder the run would read."""
    data, model = _section(tree, "data"), _section(tree, "model")
    train, distill = _section(tree, "train"), _section(tree, "distill")
    found = []
    if data.get("dataset", "synthetic") != "synthetic":
        found.append(("data.dataset", data.get("dataset")))
    sources = data.get("sources")
    for i, source in enumerate(sources if isinstance(sources, list) else []):
        if isinstance(source, dict):
            found.append((f"data.sources[{i}].path", source.get("path")))
    if data.get("tokenizer", "char") != "char":
        found.append(("data.tokenizer", data.get("tokenizer")))
    found += [("data.eval_dataset", data.get("eval_dataset")),
              ("data.image_folder", data.get("image_folder")),
              ("model.pretrained", model.get("pretrained")),
              ("distill.teacher", distill.get("teacher"))]  # fmt: skip
    resume = train.get("resume_from_checkpoint")
    if isinstance(resume, str):
        found.append(("train.resume_from_checkpoint", resume))
    return [(key, value) for key, value in found if isinstance(value, str)]


def _hooks(node: Any, where: str = "") -> list[str]:
    """The dotted keys of every hook set in the tree."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            at = f"{where}.{key}" if where else str(key)
            if key in HOOK_KEYS and value is not None:
                found.append(at)
            found += _hooks(value, at)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _hooks(value, f"{where}[{i}]")
    return found


def refusals(tree: dict, runs_dir: Path, cwd: Path) -> str | None:
    """Why the page may not start this config (the module doc), or None. `tree`: unmask's
    own config tree, before validation (a hook is imported while validating)."""
    hooks = _hooks(tree)
    if hooks:
        return (f"{hooks[0]} names code to import, which a run started from the page may "
                "not: remove it, or run `unmask train` from a shell")  # fmt: skip
    rewards = tree.get("rewards")
    for i, item in enumerate(rewards if isinstance(rewards, list) else []):
        item = {"fn": item} if isinstance(item, str) else item
        if not isinstance(item, dict):
            continue  # validation names it
        fn = item.get("fn")
        if isinstance(fn, str) and fn not in BUILTINS:
            return (f"rewards[{i}].fn {fn!r} is a user function; the page runs the built-in "
                    f"rewards only ({', '.join(BUILTINS)}): run `unmask train` from a shell "
                    "for your own")  # fmt: skip
        if item.get("network") or item.get("env"):
            key = "network" if item.get("network") else "env"
            return (f"rewards[{i}].{key} gives a reward the network or this server's "
                    "environment; not from the page: remove it, or run `unmask train` from a "
                    "shell")  # fmt: skip
    report = _section(tree, "train").get("report_to")
    names = [report] if isinstance(report, str) else report if isinstance(report, list) else []
    for name in names:
        if isinstance(name, str) and name not in REPORTERS:
            return (f"train.report_to {name!r} can send the run beyond this machine; the page "
                    "allows tensorboard only")  # fmt: skip
    root = runs_dir.resolve()
    for key, value in _read_paths(tree):
        for path in {Path(value), Path(value).expanduser()}:
            resolved = (cwd / path).resolve()
            if resolved != root and root not in resolved.parents:
                return (f"{key} {value!r} is outside the runs folder; a run started from the "
                        "page reads files in the runs folder only: copy it there (relative "
                        f"paths are read from {str(cwd)!r})")  # fmt: skip
    return None


class TrainQueue:
    """Jobs run one at a time, in the order queued, by a thread of their own; every method
    is quick (the routes call them off the event loop: they touch the disk)."""

    def __init__(self, runs_dir: str | Path, cwd: str | Path | None = None,
                 python: str = sys.executable, max_queued: int = MAX_QUEUED):  # fmt: skip
        self.runs_dir = Path(runs_dir).resolve()
        self.cwd = Path(cwd if cwd is not None else os.getcwd()).resolve()
        self.python, self.max_queued = python, max_queued
        self._jobs: list[TrainJob] = []
        self._count = 0
        self._closing = False
        self._cond = threading.Condition()
        self._restore()
        self._worker = threading.Thread(target=self._work, name="unmask-train", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------------- configs

    def configs(self) -> list[str]:
        """What the page can pick: the quickstart, the YAML files directly in the runs
        folder (symlinks that lead out of it left out), then the repository's recipes
        ("recipes/NAME.yaml")."""
        names = []
        for path in sorted(self.runs_dir.iterdir()):
            if path.suffix in (".yaml", ".yml") and path.is_file():
                if self.runs_dir in path.resolve().parents:
                    names.append(path.name)
        recipes = sorted(RECIPES.glob("*.yaml")) if RECIPES.is_dir() else []
        return [QUICKSTART, *names, *(RECIPE_PREFIX + path.name for path in recipes)]

    def config_text(self, name: str) -> str:
        """The text of a config `configs` lists (a name, never a path): 404 otherwise."""
        if name == QUICKSTART:
            return quickstart_yaml()
        if name not in self.configs():
            raise RequestError(404, f"no config {name!r} to pick; GET /api/train lists them",
                               param="config_name")  # fmt: skip
        if name.startswith(RECIPE_PREFIX):
            path = RECIPES / name[len(RECIPE_PREFIX) :]
        else:
            path = self.runs_dir / name
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise RequestError(400, f"config {name!r} is over {MAX_CONFIG_BYTES} bytes")
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise RequestError(400, f"cannot read config {name!r} ({err})") from None

    def check_config(self, text: str, where: str, overrides: list[str], folder: Path) -> str:
        """The YAML the job runs: `text` with the overrides and train.output_dir = folder,
        validated; RequestError 400 with the one line `unmask train` would print."""
        try:
            tree = parse_config_text(text, where)
            for override in overrides:
                apply_override(tree, *parse_override(override))
            translated = translate(tree)
            refused = refusals(translated.tree, self.runs_dir, self.cwd)
            if refused is not None:
                raise RequestError(400, refused, code="config_refused")
            train = translated.tree.setdefault("train", {})
            if not isinstance(train, dict):
                raise InputError("config key 'train' must be a section (a mapping)")
            train["output_dir"] = str(folder)
            cfg = validate_tree(translated.tree, translated.notices)
        except InputError as err:
            raise RequestError(400, str(err), param="config", code="invalid_config") from None
        return dump_config(cfg)

    # ---------------------------------------------------------------------------- jobs

    def submit(self, name: str, config_text: str | None = None, config_name: str | None = None,
               overrides: list[str] | tuple = (), source: str | None = None) -> TrainJob:  # fmt: skip
        """Validate and queue a job (module doc); RequestError 400 (bad name or config),
        409 (the name is taken), 429 (queue full), 503 (shutting down)."""
        if not RUN_NAME.fullmatch(name):
            raise RequestError(400, f"run name {name!r} is not a folder name of 1-64 letters, "
                               "digits, '_', '.' or '-' starting with a letter or digit",
                               param="name")  # fmt: skip
        if (config_text is None) == (config_name is None):
            raise RequestError(400, "give either config_text (YAML) or config_name (one of "
                               "GET /api/train's configs)", param="config_text")  # fmt: skip
        if len(overrides) > MAX_OVERRIDES:
            raise RequestError(400, f"{len(overrides)} overrides are over {MAX_OVERRIDES}",
                               param="overrides")  # fmt: skip
        if config_text is not None:
            if len(config_text.encode()) > MAX_CONFIG_BYTES:
                raise RequestError(400, f"config_text is over {MAX_CONFIG_BYTES} bytes",
                                   param="config_text")  # fmt: skip
            if source is not None and not SOURCE.fullmatch(source):
                raise RequestError(400, "source is 1-120 printable characters (the config the "
                                   "text came from)", param="source")  # fmt: skip
            text, source, where = config_text, source or "uploaded", "the config"
        else:
            if source is not None:
                raise RequestError(400, "source names config_text; config_name is its own "
                                   "name", param="source")  # fmt: skip
            text, source = self.config_text(config_name), config_name
            where = f"config {source!r}"
        folder = self.runs_dir / name
        self._check_name(name, folder)
        config = self.check_config(text, where, list(overrides), folder)
        with self._cond:
            if self._closing:
                raise RequestError(503, "the server is shutting down", kind="server_error",
                                   code="shutting_down")  # fmt: skip
            waiting = sum(job.state == "queued" for job in self._jobs)
            if waiting >= self.max_queued:
                raise RequestError(429, f"{waiting} runs are queued already (at most "
                                   f"{self.max_queued}); wait for one to start",
                                   kind="rate_limit_error", code="queue_full")  # fmt: skip
            self._check_name(name, folder)
            try:
                folder.mkdir()
            except FileExistsError:
                self._check_name(name, folder)
                raise
            except OSError as err:
                raise RequestError(400, f"cannot make the run folder {name!r} "
                                   f"({err.strerror})", param="name") from None  # fmt: skip
            (folder / JOB_CONFIG).write_text(config)
            self._count += 1
            job = TrainJob(self._count, name, folder, source)
            self._jobs.append(job)
            self._forget()
            self._save()
            self._cond.notify_all()
        return job

    def _check_name(self, name: str, folder: Path) -> None:
        if os.path.lexists(folder):
            raise RequestError(409, f"the runs folder holds {name!r} already; a run started "
                               "here never replaces one: choose another name", param="name",
                               code="run_exists")  # fmt: skip

    def _forget(self) -> None:
        ended = [job for job in self._jobs if job.state not in ("queued", "running")]
        for job in ended[: max(0, len(ended) - MAX_KEPT)]:
            self._jobs.remove(job)

    def job(self, job_id: str) -> TrainJob:
        with self._cond:
            for job in self._jobs:
                if job.id == job_id:
                    return job
        raise RequestError(404, f"no job {job_id!r}; GET /api/train lists them", code="no_job")

    def jobs(self) -> list[dict[str, Any]]:
        with self._cond:
            return [job.view() for job in self._jobs]

    def stop(self, job_id: str) -> TrainJob:
        """A running job: SIGTERM (it checkpoints and exits; state `stopped` once it has);
        a queued one: cancelled. 409 for a job that has ended."""
        job = self.job(job_id)
        with self._cond:
            if job.state == "queued":
                job.state, job.ended = "cancelled", time.time()
            elif job.state == "running":
                job.stop_requested = True
                self._signal(job)
            else:
                raise RequestError(409, f"job {job_id} has ended ({job.state})",
                                   code="job_ended")  # fmt: skip
            self._save()
            self._cond.notify_all()
        return job

    @staticmethod
    def _signal(job: TrainJob, sig: int = signal.SIGTERM) -> None:
        """sig to the job's process group (the trainer and whatever it started)."""
        if job.proc is not None and job.proc.poll() is not None:
            return  # ended (its pid may be another process's by now)
        if job.pid is None or (job.proc is None and not _alive(job.pid)):
            return
        try:
            os.killpg(job.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    # ----------------------------------------------------------------------- the file

    def _save(self) -> None:
        """JOBS_FILE rewritten (under the lock): written aside, then renamed into place."""
        path = self.runs_dir / JOBS_FILE
        aside = path.with_name(f".{JOBS_FILE}.{os.getpid()}")
        try:
            aside.write_text(json.dumps({"jobs": [job.record() for job in self._jobs]}, indent=1))
            os.replace(aside, path)
        except OSError as err:  # the queue goes on in memory
            print(f"unmask: cannot write {path} ({err.strerror})", file=sys.stderr, flush=True)

    def _restore(self) -> None:
        """The jobs JOBS_FILE holds (module doc): running ones whose process is gone ended
        with their server; one still alive is followed (`_follow`)."""
        path = self.runs_dir / JOBS_FILE
        try:
            records = json.loads(path.read_text()).get("jobs", [])
        except FileNotFoundError:
            return
        except (OSError, ValueError, AttributeError) as err:
            print(f"unmask: {path} is not a job list ({err}); starting an empty queue",
                  file=sys.stderr, flush=True)  # fmt: skip
            return
        for record in records if isinstance(records, list) else []:
            job = TrainJob.restored(record, self.runs_dir) if isinstance(record, dict) else None
            if job is None:
                continue
            self._jobs.append(job)
            self._count = max(self._count, int(job.id))
            if job.state == "running":
                if job.pid is not None and _runs_job(job.pid, job.folder / JOB_CONFIG):
                    threading.Thread(target=self._follow, args=(job,), daemon=True,
                                     name=f"unmask-train-{job.id}").start()  # fmt: skip
                else:
                    self._ended_with_server(job)
        self._save()

    def _ended_with_server(self, job: TrainJob) -> None:
        """A running job whose process has gone without this server seeing it end."""
        try:
            with open(job.log, "rb") as log:
                log.seek(max(0, os.fstat(log.fileno()).st_size - 4096))
                tail = log.read().decode(errors="replace")
        except OSError:
            tail = ""
        job.state = "stopped" if "stopped by SIGTERM" in tail else "failed"
        job.ended, job.pid = job.ended or time.time(), None
        self._note(job, f"{job.state} (ended with the server that ran it)")

    def _follow(self, job: TrainJob) -> None:
        """A job of an earlier server still running: polled until it exits."""
        while _runs_job(job.pid, job.folder / JOB_CONFIG):
            time.sleep(0.5)
        with self._cond:
            self._ended_with_server(job)
            self._save()
            self._cond.notify_all()

    def read_log(self, job_id: str, offset: int) -> dict[str, Any]:
        """The job's log from byte `offset`, at most LOG_CHUNK bytes (cut at a character's
        end), the offset to ask next, the log's size and the job's state."""
        job = self.job(job_id)
        state = job.state  # before reading: a job seen ended has its whole log read
        text, end, size = "", offset, 0
        try:
            with open(job.log, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                offset = min(offset, size)
                handle.seek(offset)
                chunk = handle.read(LOG_CHUNK)
        except FileNotFoundError:
            chunk, offset = b"", 0
        for cut in range(4):  # a UTF-8 character split by the chunk's end waits for its rest
            try:
                text = chunk[: len(chunk) - cut].decode()
                break
            except UnicodeDecodeError:
                continue
        else:
            text, cut = chunk.decode(errors="replace"), 0
        end = offset + len(chunk) - cut
        return {"id": job.id, "text": text, "offset": end, "size": size, "state": state,
                "more": end < size}  # fmt: skip

    # ------------------------------------------------------------------------ the runner

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._closing and (
                        not any(j.state == "queued" for j in self._jobs)
                        or any(j.state == "running" for j in self._jobs)):  # fmt: skip
                    self._cond.wait(1.0)
                if self._closing:
                    return
                job = next(j for j in self._jobs if j.state == "queued")
                job.state, job.started = "running", time.time()
                self._save()
            self._run(job)

    def _run(self, job: TrainJob) -> None:
        command = [self.python, "-m", "unmask", "train", str(job.folder / JOB_CONFIG),
                   "train.overwrite_output_dir=true"]  # fmt: skip
        # overwrite: the folder is new but holds the job's files; nothing of a run is there
        # to replace (resume commands leave this override out: run_dir.resume_command)
        env = {k: v for k, v in os.environ.items() if k != "UNMASK_API_KEY"}  # not the run's
        env["PYTHONUNBUFFERED"] = "1"
        try:
            with open(job.log, "ab") as log:
                log.write(f"unmask serve: job {job.id} runs unmask train {job.folder / JOB_CONFIG}"
                          f" (from {job.source}) in {self.cwd}\n".encode())  # fmt: skip
                log.flush()
                proc = subprocess.Popen(_ending_with_server(command, self.python), cwd=self.cwd, env=env, stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip
        except (OSError, subprocess.SubprocessError) as err:
            with self._cond:
                job.state, job.ended = "failed", time.time()
                self._note(job, f"could not start: {err}")
                self._save()
            return
        with self._cond:
            job.proc, job.pid = proc, proc.pid
            self._save()
            if job.stop_requested:  # a stop (or the shutdown) came while it was starting
                self._signal(job)
        code = proc.wait()
        with self._cond:
            job.exit_code, job.ended = code, time.time()
            if job.stop_requested:
                job.state = "stopped"
            else:
                job.state = "finished" if code == 0 else "failed"
            how = f"stopped on request, exit code {code}" if job.stop_requested else (
                f"exit code {code}")  # fmt: skip
            self._note(job, f"{job.state} ({how})")
            job.pid = None
            self._save()
            self._cond.notify_all()

    @staticmethod
    def _note(job: TrainJob, text: str) -> None:
        try:
            with open(job.log, "ab") as log:
                log.write(f"unmask serve: job {job.id} {text}\n".encode())
        except OSError:
            pass

    def close(self, timeout: float = STOP_SECONDS) -> None:
        """The server's shutdown: the running job sent SIGTERM and waited for up to
        `timeout` seconds (then killed); queued jobs stay queued in JOBS_FILE for the next
        server of the folder."""
        with self._cond:
            self._closing = True
            running = [job for job in self._jobs if job.state == "running"]
            for job in running:
                job.stop_requested = True
                self._signal(job)
            self._cond.notify_all()
        if running:
            print(f"unmask: stopping training run {running[0].name!r} (SIGTERM: it saves a "
                  f"checkpoint; up to {timeout:g} s)", file=sys.stderr, flush=True)  # fmt: skip
        self._worker.join(timeout)
        if self._worker.is_alive():
            for job in running:
                self._signal(job, signal.SIGKILL)
            self._worker.join(10)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: not a job of this server's user
        return False
    return True


def _runs_job(pid: int | None, config: Path) -> bool:
    """Whether process `pid` is alive and runs `unmask train CONFIG` (a pid is reused)."""
    if pid is None or not _alive(pid):
        return False
    proc = Path(f"/proc/{pid}")
    if not proc.is_dir():  # no /proc (macOS): the pid alone
        return True
    try:
        command = (proc / "cmdline").read_bytes().split(b"\0")
        state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False  # gone meanwhile
    return state != "Z" and str(config).encode() in command  # Z: ended, not yet reaped


def _ending_with_server(command: list[str], python: str) -> list[str]:
    """command, started through JOB_GUARD on Linux (the job asks for SIGTERM when the
    server's thread that started it ends, the server SIGKILLed included, then execs the
    command); elsewhere as it is: jobs end with a clean shutdown only. A wrapper rather
    than subprocess's preexec_fn, which may deadlock in a threaded server."""
    if not sys.platform.startswith("linux"):
        return command
    return [python, "-c", JOB_GUARD, str(os.getpid()), *command]


def routes(server, route: Callable, read_json: Callable) -> list[Route]:
    """The Train tab's routes; each answers 403 unless the server has a TrainQueue
    (`server.training`, --allow-train). `route` wraps a handler with the API key check and
    the error bodies (app.build_app); `read_json(request)` reads a body within the limits."""

    def queue() -> TrainQueue:
        if server.training is None:
            raise RequestError(403, OFF, code="training_off")
        return server.training

    async def listing(request: Request):
        q = queue()
        configs = await run_in_threadpool(q.configs)
        return JSONResponse({"jobs": q.jobs(), "configs": configs, "states": list(STATES)})

    async def config(request: Request):
        text = await run_in_threadpool(queue().config_text, request.path_params["name"])
        return JSONResponse({"name": request.path_params["name"], "text": text})

    async def submit(request: Request):
        q = queue()
        req = parse_request(TrainRequest, await read_json(request))
        job = await run_in_threadpool(q.submit, req.name, req.config_text, req.config_name,
                                      req.overrides, req.source)  # fmt: skip
        return JSONResponse(job.view(), status_code=201)

    async def stop(request: Request):
        job = await run_in_threadpool(queue().stop, request.path_params["id"])
        return JSONResponse(job.view())

    async def log(request: Request):
        raw = request.query_params.get("offset", "0")
        if not raw.isdigit() or len(raw) > 18:
            raise RequestError(400, f"offset {raw!r} is not a byte offset (0, 1, ...)",
                               param="offset")  # fmt: skip
        return JSONResponse(await run_in_threadpool(queue().read_log, request.path_params["id"],
                                                    int(raw)))  # fmt: skip

    return [
        Route("/api/train", route(listing), methods=["GET"]),
        Route("/api/train", route(submit), methods=["POST"]),
        Route("/api/train/configs/{name:path}", route(config), methods=["GET"]),
        Route("/api/train/{id}/stop", route(stop), methods=["POST"]),
        Route("/api/train/{id}/log", route(log), methods=["GET"]),
    ]
