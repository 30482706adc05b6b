"""Checkpoint folders on disk: their names, how they are found again, and how one is
published atomically.

A run directory holds `checkpoint-N/` folders (N = optimizer steps done). A folder counts
only once it holds trainer_state.json: every checkpoint is written into a temporary
`.tmp-checkpoint-N` folder, fsynced and renamed into place when complete, so a crash
mid-save never leaves a folder that looks like a checkpoint.
"""

import os
import re
import shutil
from pathlib import Path

from unmask.errors import InputError

STATE_FILE = "trainer_state.json"
DCP_DIR = "dcp"  # the sharded model + optimizer of a multi-process run
CONFIG_FILE = "config.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints in output_dir, oldest first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for child in output_dir.iterdir():
        match = _NAME.match(child.name)
        if match and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def is_distributed_checkpoint(path: Path) -> bool:
    """True for a checkpoint-N folder written by a multi-process run (DCP shards)."""
    return (Path(path) / DCP_DIR / ".metadata").is_file()


def resolve_resume(output_dir: Path, resume: bool | str | None) -> Path | None:
    """The checkpoint to resume from (train.resume_from_checkpoint), or None to start fresh."""
    if resume in (None, False):
        return None
    if resume is True:
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise InputError(
            f"resume_from_checkpoint {str(path)!r} does not exist; "
            "give a checkpoint-N folder or true for the newest one in output_dir"
        )
    if not (path / STATE_FILE).is_file():
        raise InputError(
            f"{str(path)!r} is not a complete unmask checkpoint (no {STATE_FILE}); "
            "give a checkpoint-N folder written by unmask train"
        )
    return path


def resolve_model_folder(path: str | Path) -> Path:
    """The model folder `path` names: a folder with config.json, or a run's output_dir
    (its final/, else its newest complete checkpoint-N)."""
    folder = Path(path)
    if not folder.is_dir():
        raise InputError(
            f"--model {str(path)!r} is not a folder; give a checkpoint-N or exported model folder"
        )
    if (folder / CONFIG_FILE).is_file():
        return folder
    if (folder / "final" / CONFIG_FILE).is_file():
        return folder / "final"
    checkpoints = list_checkpoints(folder)
    if checkpoints:
        return checkpoints[-1]
    raise InputError(f"no config.json in {str(folder)!r}; give a checkpoint-N or exported folder")


def temporary_folder(output_dir: Path, step: int, suffix: str = "") -> Path:
    """An empty `.tmp-checkpoint-N` folder to write checkpoint N into (a leftover one of a
    crashed save is removed first)."""
    tmp = Path(output_dir) / f".tmp-checkpoint-{step}{suffix}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path, step: int, save_total_limit: int | None) -> Path:
    """fsync tmp, rename it to checkpoint-N (replacing an older folder of that step, as a
    resumed run passing a step it had saved before does) and keep the newest
    save_total_limit checkpoints. Returns the checkpoint folder."""
    final = tmp.parent / f"checkpoint-{step}"
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
    if save_total_limit is not None and save_total_limit > 0:
        for old in list_checkpoints(final.parent)[:-save_total_limit]:
            shutil.rmtree(old)
    return final
