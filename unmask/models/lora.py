"""LoRA through peft: wrap the model, save the adapter in peft's format, merged export.

Only the LoRA factors train (the base weights are frozen), and the optimizer routes every
parameter whose name holds `lora` to AdamW (never Muon). The adapter is saved with peft's own
`save_pretrained`, so `peft.PeftModel.from_pretrained(base_model, folder)` loads it. An
adapter records its base: adapter_config.json's `base_model_name_or_path` (the absolute
model.pretrained folder), and lora_base.json next to it (that folder, or the model section and
seed that rebuild a base made from the config, the vocabulary size and a fingerprint of the
base weights), so an adapter folder can be sampled and exported without its run's config.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from unmask.errors import InputError
from unmask.models.config import ModelConfig
from unmask.models.diffusion_gemma_vision import LORA_PROJECTOR, LORA_TOWER, PROJECTOR, TOWER
from unmask.models.families import FAMILIES
from unmask.models.shape import WRAPPED

ADAPTER_FILE = "adapter_model.safetensors"  # peft's file name: what a LoRA run saves
ADAPTER_CONFIG = "adapter_config.json"  # peft's settings file, next to ADAPTER_FILE
LORA_BASE_FILE = "lora_base.json"  # what rebuilds the base an adapter was trained on
# `experts` in a lora_target_modules list: the routed expert stacks of an MoE model
# ((experts, out, in) parameters, not modules), adapted through peft's `target_parameters`
# (one rank-r pair per expert). "all-linear" leaves them frozen (attention and shared experts).
EXPERTS = "experts"


def targets_experts(cfg: ModelConfig) -> bool:
    targets = cfg.lora_target_modules
    return cfg.lora and isinstance(targets, list) and EXPERTS in targets


def check_request(cfg: ModelConfig) -> None:
    """Reject what cannot run here before anything is written: one clear line each.
    (4-bit requests are checked by `unmask.models.quant.check_4bit` once the device is known.)"""
    if cfg.lora and importlib.util.find_spec("peft") is None:
        raise InputError("model.lora: true needs the peft package (pip install 'unmask[lora]')")
    if targets_experts(cfg) and cfg.lora_dropout > 0:
        raise InputError(
            f"model.lora_dropout={cfg.lora_dropout} cannot apply to the expert stacks "
            "(lora_target_modules holds 'experts'; peft adapts them as parameters, without an "
            "input to drop): set lora_dropout: 0"
        )
    if targets_experts(cfg) and cfg.load_in_4bit:
        raise InputError(
            "model.load_in_4bit does not quantize the expert stacks; drop 'experts' from "
            "lora_target_modules or set load_in_4bit: false"
        )


def lora_targets(cfg: ModelConfig, model: nn.Module) -> str | list[str]:
    """Module names that get adapters: for "all-linear" what the model's family declares
    (its shape's `lora_linear`: every decoder-block linear layer of the native model,
    DiffusionGemma's stack layers, transformers' own choice for encoders). A list naming
    `vision_tower` / `embed_vision` (DiffusionGemma's vision tower layers' linear maps, its
    projector) becomes one regex: those, and the list's other names outside the vision
    modules (`all-linear` in the list: the family's)."""
    targets = cfg.lora_target_modules
    if targets in (None, "all-linear"):
        return _family_linear(model)
    if isinstance(targets, str):  # peft's regex
        return targets
    names = [t for t in targets if t != EXPERTS]  # the expert stacks: `expert_targets`
    vision = [VISION_TARGETS[t] for t in names if t in VISION_TARGETS]
    if not vision:
        return names
    others = [t for t in names if t not in VISION_TARGETS]
    parts = list(vision)
    if "all-linear" in others:
        linear = _family_linear(model)
        parts.append(linear if isinstance(linear, str) else _names_regex(linear))
        others.remove("all-linear")
    if others:
        parts.append(_names_regex(others))
    return "|".join(f"(?:{part})" for part in parts)


VISION_TARGETS = {
    LORA_TOWER: re.escape(TOWER) + r"encoder\.layers\.\d+\."
                r"(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.linear",
    LORA_PROJECTOR: re.escape(PROJECTOR) + r"embedding_projection",
}  # fmt: skip
"""lora_target_modules entries for DiffusionGemma's vision modules (models/
diffusion_gemma_vision.py; registered on the model for them) -> the regex of the modules
they adapt: the tower layers' attention and MLP linear maps (inside their clamps), the
projector's linear map."""


def _family_linear(model: nn.Module) -> str | list[str]:
    built = getattr(model, "config", None)
    shape = FAMILIES[built.model_type].shape if isinstance(built, ModelConfig) else WRAPPED
    linear = shape.lora_linear
    return list(linear) if isinstance(linear, tuple) else linear


def _names_regex(names) -> str:
    """peft's list rule (a module whose name is, or ends with `.` and, a listed name) as a
    regex, left out of the vision modules."""
    return r"(?!model\.encoder\.)(?:.*\.)?(?:" + "|".join(re.escape(n) for n in names) + ")"


def adapts_vision(folder: Path) -> bool:
    """Whether the adapter saved in folder adapts DiffusionGemma's vision modules (its
    adapter_config.json's target_modules name them): its base must have them registered."""
    try:
        targets = json.loads((Path(folder) / ADAPTER_CONFIG).read_text()).get("target_modules")
    except (OSError, json.JSONDecodeError, AttributeError):
        return False
    return isinstance(targets, str) and r"model\.encoder\." in targets


def expert_targets(cfg: ModelConfig, model: nn.Module) -> list[str] | None:
    """peft `target_parameters` for the routed expert stacks when lora_target_modules holds
    `experts` (None otherwise); refused on a model without them."""
    if not targets_experts(cfg):
        return None
    stacks = expert_stack_targets(model)
    if not stacks:
        moe = ", ".join(name for name, family in FAMILIES.items() if family.native and family.moe)
        raise InputError(
            "model.lora_target_modules holds 'experts' but this model has no routed expert "
            f"stacks (an MoE model: {moe}); drop it"
        )
    return stacks


def expert_stack_targets(model: nn.Module) -> list[str]:
    """The routed expert stacks of model as peft `target_parameters` (which peft matches as
    the end of a parameter's full name): each expert module's own declaration,
    `expert_stacks` (paths from the module; the one expert parallelism reads), after the
    module's name: the native MoE families' `mlp.experts.{gate,up,down}_proj`,
    DiffusionGemma's `experts.gate_up_proj` and `experts.down_proj`."""
    found = set()
    for name, module in model.named_modules():
        for path in getattr(type(module), "expert_stacks", None) or ():
            found.add(f"{name.rpartition('.')[2]}.{path}")
    return sorted(found)


# what a LoRA checkpoint must be resumed with (lora_alpha is not in the adapter's shapes)
LORA_SETTINGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "load_in_4bit")


def lora_settings(cfg: ModelConfig) -> dict:
    return {name: getattr(cfg, name) for name in LORA_SETTINGS}


def check_lora_settings(saved: dict | None, cfg: ModelConfig, path) -> None:
    if saved is None:
        return
    if not cfg.lora:
        raise InputError(
            f"checkpoint {str(path)!r} holds a LoRA adapter; it was written by a LoRA run: set "
            "model.lora: true (resume with the config it was written with)"
        )
    now = lora_settings(cfg)
    changed = [f"{k}: {saved[k]!r} -> {now[k]!r}" for k in now if k in saved and saved[k] != now[k]]
    if changed:
        raise InputError(
            f"LoRA checkpoint {str(path)!r} was written with other settings ({'; '.join(changed)}); "
            "resume with the config it was written with"
        )


def peft_config(cfg: ModelConfig, model: nn.Module):
    import peft  # optional extra (lora): imported only when LoRA is used

    return peft.LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=lora_targets(cfg, model),
        target_parameters=expert_targets(cfg, model),
    )


def apply_lora(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """A peft `PeftModel` around model: base weights frozen, LoRA factors trainable."""
    import peft  # optional extra (lora): imported only when LoRA is used

    wrapped = peft.get_peft_model(model, peft_config(cfg, model))
    if cfg.pretrained is not None:  # saved into adapter_config.json: peft's record of the base
        base = str(Path(cfg.pretrained).expanduser().resolve())
        wrapped.peft_config["default"].base_model_name_or_path = base
    return wrapped


def base_record(cfg: ModelConfig, seed: int, vocab_size: int, fingerprint) -> dict:
    """lora_base.json: the base a LoRA run trains on. `pretrained` (absolute) when it came
    from a folder; else `model` and `seed` rebuild it (torch.manual_seed(seed), then
    build_model(model)); `vocab_size` after any resize; `fingerprint` (base_fingerprint, None
    when not computed) tells a rebuilt or moved base from another."""
    pretrained = cfg.pretrained
    if pretrained is not None:
        pretrained = str(Path(pretrained).expanduser().resolve())
    model = cfg.model_copy(update={"pretrained": pretrained}).model_dump(mode="json")
    return {"pretrained": pretrained, "seed": seed, "vocab_size": vocab_size,
            "fingerprint": fingerprint, "model": model}  # fmt: skip


def merge_adapter(base: nn.Module, folder: Path) -> nn.Module:
    """base with the peft adapter saved in folder merged into its weights (base is changed
    in place and returned); an adapter of other shapes is an InputError."""
    import peft  # the lora extra

    try:
        wrapped = peft.PeftModel.from_pretrained(base, str(folder))
    except (RuntimeError, ValueError) as err:  # shapes or target modules differ
        first = (str(err).strip().splitlines() or [type(err).__name__])[-1].strip()
        raise InputError(
            f"LoRA adapter {str(folder)!r} does not fit its base model ({first[:160]}); "
            "pass --base with the model it was trained on"
        ) from None
    return wrapped.merge_and_unload()


def save_adapter(model: nn.Module, folder: Path) -> None:
    """The adapter of the PeftModel `model` in peft's format. The embeddings are never saved
    (they are not adapted; a resized vocabulary is rebuilt from lora_base.json), so peft does
    not look the recorded base up (its "auto" check reads the base's config through
    transformers, or the Hub)."""
    model.save_pretrained(str(folder), save_embedding_layers=False)


def save_lora(model: nn.Module, output_dir: Path, final: Path, cfg: ModelConfig) -> nn.Module:
    """Adapter (peft format) in output_dir/adaptor_name; final/ holds the merged model when
    `lora_merge` is set (returned, to use from then on), else the adapter too."""
    save_adapter(model, output_dir / cfg.adaptor_name)
    if not cfg.lora_merge:
        save_adapter(model, final)
        return model
    merged = model.merge_and_unload()
    merged.save_pretrained(str(final))
    return merged


def load_adapter(folder: Path, model: nn.Module) -> None:
    """The adapter a LoRA run saved in folder (peft's format) into the PeftModel `model`
    (the frozen base weights come from model.pretrained / the seed)."""
    from peft import set_peft_model_state_dict  # the lora extra

    file = Path(folder) / ADAPTER_FILE
    if not file.is_file():
        raise InputError(
            f"checkpoint {str(folder)!r} holds no LoRA adapter ({ADAPTER_FILE}); it was "
            "written by a run without model.lora: true, so resume it with that run's config"
        )
    try:
        result = set_peft_model_state_dict(model, load_file(str(file)))
    except RuntimeError as err:  # shapes differ: another lora_r or target modules
        first = str(err).strip().splitlines()[-1].strip()
        raise InputError(
            f"LoRA checkpoint {str(folder)!r} does not match model.lora_* in the config "
            f"({first[:160]}); resume with the config it was written with"
        ) from None
    expected = {name for name, p in model.named_parameters() if p.requires_grad}
    missing = sorted(name for name in result.missing_keys if name in expected)
    if missing or result.unexpected_keys:
        raise InputError(
            f"LoRA checkpoint {str(folder)!r} does not match model.lora_* in the config "
            f"(missing {missing[:3]}, unexpected {sorted(result.unexpected_keys)[:3]}); "
            "resume with the config it was written with"
        )


def base_fingerprint(model: nn.Module) -> list[float]:
    """[sum, sum of squares] of the frozen (base) weights in float64: a LoRA checkpoint
    stores it, so resuming on a different base model fails instead of training on."""
    return weights_fingerprint(p for p in model.parameters() if not p.requires_grad)


def weights_fingerprint(params) -> list[float]:
    """[sum, sum of squares] of the tensors in float64 (see base_fingerprint)."""
    total, squares = 0.0, 0.0
    for param in params:
        value = param.detach()
        if not value.is_floating_point():  # packed 4-bit weights (uint8)
            value = value.to(torch.float32)
        total += float(value.sum(dtype=torch.float64))
        squares += float(torch.linalg.vector_norm(value, dtype=torch.float64) ** 2)
    return [total, squares]


def check_base_fingerprint(saved: list[float] | None, model: nn.Module, path) -> None:
    """InputError when a LoRA checkpoint's base fingerprint differs from model's."""
    if saved is None:
        return
    now = base_fingerprint(model)
    if any(abs(a - b) > 1e-6 * max(1.0, abs(a)) for a, b in zip(saved, now)):
        raise InputError(
            f"LoRA checkpoint {str(path)!r} was trained on other base weights than this "
            "config's model; resume with the model.pretrained (and seed) it was written with"
        )
