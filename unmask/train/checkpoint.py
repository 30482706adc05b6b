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
ADAPTER_FILE = "adapter_model.safetensors"  # peft's file name: what a LoRA run saves
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
    extra_files: dict[str, str] | None = None,
) -> Path:
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".tmp-checkpoint-{step}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    state = {**trainer_state, "step": step}
    _publish(tmp, final, tokenizer, scheduler, rng_state, state, extra_files, save_total_limit)
    return final


def _publish(
    tmp: Path, final: Path, tokenizer, scheduler, rng_state: dict, state: dict,
    extra_files: dict[str, str] | None, save_total_limit: int | None,
) -> None:  # fmt: skip
    """Write what both checkpoint kinds share into tmp, fsync it, rename it to final
    (replacing an older folder of that step) and prune to save_total_limit."""
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_state, tmp / "rng_state.pt")
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    _fsync_tree(tmp)
    if final.exists():  # a resumed run passing a step it had saved before: replace it
        stale = final.with_name(f".stale-{final.name}-{os.getpid()}")
        os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale)
    else:
        os.replace(tmp, final)
    if save_total_limit is not None and save_total_limit > 0:
        for old in list_checkpoints(final.parent)[:-save_total_limit]:
            shutil.rmtree(old)


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
    if hasattr(model, "peft_config"):
        _load_adapter(path, model)
    else:
        if not (path / "model.safetensors").is_file():
            lora = (path / ADAPTER_FILE).is_file()
            raise InputError(
                f"checkpoint {str(path)!r} holds no model.safetensors"
                + ("; it was written by a LoRA run: set model.lora: true" if lora else "")
                + "; resume with the config it was written with"
            )
        weights = load_file(str(path / "model.safetensors"))
        missing, unexpected = model.load_state_dict(weights, strict=False)
        allowed_missing = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        if set(missing) - allowed_missing or unexpected:
            raise InputError(
                f"checkpoint {str(path)!r} does not match the model in the config "
                f"(missing {sorted(set(missing) - allowed_missing)[:3]}, unexpected "
                f"{sorted(unexpected)[:3]}); resume with the config it was written with"
            )
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng_state = torch.load(path / "rng_state.pt", weights_only=True)
    trainer_state = json.loads((path / STATE_FILE).read_text())
    return trainer_state, rng_state


def _load_adapter(path: Path, model) -> None:
    """A LoRA run's checkpoint holds the adapter in peft's format (the base weights are
    frozen and come from model.pretrained / the seed): load it into the PeftModel."""
    from peft import set_peft_model_state_dict

    file = path / ADAPTER_FILE
    if not file.is_file():
        raise InputError(
            f"checkpoint {str(path)!r} holds no LoRA adapter ({ADAPTER_FILE}); it was written "
            "by a run without model.lora: true, so resume it with that run's config"
        )
    try:
        result = set_peft_model_state_dict(model, load_file(str(file)))
    except RuntimeError as err:  # shapes differ: another lora_r or target modules
        first = str(err).strip().splitlines()[-1].strip()
        raise InputError(
            f"LoRA checkpoint {str(path)!r} does not match model.lora_* in the config "
            f"({first[:160]}); resume with the config it was written with"
        ) from None
    expected = {name for name, p in model.named_parameters() if p.requires_grad}
    missing = sorted(name for name in result.missing_keys if name in expected)
    if missing or result.unexpected_keys:
        raise InputError(
            f"LoRA checkpoint {str(path)!r} does not match model.lora_* in the config (missing "
            f"{missing[:3]}, unexpected {sorted(result.unexpected_keys)[:3]}); resume with the "
            "config it was written with"
        )


def base_fingerprint(model) -> list[float]:
    """[sum, sum of squares] of the frozen (base) weights in float64: a LoRA checkpoint
    stores it, so resuming on a different base model fails instead of training on."""
    total, squares = 0.0, 0.0
    for param in model.parameters():
        if param.requires_grad:
            continue
        value = param.detach()
        if not value.is_floating_point():  # packed 4-bit weights (uint8)
            value = value.to(torch.float32)
        total += float(value.sum(dtype=torch.float64))
        squares += float(torch.linalg.vector_norm(value, dtype=torch.float64) ** 2)
    return [total, squares]


def check_base_fingerprint(saved: list[float] | None, model, path: Path) -> None:
    if saved is None:
        return
    now = base_fingerprint(model)
    if any(abs(a - b) > 1e-6 * max(1.0, abs(a)) for a, b in zip(saved, now)):
        raise InputError(
            f"LoRA checkpoint {str(path)!r} was trained on other base weights than this "
            "config's model; resume with the model.pretrained (and seed) it was written with"
        )


# ------------------------------------------------------------ sharded (DCP) checkpoints

DCP_DIR = "dcp"


def is_distributed_checkpoint(path: Path) -> bool:
    """True for a checkpoint-N folder written by a multi-process run (DCP shards)."""
    return (Path(path) / DCP_DIR / ".metadata").is_file()


def _fsync_tree(path: Path) -> None:
    for child in path.rglob("*"):
        if child.is_file():
            with open(child, "rb") as handle:
                os.fsync(handle.fileno())


def save_distributed_checkpoint(
    output_dir: Path,
    step: int,
    model,
    tokenizer,
    optimizer: torch.optim.Optimizer,
    scheduler,
    trainer_state: dict,
    rng_state: dict,
    save_total_limit: int | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Every rank writes its shards of model + optimizer with torch.distributed.checkpoint.

    Layout: checkpoint-N/dcp/ (sharded, loadable at any world size), config.json (HF model
    config, for export), tokenizer files, scheduler.pt, rng_state.pt, trainer_state.json.
    Written under .tmp-checkpoint-N and renamed by rank 0 after every rank finished, so a
    rank dying mid-save leaves the previous checkpoint as the newest complete one.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from unmask.models.hf import hf_config_dict

    rank = dist.get_rank()
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".tmp-checkpoint-{step}"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp / DCP_DIR))
    if rank == 0:
        (tmp / "config.json").write_text(json.dumps(hf_config_dict(model.config), indent=2))
        state = {**trainer_state, "step": step, "world_size": dist.get_world_size()}
        _publish(tmp, final, tokenizer, scheduler, rng_state, state, extra_files, save_total_limit)
    dist.barrier()
    return final


def load_distributed_checkpoint(path: Path, model, optimizer, scheduler) -> tuple[dict, dict]:
    """Restore a DCP checkpoint into a model at any world size (FSDP2-sharded or plain).

    Every rank calls it; returns (trainer_state, rng_state) like :func:`load_checkpoint`.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    try:
        _dcp_load(state, Path(path) / DCP_DIR)
    except Exception as err:  # DCP raises CheckpointException with every rank's traceback
        raise InputError(
            f"checkpoint {str(path)!r} does not match the model and optimizer in the config "
            f"({type(err).__name__}); resume with the config it was written with"
        ) from None
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng_state = torch.load(path / "rng_state.pt", weights_only=True)
    trainer_state = json.loads((path / STATE_FILE).read_text())
    return trainer_state, rng_state


def _dcp_load(state: dict, folder: Path) -> None:
    """dcp.load; in one process (no process group) that is the intent, so no warning."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(folder))


def export_distributed_checkpoint(path: Path, out: Path) -> Path:
    """Gather a DCP checkpoint-N into one HF folder (config.json, model.safetensors,
    tokenizer); runs in one process, no process group needed."""
    from unmask.models.hf import config_from_hf
    from unmask.models.transformer import DiffusionTransformer

    path, out = Path(path), Path(out)
    if not is_distributed_checkpoint(path):
        raise InputError(f"{str(path)!r} is not a sharded (DCP) unmask checkpoint")
    cfg = config_from_hf(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        model = DiffusionTransformer(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    state = {"model": model.state_dict()}
    _dcp_load(state, path / DCP_DIR)
    model.load_state_dict(state["model"])
    model.save_pretrained(str(out))
    for name in path.iterdir():
        if name.is_file() and name.name.startswith(("tokenizer", "special_tokens", "vocab")):
            shutil.copy2(name, out / name.name)
    return out
