"""`unmask export CHECKPOINT --out DIR`: one self-contained Hugging Face folder.

The folder holds config.json (Qwen3 layout, loadable by transformers), model.safetensors,
the tokenizer files and generation_config.json (special ids + unmask's sampling defaults),
so `unmask generate`, `unmask eval` and the lm-eval adapter load it as it is.
"""

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from unmask.errors import InputError
from unmask.sampling.loading import (
    GENERATION_FILE,
    SAMPLING_DEFAULTS,
    read_generation_defaults,
    resolve_model_folder,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def generation_config(tokenizer, sampling: dict[str, Any], complete: bool = True) -> dict[str, Any]:
    """generation_config.json: HF special-token keys plus an "unmask" sampling entry
    (every default when complete, else only the given keys)."""
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "mask_token_id": tokenizer.mask_token_id,
        "unmask": {**SAMPLING_DEFAULTS, **sampling} if complete else dict(sampling),
    }


def export_model(
    checkpoint: str | Path,
    out: str | Path,
    *,
    dtype: str = "float32",
    overwrite: bool = False,
    sampling: dict[str, Any] | None = None,
) -> Path:
    """Write the HF folder for a checkpoint-N, final/ or run output_dir into `out`."""
    from unmask.models import from_pretrained
    from unmask.sampling.loading import load_tokenizer
    from unmask.train.checkpoint import export_distributed_checkpoint, is_distributed_checkpoint

    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    source = Path(checkpoint)
    if not source.is_dir():
        raise InputError(f"checkpoint {str(source)!r} is not a folder; give a checkpoint-N folder")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise InputError(f"--out {str(out)!r} is not empty; pick a new folder or --overwrite")
        shutil.rmtree(out)
    unknown = set(sampling or {}) - set(SAMPLING_DEFAULTS)
    if unknown:
        raise InputError(f"unknown sampling defaults {sorted(unknown)}")
    if is_distributed_checkpoint(source):
        folder = source
        tokenizer = load_tokenizer(source)
        tmp = out.with_name(out.name + ".tmp-export")
        export_distributed_checkpoint(source, tmp)
        model = from_pretrained(tmp)
        shutil.rmtree(tmp)
    else:
        folder = resolve_model_folder(source)
        tokenizer = load_tokenizer(folder)
        model = from_pretrained(folder)
    model = model.to(DTYPES[dtype])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    saved = read_generation_defaults(folder)  # the checkpoint's own (from training)
    changed = {k: v for k, v in saved.items() if SAMPLING_DEFAULTS[k] != v}
    config = generation_config(tokenizer, {**changed, **(sampling or {})})
    (out / GENERATION_FILE).write_text(json.dumps(config, indent=2))
    return out
