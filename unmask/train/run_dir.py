"""The run directory's life: checked before anything is written, resumed, or started fresh.

`prepare_output_dir` runs before anything is written (on rank 0): it refuses a folder that
holds another run unless asked to resume or overwrite, picks the newest intact checkpoint
for `resume_from_checkpoint: true` (starting fresh, and saying so, when there is none yet,
so one requeue command serves every launch) and removes the temporary folders of saves
that were killed.
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Sequence
from pathlib import Path

import yaml

from unmask.checkpoint import list_checkpoints, resolve_resume
from unmask.checkpoint.layout import newest_intact, remove_temporaries
from unmask.config import RunConfig
from unmask.errors import InputError, RunStopped
from unmask.parallel.mesh import share_from_rank0
from unmask.train.metrics import METRICS_FILE

CONFIG_FILE = "config.yaml"
CONFIG_HISTORY = "config_history"  # earlier config.yaml files of a resumed run
RUN_ARTIFACTS = (CONFIG_FILE, CONFIG_HISTORY, METRICS_FILE, "tensorboard", "final",
                 "eval_results.json")  # fmt: skip
# keys that say how to start, not what the run is: never reported as changes
_START_KEYS = {"train.resume_from_checkpoint", "train.overwrite_output_dir"}


def prepare_output_dir(out: Path, cfg: RunConfig) -> tuple[Path | None, list[str]]:
    """Check output_dir before anything is written; returns the checkpoint to resume from
    (None: start fresh) and lines to print at start-up."""
    t = cfg.train
    if out.exists() and not out.is_dir():
        raise InputError(f"output_dir {str(out)!r} is a file; choose a folder path")
    check_writable(out)
    notices = []
    resume = resolve_resume(out, t.resume_from_checkpoint)
    if t.resume_from_checkpoint is True:
        _, damaged = newest_intact(out)
        notices += [f"{line}; passed over" for line in damaged]
    holds_run = out.is_dir() and any(out.iterdir())
    fresh_after_resume = resume is None and t.resume_from_checkpoint is True and holds_run
    if fresh_after_resume:
        notices.append(
            f"no intact checkpoint in {str(out)!r} yet: starting fresh (the logs of the "
            "run that stopped before its first checkpoint are replaced)"
        )
    elif resume is None and holds_run and not t.overwrite_output_dir:
        raise InputError(
            f"output_dir {str(out)!r} already holds a run; set "
            "train.resume_from_checkpoint=true to continue it, "
            "train.overwrite_output_dir=true to replace it, or choose another output_dir"
        )
    if resume is None and holds_run:
        # overwrite: the whole old run; a fresh start after resume: its logs only (a
        # damaged checkpoint stays for the user to look at)
        old = list_checkpoints(out) if not fresh_after_resume else []
        for path in old + [out / name for name in RUN_ARTIFACTS]:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    removed = remove_temporaries(out)
    if removed:
        notices.append(f"removed {len(removed)} unfinished save(s) of a stopped run: {removed}")
    return resume, notices


def check_writable(out: Path) -> None:
    """output_dir is, or can be made as, a folder this process may write into."""
    folder = Path(out).absolute()
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise InputError(
            f"output_dir {str(out)!r} cannot be created: {str(folder)!r} is a file; choose "
            "another output_dir"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(
            f"output_dir {str(out)!r}: no write permission in {str(folder)!r}; choose a folder "
            "you can write to"
        )


def room_for_checkpoint(checkpointer, model, optimizer, on_disk_full: str, step: int) -> str:
    """'' when the output_dir's disk has room for checkpoint-{step} (the size of the newest
    checkpoint, else of the model and optimizer state in memory, plus 10%); else the line
    to print when on_disk_full is continue, and RunStopped when it is stop."""
    out = checkpointer.output_dir
    need, free = share_from_rank0(
        lambda: (checkpointer.bytes_needed(model, optimizer), shutil.disk_usage(out).free)
    )
    if free >= need:
        return ""
    message = (
        f"not enough free space in {str(out)!r} for checkpoint-{step} "
        f"(needs about {need / 1e9:.2f} GB, {free / 1e9:.2f} GB free)"
    )
    if on_disk_full == "continue":
        return message + "; training on to the next save"
    newest = newest_intact(out)[0]
    raise RunStopped(
        f"{message}; free space and resume from {newest or 'the start'} "
        "(train.resume_from_checkpoint=true), or set train.on_disk_full=continue"
    )


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(old_text: str, new_text: str) -> list[str]:
    """'key: old -> new' for every setting that differs between two config.yaml texts."""
    try:
        old = _flat(yaml.safe_load(old_text) or {})
    except yaml.YAMLError:
        return ["the previous config.yaml is not readable YAML"]
    new = _flat(yaml.safe_load(new_text))
    return [
        f"{key}: {old.get(key, '(unset)')} -> {new.get(key, '(unset)')}"
        for key in sorted(set(old) | set(new))
        if key not in _START_KEYS and old.get(key) != new.get(key)
    ]


def write_config(out: Path, text: str, step: int) -> list[str]:
    """Write config.yaml; on a resume with other settings, first keep the one it replaces as
    config_history/step-{step}.yaml and return what changed (else [])."""
    path = out / CONFIG_FILE
    changes = []
    if step and path.is_file():
        old = path.read_text()
        changes = config_changes(old, text)
        if changes:
            history = out / CONFIG_HISTORY
            history.mkdir(exist_ok=True)
            kept = history / f"step-{step}.yaml"
            if kept.exists():  # resumed from the same step again: keep every version
                kept = history / f"step-{step}-{len(list(history.iterdir()))}.yaml"
            kept.write_text(old)
    path.write_text(text)
    return changes


def resume_command(command_line: Sequence[str]) -> str:
    """The command that resumes the run `command_line` started (['unmask', 'train', FILE,
    'key=value', ...], as the user typed it): the same, without the keys that say how to
    start (an overwrite_output_dir=true would delete the run), with
    train.resume_from_checkpoint=true; quoted for a shell."""
    kept = [arg for arg in command_line if arg.split("=", 1)[0].strip() not in _START_KEYS]
    return shlex.join([*kept, "train.resume_from_checkpoint=true"])
