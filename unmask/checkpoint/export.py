"""`unmask export CHECKPOINT --out DIR`: one self-contained Hugging Face folder from any
checkpoint (one-process or sharded), final/ or run output_dir.

The folder holds config.json (the family's layout; Qwen3/Qwen2/Llama load in transformers
as they are), model.safetensors, the tokenizer files and generation_config.json (special ids
+ every sampling option, the checkpoint's own included), so `unmask generate`, `unmask eval`
and the lm-eval adapter load it as it is.
"""

import shutil
from pathlib import Path
from typing import Any

import torch

from unmask.checkpoint.checkpointer import dcp_load
from unmask.checkpoint.layout import (
    DCP_DIR,
    is_distributed_checkpoint,
    resolve_model_folder,
)
from unmask.data.tokenizer import load_local_tokenizer
from unmask.errors import InputError
from unmask.models import DiffusionTransformer, build_empty, config_from_hf, from_pretrained
from unmask.models.hf import read_config
from unmask.sampling.config import GENERATION_FILE, generation_config_text, saved_sampling

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOKENIZER_FILES = ("tokenizer", "special_tokens", "vocab")


def export_model(
    checkpoint: str | Path,
    out: str | Path,
    *,
    dtype: str = "float32",
    overwrite: bool = False,
    sampling: dict[str, Any] | None = None,
) -> Path:
    """Write the HF folder for a checkpoint-N, final/ or run output_dir into `out`;
    `sampling` overrides the checkpoint's own sampling options."""
    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    source = Path(checkpoint)
    if not source.is_dir():
        raise InputError(f"checkpoint {str(source)!r} is not a folder; give a checkpoint-N folder")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {str(out)!r} is a file; give the path of a new folder")
    replace = out.exists() and any(out.iterdir())
    if replace and not overwrite:
        raise InputError(f"--out {str(out)!r} is not empty; pick a new folder or --overwrite")
    folder = source if is_distributed_checkpoint(source) else resolve_model_folder(source)
    read_config(folder)  # a broken config.json is named as such, before the tokenizer reads it
    fix = "checkpoints written by unmask train hold one; copy its tokenizer files there"
    tokenizer = load_local_tokenizer(str(folder), "checkpoint", fix)
    own = saved_sampling(folder)  # the checkpoint's own options (from training)
    text = generation_config_text(tokenizer, {**own, **(sampling or {})}, complete=True)
    if is_distributed_checkpoint(folder):
        model = gather_distributed_checkpoint(folder)
    else:
        model = from_pretrained(folder)
    model = model.to(DTYPES[dtype])
    if replace:  # only now: a source that cannot be read leaves --out as it was
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / GENERATION_FILE).write_text(text)
    return out


def gather_distributed_checkpoint(path: Path) -> DiffusionTransformer:
    """The full model of a sharded (DCP) checkpoint-N, in one process (no process group)."""
    path = Path(path)
    if not is_distributed_checkpoint(path):
        raise InputError(f"{str(path)!r} is not a sharded (DCP) unmask checkpoint")
    model = build_empty(config_from_hf(read_config(path)))
    state = {"model": model.state_dict()}
    dcp_load(state, path / DCP_DIR)
    model.load_state_dict(state["model"])
    return model


def export_distributed_checkpoint(path: Path, out: Path) -> Path:
    """Gather a DCP checkpoint-N into one HF folder (config.json, model.safetensors and the
    tokenizer files); one process, no process group needed."""
    path, out = Path(path), Path(out)
    gather_distributed_checkpoint(path).save_pretrained(str(out))
    for name in path.iterdir():
        if name.is_file() and name.name.startswith(_TOKENIZER_FILES):
            shutil.copy2(name, out / name.name)
    return out
