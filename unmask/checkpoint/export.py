"""`unmask export CHECKPOINT --out DIR`: one self-contained Hugging Face folder from any
folder unmask writes (see saved.py: a checkpoint-N of one process or many, a LoRA adapter,
merged with its base, final/, a run output_dir).

The folder holds config.json (the family's layout; Qwen3/Qwen2/Llama load in transformers
as they are), model.safetensors, the tokenizer files, the image processor's
(preprocessor_config.json, when the source has one) and generation_config.json (special ids
+ every sampling option, the checkpoint's own included; for DiffusionGemma the options
transformers' generation config takes, the rest in unmask's own file: generation.py), so
`unmask generate`, `unmask eval` and the lm-eval adapter load it as it is.
"""

import shutil
from pathlib import Path
from typing import Any

import torch

from unmask.checkpoint.generation import write_generation_files
from unmask.checkpoint.layout import resolve_model_folder
from unmask.checkpoint.saved import gather_distributed_checkpoint, inspect_saved, load_saved_model
from unmask.data.images import PROCESSOR_FILE, processor_files
from unmask.data.tokenizer import load_local_tokenizer
from unmask.errors import InputError
from unmask.sampling.config import FolderSampling
from unmask.sampling.generation_file import generation_config_text, saved_sampling

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOKENIZER_FILES = ("tokenizer", "special_tokens", "vocab")


def export_model(
    checkpoint: str | Path,
    out: str | Path,
    *,
    dtype: str = "float32",
    overwrite: bool = False,
    sampling: dict[str, Any] | None = None,
    base: str | Path | None = None,
) -> Path:
    """Write the HF folder for any saved model folder (`resolve_model_folder`) into `out`;
    `sampling` overrides the checkpoint's own sampling options; `base` is the base model
    folder of an unmerged LoRA adapter, in place of the one it records."""
    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {str(out)!r} is a file; give the path of a new folder")
    replace = out.exists() and any(out.iterdir())
    if replace and not overwrite:
        raise InputError(f"--out {str(out)!r} is not empty; pick a new folder or --overwrite")
    folder = resolve_model_folder(checkpoint, "checkpoint")
    saved = inspect_saved(folder, base)  # a broken config.json or a missing base, named first
    fix = "checkpoints written by unmask train hold one; copy its tokenizer files there"
    tokenizer = load_local_tokenizer(str(folder), "checkpoint", fix)
    own = saved_sampling(folder)  # the checkpoint's own options (from training)
    if isinstance(own, FolderSampling):  # a released folder: its family's decoding stays
        merged = FolderSampling({**own.own, **(sampling or {})}, own.defaults)  # defaults
    else:
        merged = {**own, **(sampling or {})}
    text = generation_config_text(tokenizer, merged, complete=True)
    model = load_saved_model(saved).to(DTYPES[dtype])
    processor = processor_files(folder)  # the image processor: pictures in, as in the source
    if replace:  # only now: a source that cannot be read leaves --out as it was
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    write_generation_files(out, text)  # after config.json: it names the model_type
    for name, content in processor.items():
        (out / name).write_text(content)
    return out


def export_distributed_checkpoint(path: Path, out: Path) -> Path:
    """Gather a DCP checkpoint-N into one HF folder (config.json, model.safetensors and the
    tokenizer files, the image processor's when it has one); one process, no process group
    needed."""
    path, out = Path(path), Path(out)
    gather_distributed_checkpoint(path).save_pretrained(str(out))
    for name in path.iterdir():
        if name.is_file() and (name.name.startswith(_TOKENIZER_FILES)
                               or name.name == PROCESSOR_FILE):  # fmt: skip
            shutil.copy2(name, out / name.name)
    return out
