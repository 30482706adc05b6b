"""What the playground offers for the loaded model (GET /api/info's `playground`): the
decoders that apply to it, the options each decoder accepts, the first row of the form and
the presets (published samplers) that this model takes.

A preset is offered only when the model's own options with the preset's on top validate as
a request's would (`sampling_config` + `with_uniform_canvas`): no preset the model refuses.
The masked presets apply to models with [MASK] tokens, LLaDA2.1's speedy / quality to the
llada2_moe family (the one trained to edit) or a folder that decodes with joint_threshold,
DiffusionGemma's entropy_bound ones to uniform-canvas models.
"""

from __future__ import annotations

from typing import Any

from unmask.errors import InputError
from unmask.sampling.config import resolve_sampling
from unmask.sampling.decoders import DECODERS, decoder_names, implied, refused_options
from unmask.sampling.entropy_bound import ENTROPY_BOUND_DEFAULTS
from unmask.sampling.generate import with_uniform_canvas

#: the first row of the form, by decoder (the rest are under "every option")
TOP_ROW = {
    "entropy_bound": (
        "max_tokens",
        "max_denoising_steps",
        "temperature_start",
        "temperature_end",
    ),  # fmt: skip
    "left_to_right": ("max_tokens", "temperature"),
    "joint_threshold": ("max_tokens", "steps", "block_length", "threshold"),
}
TOP_ROW_MASKED = ("max_tokens", "steps", "block_length", "temperature")
#: the family trained to edit its own tokens (LLaDA2.1): its speedy / quality presets
EDITING_FAMILIES = ("llada2_moe",)

#: (name, label, options, kind): kind says which models a preset is for
PRESETS: list[tuple[str, str, dict[str, Any], str]] = [
    ("speedy", "LLaDA2.1 speedy: joint threshold 0.5, edits at any gain",
     {"decoder": "joint_threshold", "joint_preset": "speedy"}, "editing"),
    ("quality", "LLaDA2.1 quality: joint threshold 0.7, edit threshold 0.5",
     {"decoder": "joint_threshold", "joint_preset": "quality"}, "editing"),
    ("entropy_bound", "DiffusionGemma: entropy bound 0.1 (transformers' default)",
     {"decoder": "entropy_bound", "entropy_bound": ENTROPY_BOUND_DEFAULTS["entropy_bound"]},
     "uniform"),
    ("entropy_bound_careful", "DiffusionGemma careful: entropy bound 0.05, 96 steps",
     {"decoder": "entropy_bound", "entropy_bound": 0.05, "max_denoising_steps": 96}, "uniform"),
    ("llada", "LLaDA: low confidence, per-block quotas",
     {"decoder": "masked", "remasking": "low_confidence", "schedule": "llada"}, "masked"),
    ("dream", "Dream: entropy, dream timesteps", {"decoder": "masked", "remasking": "entropy", "schedule": "dream"},
     "masked"),
    ("fastdllm", "Fast-dLLM: threshold 0.9, dual cache", {"decoder": "masked", "threshold": 0.9, "cache": "dual"},
     "masked"),
    ("mdlm", "MDLM: ancestral (origin, ddpm cache)", {"decoder": "masked", "remasking": "origin", "ddpm_cache": True},
     "masked"),
    ("random", "random order", {"decoder": "masked", "remasking": "random"}, "masked"),
]  # fmt: skip


def of_kind(kind: str) -> list[str]:
    """The decoders that declare `kind` (uniform_canvas, autoregressive), registration
    order: the only ones such a model takes."""
    return [name for name, decoder in DECODERS.items() if getattr(decoder, kind)]


def not_masked() -> tuple[str, ...]:
    """The decoders a model with [MASK] tokens never runs from the page: those of its own
    kinds of model (uniform-canvas, autoregressive), by their declarations."""
    return tuple(name for name, kind in DECODERS.items()
                 if kind.uniform_canvas or kind.autoregressive)  # fmt: skip


def _valid(saved: dict[str, Any], options: dict[str, Any], uniform: bool) -> bool:
    try:
        config = resolve_sampling(saved, options, strict=True)
        if uniform and not config.uniform_canvas:
            config = with_uniform_canvas(config)
    except (InputError, ValueError):
        return False
    return True


def playground(saved: dict[str, Any], family: str | None, uniform: bool,
               option_names: list[str]) -> dict[str, Any]:  # fmt: skip
    """The playground's part of /api/info: the model's family and decoder, the decoders
    that apply, per decoder the options it accepts and its first row, and the presets."""
    try:
        config = resolve_sampling(saved)
        if uniform and not config.uniform_canvas:
            config = with_uniform_canvas(config)
        decoder = implied(config)
    except (InputError, ValueError):  # the first decoder of the model's kind, as `implied`
        config, decoder = None, of_kind("uniform_canvas")[0] if uniform else decoder_names()[0]
    if uniform:
        decoders = of_kind("uniform_canvas")
    elif config is not None and config.autoregressive:
        decoders = of_kind("autoregressive")
    else:
        decoders = [name for name in decoder_names() if name not in not_masked()]
    if decoder not in decoders:
        decoders.insert(0, decoder)
    accepted = {name: [o for o in option_names if o not in refused_options(name)]
                for name in decoders}  # fmt: skip
    top = {name: [o for o in TOP_ROW.get(name, TOP_ROW_MASKED) if o in option_names]
           for name in decoders}  # fmt: skip
    editing = family in EDITING_FAMILIES or decoder == "joint_threshold"
    wanted = {"editing": editing and not uniform, "uniform": uniform,
              "masked": not uniform and decoder not in not_masked()}  # fmt: skip
    presets = [{"name": "", "label": f"the model folder's ({decoder})", "options": {}}]
    for name, label, options, kind in PRESETS:
        if wanted[kind] and _valid(saved, options, uniform):
            presets.append({"name": name, "label": label, "options": options})
    return {"family": family, "decoder": decoder, "decoders": decoders, "accepted": accepted,
            "top_row": top, "presets": presets, "uniform_canvas": uniform}  # fmt: skip
