"""Loading a model folder for sampling: weights, tokenizer, special ids and generation
defaults (`generation_config.json`, written by `unmask export`), plus batched text
generation used by `unmask generate` and the lm-eval adapter."""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from unmask.errors import InputError

GENERATION_FILE = "generation_config.json"
# Defaults for `sample` keywords, overridden by the folder's generation_config.json
# ("unmask" entry) and then by explicit arguments.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "gen_length": 32,
    "steps": None,  # None = gen_length (one token per step)
    "block_length": None,  # None = gen_length
    "temperature": 0.0,
    "remasking": "low_confidence",
    "cfg_scale": 0.0,
    "threshold": None,
    "factor": None,
    "cache": "none",
    "schedule": "llada",
    "top_p": None,
    "top_k": None,
    "shift_logits": False,  # Dream: position i is predicted from hidden state i - 1
    "block_causal": False,  # block diffusion (bd3lm): block-causal attention
}


def training_sampling_defaults(diffusion) -> dict[str, Any]:
    """What sampling must match of how a model was trained (a DiffusionConfig): Dream's
    logit shift, BD3LM's block-causal attention and block size. The trainer writes these
    into every checkpoint's generation_config.json."""
    shift = diffusion.logit_shift
    if shift if shift is not None else diffusion.objective == "dream":
        return {"shift_logits": True}
    if diffusion.objective == "bd3lm":
        return {"block_causal": True, "block_length": diffusion.block_size}
    return {}


@dataclass
class SamplingModel:
    """A model ready to sample: eval mode on `device`, its tokenizer and special ids."""

    model: Any
    tokenizer: Any
    mask_id: int
    eos_id: int | None
    pad_id: int
    device: torch.device
    defaults: dict[str, Any] = field(default_factory=dict)


def load_tokenizer(folder: Path):
    """A transformers tokenizer from a local folder (no hub)."""
    from transformers import AutoTokenizer

    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise InputError(f"no tokenizer files in {str(folder)!r}; pass --tokenizer FOLDER")
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def resolve_model_folder(path: str | Path) -> Path:
    """A model folder, or a run's output_dir (its final/ or newest checkpoint-N)."""
    folder = Path(path)
    if not folder.is_dir():
        raise InputError(
            f"--model {str(path)!r} is not a folder; give a checkpoint-N or exported model folder"
        )
    if (folder / "config.json").is_file():
        return folder
    if (folder / "final" / "config.json").is_file():
        return folder / "final"
    checkpoints = sorted(
        (p for p in folder.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
        key=lambda p: int(p.name.split("-")[-1]),
    )
    if checkpoints:
        return checkpoints[-1]
    raise InputError(f"no config.json in {str(folder)!r}; give a checkpoint-N or exported folder")


def read_generation_defaults(folder: Path) -> dict[str, Any]:
    """SAMPLING_DEFAULTS updated with the folder's generation_config.json "unmask" entry."""
    defaults = dict(SAMPLING_DEFAULTS)
    path = folder / GENERATION_FILE
    saved = json.loads(path.read_text()).get("unmask", {}) if path.is_file() else {}
    if "shift_logits" not in saved and (folder / "config.json").is_file():  # Dream folders
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        defaults["shift_logits"] = model_type in ("Dream", "dream")
    defaults.update({k: v for k, v in saved.items() if k in SAMPLING_DEFAULTS})
    return defaults


def load_for_sampling(
    model_path: str | Path,
    tokenizer_path: str | Path | None = None,
    device: str = "cpu",
    mask_id: int | None = None,
    dtype: torch.dtype | None = None,
) -> SamplingModel:
    """Load weights + tokenizer of a checkpoint or exported folder for generation."""
    from unmask.models import from_pretrained
    from unmask.models.hf import folder_mask_token_id

    folder = resolve_model_folder(model_path)
    tokenizer = load_tokenizer(Path(tokenizer_path) if tokenizer_path else folder)
    if mask_id is None:  # --mask-id, else config.json's mask_token_id, else the tokenizer's
        mask_id = folder_mask_token_id(folder)
    if mask_id is None:
        mask_id = tokenizer.mask_token_id
    if mask_id is None:
        raise InputError("the tokenizer has no mask token; pass --mask-id")
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_id or 0)
    model = from_pretrained(folder, dtype=dtype).to(device).eval()
    return SamplingModel(
        model, tokenizer, mask_id, eos_id, pad_id, torch.device(device),
        read_generation_defaults(folder),
    )  # fmt: skip


def sampling_kwargs(defaults: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """Keywords for `sample`: defaults, then every override that is not None."""
    options = dict(defaults)
    options.update({k: v for k, v in overrides.items() if v is not None})
    gen_length = options["gen_length"]
    options["steps"] = options["steps"] or gen_length
    options["block_length"] = options["block_length"] or gen_length
    return options


def generate_texts(
    sm: SamplingModel,
    prompts: list[str],
    options: dict[str, Any],
    batch_size: int = 16,
    generator: torch.Generator | None = None,
    on_step=None,
) -> list[dict[str, Any]]:
    """Generate for each prompt (batched, left-padded); returns one record per prompt:
    prompt, completion (text before the first EOS), tokens, nfe, seconds of its batch."""
    from unmask.sampling.generate import left_pad, sample

    encoded = [sm.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    for text, ids in zip(prompts, encoded):
        if not ids:
            raise InputError(f"prompt {text!r} is empty after tokenization; give some text")
    records: list[dict[str, Any]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = encoded[start : start + batch_size]
        ids, attention_mask = left_pad(chunk, sm.pad_id)
        ids, attention_mask = ids.to(sm.device), attention_mask.to(sm.device)
        if bool(attention_mask.all()):
            attention_mask = None
        try:
            out = sample(sm.model, ids, mask_id=sm.mask_id, eos_id=sm.eos_id,
                         attention_mask=attention_mask, generator=generator, on_step=on_step,
                         **options)  # fmt: skip
        except ValueError as err:
            raise InputError(str(err)) from None
        for row, answer in enumerate(out.answers.tolist()):
            if sm.eos_id is not None and sm.eos_id in answer:
                answer = answer[: answer.index(sm.eos_id)]
            records.append(
                {
                    "prompt": prompts[start + row],
                    "completion": sm.tokenizer.decode(answer, skip_special_tokens=True),
                    "tokens": len(answer),
                    "nfe": out.nfe,
                    "seconds": round(out.seconds, 4),
                }
            )
    return records
