"""A model folder's generation files: generation_config.json, and unmask's own where
transformers' generation config class takes no keys but its own.

unmask's sampling options travel in generation_config.json's "unmask" entry (with the
special ids and `mask_token_id`; unmask/sampling/generation_file.py writes and reads that
text). Most of transformers' generation config classes keep unknown keys as attributes, so
the folder loads there as it is. DiffusionGemma's (`DiffusionGemmaGenerationConfig`) raises
`ValueError: Unexpected kwargs` for any key it does not know, which made every folder unmask
wrote for that family unloadable in transformers. For such a folder generation_config.json
holds only that class's keys (the special ids, and unmask's options that it has a key for:
max_new_tokens, max_denoising_steps, t_max / t_min, stability_threshold,
confidence_threshold, sampler_config.entropy_bound), and `UNMASK_GENERATION_FILE` holds what
generation_config.json held before (the special ids, `mask_token_id`, the "unmask" entry),
whose "unmask" entry is read in place of generation_config.json's.
Folders written before keep everything in generation_config.json and are read as they are.
"""

import json
from pathlib import Path
from typing import Any

from unmask.sampling.generation_file import GENERATION_FILE, TRANSFORMERS_GENERATION_KEYS

UNMASK_GENERATION_FILE = "unmask_generation.json"
"""unmask's own generation settings where generation_config.json cannot hold them
(`STRICT_GENERATION_TYPES`); sampling/generation_file.py `saved_sampling` reads it by this
name."""

STRICT_GENERATION_TYPES = ("diffusion_gemma",)
"""config.json model_types whose transformers generation config refuses unknown keys
(transformers 5.24, models/diffusion_gemma/generation_diffusion_gemma.py)."""
_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_FLOAT_KEYS = ("t_max", "t_min", "confidence_threshold")  # the class checks isinstance float


def generation_files(text: str, config: dict[str, Any] | None) -> dict[str, str]:
    """File name -> text for a folder whose config.json is `config` (None: unknown, e.g. a
    LoRA adapter's folder), from generation_config.json's `text` as unmask writes it: that
    text alone, or for a strict model_type the transformers part and unmask's own file."""
    if (config or {}).get("model_type") not in STRICT_GENERATION_TYPES:
        return {GENERATION_FILE: text}
    data = json.loads(text)
    entry = data.get("unmask") or {}
    theirs: dict[str, Any] = {k: data[k] for k in _SPECIAL_IDS if data.get(k) is not None}
    for key, ours in TRANSFORMERS_GENERATION_KEYS.items():
        value = entry.get(ours)
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # not "auto"
            theirs[key] = float(value) if key in _FLOAT_KEYS else value
    if entry.get("entropy_bound") is not None:
        theirs["sampler_config"] = {
            "entropy_bound": float(entry["entropy_bound"]),
            "_cls_name": "EntropyBoundSamplerConfig",
        }  # as it saves it
    return {GENERATION_FILE: json.dumps(theirs, indent=2), UNMASK_GENERATION_FILE: text}


def write_generation_files(folder: Path, text: str) -> None:
    """Write `generation_files` into folder, reading the folder's config.json (written
    first) for its model_type."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        config = None
    for name, content in generation_files(text, config).items():
        (folder / name).write_text(content)
