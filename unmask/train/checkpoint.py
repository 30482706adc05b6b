"""Checkpoints: checkpoint-N/ folders written atomically, found again, and pruned.

A checkpoint holds the model in HF format (config.json + model.safetensors, so
`unmask generate --model checkpoint-N` works), the tokenizer, the optimizer and
scheduler states, the data-loader position and the RNG states. It is written into a
temporary folder and renamed into place only when complete, so a crash mid-save never
leaves a folder that looks like a checkpoint.
"""

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from unmask.errors import InputError

STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints in output_dir, oldest first."""
    if not output_dir.is_dir():
        return []
    found = []
    for child in output_dir.iterdir():
        match = _NAME.match(child.name)
        if match and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def save_checkpoint(
    output_dir: Path,
    step: int,
    model,
    tokenizer,
    optimizer: torch.optim.Optimizer,
    scheduler,
    trainer_state: dict,
    rng_state: dict,
    save_total_limit: int | None = None,
) -> Path:
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".tmp-checkpoint-{step}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_state, tmp / "rng_state.pt")
    (tmp / STATE_FILE).write_text(json.dumps({**trainer_state, "step": step}, indent=2))
    _fsync_dir(tmp)
    if final.exists():  # a resumed run passing a step it had saved before: replace it
        stale = output_dir / f".stale-checkpoint-{step}-{os.getpid()}"
        os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale)
    else:
        os.replace(tmp, final)
    if save_total_limit is not None and save_total_limit > 0:
        for old in list_checkpoints(output_dir)[:-save_total_limit]:
            shutil.rmtree(old)
    return final


def _fsync_dir(path: Path) -> None:
    for child in path.iterdir():
        with open(child, "rb") as handle:
            os.fsync(handle.fileno())


def resolve_resume(output_dir: Path, resume: bool | str | None) -> Path | None:
    """The checkpoint to resume from, or None to start fresh."""
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


def load_checkpoint(path: Path, model, optimizer, scheduler) -> tuple[dict, dict]:
    """Restore model, optimizer and scheduler in place; returns (trainer_state, rng_state)."""
    weights = load_file(str(path / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    allowed_missing = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise InputError(
            f"checkpoint {str(path)!r} does not match the model in the config "
            f"(missing {sorted(set(missing) - allowed_missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}); resume with the config it was written with"
        )
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng_state = torch.load(path / "rng_state.pt", weights_only=True)
    trainer_state = json.loads((path / STATE_FILE).read_text())
    return trainer_state, rng_state
