"""The run directory's life: checked before anything is written, resumed, or started fresh.

`prepare_output_dir` runs before anything is written (on rank 0): it refuses a folder that
holds another run unless asked to resume or overwrite, and for `resume_from_checkpoint:
true` picks the newest checkpoint, which must be intact. It starts fresh only when no
checkpoint was ever published there: a folder that does not exist yet (said loudly, with
the runs nearby that could have been meant) or a run killed before its first save (so one
requeue command serves every launch). A newest checkpoint damaged after it was published,
a final/ without a checkpoint, or files no run writes are refused and left as they are; a
run that already did the steps asked for is left as it is (NothingToTrain). It removes the
temporary folders of saves that were killed.
"""

from __future__ import annotations

import difflib
import json
import os
import shlex
import shutil
from collections.abc import Sequence
from pathlib import Path

import yaml
from safetensors import SafetensorError, safe_open

from unmask.checkpoint import resolve_resume
from unmask.checkpoint.layout import (
    FINAL_DIR,
    START_OVER,
    checkpoint_folders,
    holds_model,
    list_checkpoints,
    newest_intact,
    read_trainer_state,
    remove_temporaries,
)
from unmask.config import RunConfig
from unmask.errors import InputError, NothingToTrain, RunStopped
from unmask.models.lora import LORA_SETTINGS
from unmask.parallel.mesh import launch_env, share_from_rank0
from unmask.runs.heartbeat import HEARTBEAT_FILE
from unmask.runs.report import EVAL_RESULTS, METRICS_FILE, find_runs, run_info

CONFIG_FILE = "config.yaml"
CONFIG_HISTORY = "config_history"  # earlier config.yaml files of a resumed run
RUN_ARTIFACTS = (CONFIG_FILE, CONFIG_HISTORY, METRICS_FILE, "tensorboard", "final",
                 "eval_results.json", HEARTBEAT_FILE)  # fmt: skip
# what a run killed before its first checkpoint can leave (besides hidden temporaries):
# its logs, trackers' folders and `unmask plot`'s pictures
_BEFORE_FIRST_SAVE = {CONFIG_FILE, CONFIG_HISTORY, METRICS_FILE, METRICS_FILE + ".tmp",
                      "tensorboard", "wandb", "plots", HEARTBEAT_FILE}  # fmt: skip
# keys that say how to start, not what the run is: never reported as changes
_START_KEYS = {"train.resume_from_checkpoint", "train.overwrite_output_dir"}


def prepare_output_dir(
    out: Path, cfg: RunConfig, total_steps: int
) -> tuple[Path | None, list[str]]:
    """Check output_dir before anything is written; returns the checkpoint to resume from
    (None: start fresh) and lines to print at start-up. total_steps: the optimizer steps
    this config plans (a finished run resumed without more is NothingToTrain)."""
    t = cfg.train
    if out.exists() and not out.is_dir():
        raise InputError(f"output_dir {str(out)!r} is a file; choose a folder path")
    check_writable(out)
    notices = []
    resume = resolve_resume(out, t.resume_from_checkpoint)
    if resume is not None:
        check_same_model(out, cfg)
        check_steps_left(out, resume, total_steps, cfg.eval.generate_accuracy)
    holds_run = out.is_dir() and any(out.iterdir())
    fresh_after_resume = resume is None and t.resume_from_checkpoint is True and holds_run
    if fresh_after_resume:
        check_fresh_start(out)
        notices.append(
            f"no intact checkpoint in {str(out)!r} yet: starting fresh (the logs of the "
            "run that stopped before its first checkpoint are replaced)"
        )
    elif resume is None and t.resume_from_checkpoint is True:
        notices.append(nothing_to_resume(out))
    elif resume is None and holds_run and not t.overwrite_output_dir:
        raise InputError(
            f"output_dir {str(out)!r} already holds a run; set "
            "train.resume_from_checkpoint=true to continue it, "
            "train.overwrite_output_dir=true to replace it, or choose another output_dir"
        )
    if resume is None and holds_run:
        # overwrite: the whole old run; a fresh start after resume: its logs only (there
        # is no checkpoint, see check_fresh_start)
        old = checkpoint_folders(out) if not fresh_after_resume else []
        for path in old + [out / name for name in RUN_ARTIFACTS]:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    removed = remove_temporaries(out)
    if removed:
        notices.append(f"removed {len(removed)} unfinished save(s) of a stopped run: {removed}")
    return resume, notices


#: model keys a resumed run may change: how it computes, not what it holds
RUNTIME_MODEL_KEYS = ("attn_implementation", "loss_implementation", "moe_implementation",
                      "pretrained")  # fmt: skip


def check_same_model(out: Path, cfg: RunConfig) -> None:
    """InputError naming every model key whose value differs between the config and the
    run being resumed (its config.yaml): its checkpoints hold another model. Keys of how
    the model computes (RUNTIME_MODEL_KEYS) may change; a run without config.yaml, or
    keys it does not hold, are not compared."""
    try:
        saved = yaml.safe_load((out / CONFIG_FILE).read_text()) or {}
    except (OSError, ValueError, yaml.YAMLError):
        return
    ran = saved.get("model") if isinstance(saved, dict) else None
    if not isinstance(ran, dict):
        return
    now = cfg.model.model_dump(mode="json")
    if bool(ran.get("lora")) != bool(now.get("lora")):
        return  # LoRA on one side only: the checkpoint loader names that
    # LoRA's own settings: the loader's check names them (models/lora.py)
    skip = {*RUNTIME_MODEL_KEYS, "lora", *LORA_SETTINGS}
    changed = [f"model.{key} {ran[key]!r} there, {now[key]!r} here" for key in now
               if key in ran and key not in skip and ran[key] != now[key]]  # fmt: skip
    if changed:
        raise InputError(
            f"{str(out)!r} holds a run of another model ({'; '.join(changed)}); resume it "
            "with the run's model, or train this one in another output_dir"
        )


def check_steps_left(out: Path, resume: Path, total_steps: int, heldout: bool) -> None:
    """NothingToTrain when output_dir holds a finished run (`run_ended`) and the checkpoint
    to resume from is at or past the steps this config plans: resuming would only write
    final/ and the logs again."""
    step = read_trainer_state(resume)["step"]
    if step < total_steps or not run_ended(out, heldout):
        return
    raise NothingToTrain(
        f"{str(out)!r} holds a finished run ({resume.name} and final/): this config plans "
        f"{total_steps} steps and the run has done {step}, so there is nothing to train and "
        f"nothing was changed; raise train.max_steps above {step} to train it further"
    )


def run_ended(out: Path, heldout: bool) -> bool:
    """True when what a run writes after its last checkpoint is all there: final/ with
    whole weights (each safetensors header covers its file, every shard of an index) and,
    when the run measures it (heldout), eval_results.json. A run killed among those
    writes is resumed to write them again."""
    final = Path(out) / FINAL_DIR
    if not holds_model(final) or (heldout and not (Path(out) / EVAL_RESULTS).is_file()):
        return False
    index = final / "model.safetensors.index.json"
    try:
        if index.is_file():  # sharded weights: the index is written after every shard
            shards = json.loads(index.read_text())["weight_map"].values()
            if any(not (final / name).is_file() for name in shards):
                return False
        weights = sorted(final.glob("*.safetensors"))
        for path in weights:
            with safe_open(str(path), "pt"):
                pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SafetensorError):
        return False
    return bool(weights)


def check_fresh_start(out: Path) -> None:
    """`resume_from_checkpoint: true` found no checkpoint in a folder that holds files: it
    starts fresh (replacing the logs) only when they are those of a run killed before its
    first checkpoint; a final/ or files no run writes are refused, changing nothing."""
    entries = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    if FINAL_DIR in entries:
        raise InputError(
            f"cannot resume {str(out)!r}: it holds a finished run's final/ but no checkpoint "
            f"to resume from, and nothing was changed; to train it again from the start, "
            f"set {START_OVER} (replaces final/), or choose another output_dir"
        )
    foreign = [name for name in entries if name not in _BEFORE_FIRST_SAVE]
    if foreign:
        shown = ", ".join(foreign[:3]) + (" ..." if len(foreign) > 3 else "")
        raise InputError(
            f"cannot resume {str(out)!r}: it holds no checkpoint, and files no unmask run "
            f"writes ({shown}); check train.output_dir ({runs_nearby(out)}), or choose "
            "an empty folder"
        )


def nothing_to_resume(out: Path) -> str:
    """The start-up line for `resume_from_checkpoint: true` on a folder that does not exist
    or is empty: a new run starts there (a first launch of a requeued job), but a mistyped
    output_dir would start one too, so it names the folder and the runs nearby."""
    state = "is empty" if out.is_dir() else "does not exist"
    return (
        f"warning: train.resume_from_checkpoint=true, but output_dir {str(out)!r} {state}: "
        f"starting a NEW run there. If you meant to continue a run, stop this one and fix "
        f"train.output_dir ({runs_nearby(out)})"
    )


def runs_nearby(out: Path, most: int = 5) -> str:
    """'runs with a checkpoint in 'runs': 'runs/a' (checkpoint-400, stopped at step 400),
    ...': run folders beside `out` that could be resumed (the names most like out's first),
    or a line saying there are none."""
    parent = Path(out).parent
    if not parent.is_dir():
        return f"{str(parent)!r} does not exist either"
    try:
        found = [p for p in find_runs(parent) if p != Path(out) and list_checkpoints(p)]
    except OSError:
        found = []
    if not found:
        return f"no run with a checkpoint in {str(parent)!r}"
    name = Path(out).name

    def likeness(path: Path) -> float:
        return difflib.SequenceMatcher(None, name, path.name).ratio()

    found.sort(key=likeness, reverse=True)
    shown = []
    for path in found[:most]:
        info = run_info(path)
        shown.append(f"{str(path)!r} ({info.checkpoint.name}, {info.status})")
    more = f" and {len(found) - most} more (unmask runs {shlex.quote(str(parent))})"
    return (f"runs with a checkpoint in {str(parent)!r}: {', '.join(shown)}"
            + (more if len(found) > most else ""))  # fmt: skip


def resume_command(output_dir: Path, config: str | None, overrides: Sequence[str] = ()) -> str:
    """The command that resumes the run in output_dir: the config file and overrides it was
    started with (config None: the built-in quickstart), less those that say how to start
    (an overwrite_output_dir=true would delete the run), plus train.output_dir (when not
    among them) and train.resume_from_checkpoint=true; quoted for a shell."""
    keys = [text.split("=", 1)[0].strip() for text in overrides]
    kept = [text for text, key in zip(overrides, keys) if key not in _START_KEYS]
    if "train.output_dir" not in keys:
        kept.append(f"train.output_dir={output_dir}")
    args = ["train", *([config] if config else []), *kept, "train.resume_from_checkpoint=true"]
    return shlex.join(["unmask", *args])


def resume_advice(command: str) -> str:
    """'resume with: COMMAND', or under a launcher (torchrun, srun: several processes) that
    every process must be launched again as before, with it."""
    if launch_env().world_size > 1:  # the launcher's own flags (rendezvous) are not known here
        return f"resume by launching every process as before, with: {command}"
    return f"resume with: {command}"


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
