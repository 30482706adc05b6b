"""A model folder's sampling file: generation_config.json's "unmask" entry, written by the
trainer and by `unmask export` (`generation_config_text`) and read by every sampler
(`saved_sampling`), and what a run's training fixes in it (`fixed_by_training`,
`fitted_to_rows`). The options themselves are `SamplingConfig`'s (sampling/config.py).
"""

import json
from pathlib import Path
from typing import Any

from unmask.diffusion.config import DiffusionConfig
from unmask.diffusion.registry import objective_spec
from unmask.errors import InputError, did_you_mean
from unmask.models.families import family_of_config, samples_with_logit_shift
from unmask.sampling.config import (
    RUNTIME_OPTIONS,
    FolderSampling,
    SamplingConfig,
    resolve_sampling,
    without_none,
)

GENERATION_FILE = "generation_config.json"
# the "unmask" entry of a folder whose generation_config.json cannot hold it (DiffusionGemma:
# transformers' class refuses unknown keys), read in its place; checkpoint/generation.py
# writes it under the same name (a layer above: it cannot be imported from there)
UNMASK_GENERATION_FILE = "unmask_generation.json"
# a transformers diffusion_gemma folder's generation_config.json keys -> unmask's options
# (its `sampler_config` holds entropy_bound)
TRANSFORMERS_GENERATION_KEYS = {"max_new_tokens": "gen_length",
                                "max_denoising_steps": "max_denoising_steps",
                                "t_max": "temperature_start", "t_min": "temperature_end",
                                "stability_threshold": "stability_threshold",
                                "confidence_threshold": "confidence_threshold"}  # fmt: skip


def fixed_by_training(diffusion: DiffusionConfig) -> dict[str, Any]:
    """What sampling must match of how a model was trained: Dream's logit shift, or what
    the objective's registry entry fixes (BD3LM's block-causal attention and block size).
    Every checkpoint's generation_config.json carries these, so generate, export and
    lm-eval need no flags."""
    fixed = objective_spec(diffusion.objective).fixed_sampling(diffusion)
    if diffusion.shifts_logits:
        return {**fixed, "shift_logits": True}
    return fixed


def fitted_to_rows(data) -> dict[str, Any]:
    """The canvas a model trained on `data` (a DataConfig) answers in: one example per row,
    padded with supervised EOS to packing_length, teaches it to fill exactly that row, so
    its checkpoints sample with row_length = packing_length. Packed text sets nothing."""
    if not data.packing and data.supervise_padding:
        return {"row_length": data.packing_length}
    return {}


# ------------------------------------------------------------ generation_config.json


def generation_config_text(tokenizer, sampling: dict[str, Any], complete: bool) -> str:
    """generation_config.json: the HF special-token keys plus an "unmask" entry holding the
    sampling options (every option when `complete`, else only those given; either way
    checked against SamplingConfig first). A `FolderSampling` (a released folder's family
    default decoding under its own options) keeps the two apart: the defaults go under
    "unmask_defaults" and stay defaults when the folder is read back (options given later
    can still name another decoder), and `complete` pins every option they do not set."""
    unknown = sorted(set(sampling) - set(SamplingConfig.model_fields))
    if unknown:
        raise InputError(f"unknown sampling options {unknown}")
    checked = resolve_sampling(sampling).model_dump()  # leaves RUNTIME_OPTIONS out
    entry = checked if complete else {k: checked[k] for k in sampling if k in checked}
    config = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "mask_token_id": tokenizer.mask_token_id,
        "unmask": entry,
    }
    if isinstance(sampling, FolderSampling):
        own = without_none(sampling.own)
        config["unmask"] = {k: v for k, v in entry.items()
                            if k in own or k not in sampling.defaults}  # fmt: skip
        config[DEFAULTS_ENTRY] = dict(sampling.defaults)
    return json.dumps(config, indent=2)


DEFAULTS_ENTRY = "unmask_defaults"
"""generation_config.json's entry for a family's default decoding that an exported
released folder keeps as defaults (`generation_config_text`, `saved_sampling`)."""


def saved_sampling(folder: str | Path) -> dict[str, Any]:
    """The sampling options a model folder carries: its generation_config.json "unmask"
    entry, and the logit shift where the file does not say but the folder's model family
    samples with it (Dream). An unknown option is an InputError naming the file."""
    generation = Path(folder) / GENERATION_FILE
    path = Path(folder) / UNMASK_GENERATION_FILE
    path = path if path.is_file() else generation
    saved: dict[str, Any] = {}
    defaults: dict[str, Any] = {}
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            saved = data.get("unmask") or {}
            defaults = data.get(DEFAULTS_ENTRY) or {}
        except (json.JSONDecodeError, AttributeError):
            raise InputError(f"{str(path)!r} is not a JSON object; fix or delete it") from None
        if not isinstance(saved, dict):
            raise InputError(f'{str(path)!r}: "unmask" must map sampling options to values')
        if not isinstance(defaults, dict):
            raise InputError(f'{str(path)!r}: "{DEFAULTS_ENTRY}" must map sampling options '
                             f"to values")  # fmt: skip
    for key in [*saved, *defaults]:
        if key in RUNTIME_OPTIONS:
            raise InputError(
                f"{str(path)!r}: '{key}' is not read from a model folder (it would run code "
                f"the folder names); give --{key.replace('_', '-')} on the command line"
            )
        if key not in SamplingConfig.model_fields:
            hint = did_you_mean(key, SamplingConfig.model_fields)
            raise InputError(f"{str(path)!r}: unknown sampling option '{key}'{hint}")
    config = _folder_config(Path(folder))
    if "shift_logits" not in saved and samples_with_logit_shift(config):
        saved = {**saved, "shift_logits": True}
    family = family_of_config(config)
    if family is not None and family.shape.canvas_decoder:
        # a canvas of random tokens (no [MASK]): the family's shape fixes uniform_canvas;
        # transformers' own generation settings under the folder's "unmask" entry
        own = _transformers_generation(generation) if generation.is_file() else {}
        saved = {**own, **saved, "uniform_canvas": True}
    if defaults:  # an exported released folder: its family's decoding, still defaults
        return FolderSampling(saved, defaults)
    if family is not None and family.decoding and "unmask" not in config:
        return FolderSampling(saved, family.decoding)
    return dict(saved)


def _folder_config(folder: Path) -> dict[str, Any]:
    """The folder's config.json ({} when unreadable: the model loader reports it)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return config if isinstance(config, dict) else {}


def _transformers_generation(path: Path) -> dict[str, Any]:
    """The sampling options a transformers diffusion_gemma generation_config.json sets
    (DiffusionGemmaGenerationConfig's keys, `TRANSFORMERS_GENERATION_KEYS`; unset = null)."""
    data = json.loads(path.read_text())
    options = {ours: data[theirs] for theirs, ours in TRANSFORMERS_GENERATION_KEYS.items()
               if data.get(theirs) is not None}  # fmt: skip
    sampler = data.get("sampler_config")
    if isinstance(sampler, dict) and sampler.get("entropy_bound") is not None:
        options["entropy_bound"] = sampler["entropy_bound"]
    return options
