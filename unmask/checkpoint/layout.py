"""Checkpoint folders on disk: their names, how they are found again, how one is published
atomically, and how a damaged one is told apart.

A run directory holds `checkpoint-N/` folders (N = optimizer steps done). Every checkpoint
is written into a temporary `.tmp-checkpoint-N...` folder; its manifest.json (every file
with its size and CRC-32) is written last, the folder is fsynced and renamed into place, so
a crash mid-save never leaves a folder that looks like a checkpoint, and a checkpoint
damaged later (a truncated copy, a full disk on another machine) is found by `verify`.
Checkpoints written before manifests existed count when they hold trainer_state.json.
"""

import json
import os
import re
import shlex
import shutil
import zlib
from pathlib import Path

from unmask.errors import InputError

MANIFEST = "manifest.json"
STATE_FILE = "trainer_state.json"
DCP_DIR = "dcp"  # the sharded model + optimizer of a multi-process run
RANK_STATE_DIR = "rank_state"  # rank-R.pt: one rank's own state (grpo's cached rollouts)
CONFIG_FILE = "config.json"
ADAPTER_CONFIG = "adapter_config.json"  # a LoRA adapter folder (peft's format)
FINAL_DIR = "final"
START_OVER = "train.resume_from_checkpoint=false train.overwrite_output_dir=true"  # overrides
_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_folders(output_dir: Path) -> list[Path]:
    """Every checkpoint-N folder in output_dir, oldest first, complete or not. unmask only
    ever renames a complete folder to that name, so one that lacks its manifest and state
    file was damaged after it was published (a cut-short copy, files deleted)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for child in output_dir.iterdir():
        match = _NAME.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Checkpoint folders in output_dir that look complete (a manifest, or the state file of
    one written before manifests), oldest first; `verify` says whether one is intact."""
    return [
        path
        for path in checkpoint_folders(output_dir)
        if (path / MANIFEST).is_file() or (path / STATE_FILE).is_file()
    ]


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def write_manifest(folder: Path) -> None:
    """manifest.json: every other file of the folder with its size and CRC-32, written last."""
    files = {}
    for child in sorted(folder.rglob("*")):
        if child.is_file() and child.name != MANIFEST:
            name = child.relative_to(folder).as_posix()
            files[name] = {"size": child.stat().st_size, "crc32": _crc32(child)}
    (folder / MANIFEST).write_text(json.dumps({"format": 1, "files": files}, indent=1))


def verify(folder: Path, checksums: bool = True) -> str | None:
    """None when the checkpoint is intact, else what is wrong with it (a missing, shorter or
    changed file). A checkpoint without a manifest (written before them) is taken as is."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None if (Path(folder) / STATE_FILE).is_file() else f"no {MANIFEST} or {STATE_FILE}"
    try:
        files = json.loads(path.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return "manifest.json is not readable"
    for name, want in files.items():
        child = Path(folder) / name
        if not child.is_file():
            return f"{name} is missing"
        size = child.stat().st_size
        if size != want["size"]:
            return f"{name} holds {size} bytes, the manifest says {want['size']}"
        if checksums and _crc32(child) != want["crc32"]:
            return f"{name} does not match its checksum"
    return None


def newest_intact(output_dir: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and one line per newer checkpoint-N folder that
    did not (the temporary folders of saves that did not finish are not checkpoints)."""
    skipped = []
    for path in reversed(checkpoint_folders(output_dir)):
        problem = verify(path)
        if problem is None:
            return path, skipped
        skipped.append(f"{path.name} is damaged ({problem})")
    return None, skipped


def remove_temporaries(output_dir: Path) -> list[str]:
    """Delete the temporary folders of saves that did not finish (killed writers); returns
    their names. Call only when no other process writes to output_dir."""
    removed = []
    if Path(output_dir).is_dir():
        for child in Path(output_dir).iterdir():
            if child.is_dir() and child.name.startswith((".tmp-checkpoint-", ".stale-checkpoint-")):
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child.name)
    return sorted(removed)


def damaged(path: Path, problem: str) -> InputError:
    """The error for a checkpoint that cannot be resumed from, and what to do instead."""
    return InputError(f"checkpoint {str(path)!r} is damaged ({problem}); {older_one(path)}")


def older_one(path: Path) -> str:
    """'resume from an older one: ...' naming the newest intact checkpoint older than
    checkpoint `path` and the override that resumes from it, or saying there is none."""
    step = _NAME.match(Path(path).name)
    if step is None:  # a folder renamed by hand: its run's checkpoints are not known
        return "resume from an older one"
    older = None
    for candidate in reversed(checkpoint_folders(Path(path).parent)):
        if int(_NAME.match(candidate.name).group(1)) < int(step.group(1)):
            if verify(candidate) is None:
                older = candidate
                break
    if older is None:
        return (f"resume from an older one (none in {str(Path(path).parent)!r} is intact) or "
                f"start over ({START_OVER})")  # fmt: skip
    override = shlex.quote(f"train.resume_from_checkpoint={older}")
    return f"resume from an older one: {older.name} is intact ({override})"


def read_trainer_state(path: Path) -> dict:
    """checkpoint-N/trainer_state.json; a missing or unreadable one is an InputError."""
    try:
        state = json.loads((Path(path) / STATE_FILE).read_text())
    except FileNotFoundError:
        raise damaged(path, f"{STATE_FILE} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise damaged(path, f"{STATE_FILE} is not valid JSON: {err}") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise damaged(path, f"{STATE_FILE} holds no step count")
    return state


def is_distributed_checkpoint(path: Path) -> bool:
    """True for a checkpoint-N folder written by a multi-process run (DCP shards)."""
    return (Path(path) / DCP_DIR / ".metadata").is_file()


def damaged_run(output_dir: Path, newest: Path | None, skipped: list[str]) -> InputError:
    """The error for `resume_from_checkpoint: true` on a run whose newest checkpoint was
    published and then damaged: resuming from an older one (or from scratch) would replace
    it and the steps after, so the user picks one with an explicit override."""
    if newest is not None:
        resume = shlex.quote(f"train.resume_from_checkpoint={newest}")
        older = f"To resume from {newest.name}, the newest intact one, set {resume}; to"
    else:
        older = "No intact checkpoint is left: to"
    return InputError(
        f"cannot resume {str(output_dir)!r}: {'; '.join(skipped)}; nothing was changed. "
        f"{older} start over, set {START_OVER} (deletes its checkpoints and logs), or "
        "choose another output_dir"
    )


def resolve_resume(output_dir: Path, resume: bool | str | None) -> Path | None:
    """The checkpoint to resume from (train.resume_from_checkpoint), or None to start fresh:
    `true` = the newest checkpoint in output_dir, which must be intact (an InputError naming
    the damage and the newest intact one otherwise); a path = that one, which must be
    intact."""
    if resume in (None, False):
        return None
    if resume is True:
        newest, skipped = newest_intact(output_dir)
        if skipped:  # published, then damaged: the user decides what to resume from
            raise damaged_run(output_dir, newest, skipped)
        return newest
    path = Path(resume)
    if not path.is_dir():
        listing = missing_from_run(path, final=False)
        raise InputError(
            f"resume_from_checkpoint: {listing}" if listing else
            f"resume_from_checkpoint {str(path)!r} does not exist; "
            "give a checkpoint-N folder or true for the newest one in output_dir"
        )  # fmt: skip
    if not (path / STATE_FILE).is_file() and not (path / MANIFEST).is_file():
        raise InputError(
            f"{str(path)!r} is not a complete unmask checkpoint (no {STATE_FILE}); "
            "give a checkpoint-N folder written by unmask train"
        )
    problem = verify(path)
    if problem is not None:
        raise damaged(path, problem)
    return path


def holds_model(folder: Path) -> bool:
    """True for a folder a model loads from: config.json (an HF folder, a sharded
    checkpoint) or a LoRA adapter."""
    return (Path(folder) / CONFIG_FILE).is_file() or (Path(folder) / ADAPTER_CONFIG).is_file()


def run_contents(folder: Path, final: bool = True) -> list[str]:
    """What a run folder holds to load or resume: its checkpoint-N names, oldest first (a
    long list shortened in the middle), then `final` when final/ holds a model."""
    names = [path.name for path in list_checkpoints(folder)]
    if len(names) > 6:
        names = [*names[:2], f"... ({len(names)} checkpoints)", *names[-3:]]
    if final and holds_model(Path(folder) / FINAL_DIR):
        names.append(FINAL_DIR)
    return names


def missing_from_run(path: Path, final: bool = True) -> str | None:
    """For a path that does not exist inside a run folder: "no checkpoint-2000 in 'runs/x';
    it holds checkpoint-1500, checkpoint-3000, final" (what can be given instead); None
    when the parent holds no checkpoint (then it is no run folder)."""
    path = Path(path)
    held = run_contents(path.parent, final) if not path.exists() else []
    if not held:
        return None
    return f"no {path.name} in {str(path.parent)!r}; it holds {', '.join(held)}"


def resolve_model_folder(path: str | Path, flag: str = "--model") -> Path:
    """The model folder `path` names: a folder with config.json or a LoRA adapter, or a run's
    output_dir (its final/, else its newest intact checkpoint-N). `flag` names the argument
    in errors."""
    folder = Path(path)
    if not folder.is_dir():
        listing = missing_from_run(folder)
        raise InputError(
            listing
            or f"{flag} {str(path)!r} is not a folder; give a checkpoint-N, final/ or "
            "exported model folder, or a run output_dir"
        )
    if holds_model(folder):
        return folder
    if holds_model(folder / FINAL_DIR):
        return folder / FINAL_DIR
    newest, skipped = newest_intact(folder)
    if newest is not None:
        return newest
    if skipped:
        raise InputError(
            f"no intact checkpoint in {str(folder)!r}: {'; '.join(skipped[:2])}; give another "
            "checkpoint-N or exported folder"
        )
    raise InputError(
        f"no config.json in {str(folder)!r}; give a checkpoint-N, final/ or exported folder, "
        "or a run output_dir holding one"
    )


def temporary_folder(output_dir: Path, step: int, suffix: str = "") -> Path:
    """An empty `.tmp-checkpoint-N` folder to write checkpoint N into (a leftover one of a
    crashed save is removed first)."""
    tmp = Path(output_dir) / f".tmp-checkpoint-{step}{suffix}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path, step: int, save_total_limit: int | None, keep: Path | None = None) -> Path:
    """fsync tmp, rename it to checkpoint-N (replacing an older folder of that step, as a
    resumed run passing a step it had saved before does) and keep the newest
    save_total_limit checkpoints. Returns the checkpoint folder."""
    final = tmp.parent / f"checkpoint-{step}"
    write_manifest(tmp)
    for child in tmp.rglob("*"):
        if child.is_file():
            with open(child, "rb") as handle:
                os.fsync(handle.fileno())
    if final.exists():
        stale = final.with_name(f".stale-{final.name}-{os.getpid()}")
        os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale)
    else:
        os.replace(tmp, final)
    prune(final.parent, save_total_limit, keep)
    return final


def prune(output_dir: Path, save_total_limit: int | None, keep: Path | None = None) -> None:
    """Delete all but the newest save_total_limit checkpoints; never the newest one, nor
    `keep` (the best eval-loss checkpoint with train.keep_best)."""
    if save_total_limit is None or save_total_limit <= 0:
        return
    for old in list_checkpoints(output_dir)[:-save_total_limit]:
        if keep is None or old.name != Path(keep).name:
            shutil.rmtree(old)
