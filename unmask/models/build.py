"""Model construction: a fresh model per family, an empty one to load into, or a local folder.

This module sits above models/transformer.py and models/hf.py (neither imports it):
`build_model(cfg)` is the one entry point the trainer uses, `from_pretrained(folder)` loads a
native HF folder, and `build_empty(cfg)` is the one meta-device construction path for callers
that fill a model from a state dict (checkpoint export, full-state gathers).
"""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from unmask.models.config import ModelConfig
from unmask.models.diffusion_gemma import DiffusionGemma
from unmask.models.diffusion_gemma_layout import LORA_PROJECTOR, LORA_TOWER
from unmask.models.diffusion_gemma_vision import (
    Vision,
    attach_vision,
    register_empty_vision,
    vision_registered,
)
from unmask.models.families import (
    FAMILIES,
    Family,
    add_family,
    family_for_hf_type,
    remove_family,
)
from unmask.models.hf import (
    RUN_FIELDS,
    check_weight_files,
    config_from_hf,
    load_weights,
    read_config,
    read_state_dict,
    split_carried,
)
from unmask.models.hf_wrapped import build_encoder, is_encoder_folder, is_wrapped, load_encoder
from unmask.models.moe import moe_blocks
from unmask.models.shape import WRAPPED, ModelShape
from unmask.models.transformer import DiffusionTransformer

VISION_LORA_TARGETS = (LORA_TOWER, LORA_PROJECTOR)

OWN_BLOCKS: dict[str, Callable[[ModelConfig], nn.Module]] = {"diffusion_gemma": DiffusionGemma}
"""The families of models/families.py with blocks of their own, and their builders."""

MODEL_BUILDERS: dict[str, Callable[[ModelConfig], nn.Module]] = {
    name: OWN_BLOCKS.get(name, DiffusionTransformer if family.native else build_encoder)
    for name, family in FAMILIES.items()
}
"""family name -> random-init builder (native families: DiffusionTransformer, or their own
in `OWN_BLOCKS`)."""


def register_family(family: Family, builder: Callable[[ModelConfig], nn.Module]) -> None:
    """Add a model family from outside the package: `family` (models/families.py, with its
    `shape` declaration when its blocks differ from the decoder's) becomes a valid
    `model.model_type`, built by `builder(cfg)` (a random-init model in the layout
    models/shape.py names). ValueError when its name or config.json model_type is taken."""
    if family.name in MODEL_BUILDERS:
        raise ValueError(f"model family {family.name!r} is already registered")
    add_family(family)
    MODEL_BUILDERS[family.name] = builder


def unregister_family(name: str) -> None:
    """Take a family added with `register_family` out again."""
    remove_family(name)
    MODEL_BUILDERS.pop(name, None)


def shape_of(cfg: ModelConfig) -> ModelShape:
    """The shape declaration (models/shape.py) of an architecture's family (a model as
    built: `model.config`); `WRAPPED` for a pretrained transformers encoder folder. A run's
    model section with a pretrained folder: `resolve_model(cfg).shape` (the folder's)."""
    if is_wrapped(cfg):
        return WRAPPED
    return FAMILIES[cfg.model_type].shape


@dataclass(frozen=True)
class ResolvedModel:
    """The model a run's `model:` section builds, resolved once (`resolve_model`): every
    check, the trainer's layout plan and the planner read this, not the section's
    `model_type` (which a pretrained folder does not set) nor the folder's config.json again.
    """

    section: ModelConfig
    """The run's model section as written (its run fields: LoRA, 4-bit, kernels)."""
    arch: ModelConfig
    """The architecture built: the section itself, or the pretrained folder's config.json
    (a transformers encoder folder: the section, whose fields transformers does not read)."""
    family: Family
    """The family built: the folder's (config.json's model_type or unmask's tag), else the
    section's model_type."""
    shape: ModelShape
    """The family's shape declaration (models/shape.py), `WRAPPED` for an encoder."""

    @property
    def wrapped(self) -> bool:
        """Runs through transformers (an encoder family or folder), not a native decoder."""
        return self.shape is WRAPPED or not self.family.native

    @property
    def name(self) -> str:
        """How messages name the model: its folder, else its model_type."""
        return str(self.section.pretrained or self.section.model_type)

    def planned(self) -> ModelConfig:
        """The architecture with the section's run fields (how it is built and trained) and
        no folder: what the planner builds on the meta device, whose weights it never reads.
        Without a folder there is no vision tower (plan/vision.py counts a folder's apart):
        freeze_vision true, no vision LoRA targets. A LoRA list of vision targets only plans
        the text model without LoRA (the tower's adapters are plan/vision.py's): its backward
        runs as the trainer's does (to reach the tower), while its weights' gradients and
        optimizer state, which stay frozen, are counted too (an upper bound)."""
        run = {key: getattr(self.section, key) for key in RUN_FIELDS if key != "model_type"}
        targets = run["lora_target_modules"]
        if isinstance(targets, list):
            text = [t for t in targets if t not in VISION_LORA_TARGETS]
            run["lora_target_modules"] = text or "all-linear"
            run["lora"] = run["lora"] and bool(text)
        return self.arch.model_copy(update={**run, "pretrained": None, "freeze_vision": True})


def resolve_model(cfg: ModelConfig) -> ResolvedModel:
    """The `ResolvedModel` of a model section: reads a pretrained folder's config.json once
    (one clear line when it cannot be read or names no family unmask loads)."""
    if cfg.pretrained is not None and is_encoder_folder(cfg.pretrained):
        family = family_for_hf_type(read_config(Path(cfg.pretrained)).get("model_type"))
        return ResolvedModel(cfg, cfg, family, WRAPPED)
    family = FAMILIES[cfg.model_type]
    if cfg.pretrained is None or not family.native:
        return ResolvedModel(cfg, cfg, family, family.shape)
    arch = config_from_hf(read_config(Path(cfg.pretrained)))
    family = FAMILIES[arch.model_type]
    return ResolvedModel(cfg, arch, family, family.shape)


def build_model(cfg: ModelConfig) -> nn.Module:
    """Random-init model for cfg (call torch.manual_seed first), or load cfg.pretrained."""
    if cfg.pretrained is not None:
        if is_encoder_folder(cfg.pretrained):
            return load_encoder(cfg.pretrained)
        model = from_pretrained(
            cfg.pretrained,
            attn_implementation=cfg.attn_implementation,
            loss_implementation=cfg.loss_implementation,
        )
        if vision_registered(cfg):  # trained or LoRA-adapted: the model's own modules
            attach_vision(model, cfg.freeze_vision)
        return model
    return MODEL_BUILDERS[cfg.model_type](cfg)


def max_positions(cfg: ModelConfig) -> int:
    """The model's max_position_embeddings: cfg's, or its pretrained folder's, whose
    config.json and weight files are checked on the way (cheaply: before anything is built)."""
    if cfg.pretrained is None:
        return cfg.max_position_embeddings
    folder = Path(cfg.pretrained)
    hf = read_config(folder)
    if is_encoder_folder(folder):  # transformers reads its weights; positions are learned
        return int(hf.get("max_position_embeddings", cfg.max_position_embeddings))
    positions = config_from_hf(hf).max_position_embeddings
    check_weight_files(folder)
    return positions


_INIT_FUNCTIONS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                   "xavier_uniform_", "xavier_normal_", "zeros_", "ones_", "constant_")  # fmt: skip


@contextlib.contextmanager
def _no_init():
    """torch.nn.init's in-place initializers as no-ops while modules are built on the meta
    device: there is no storage to fill, and the meta kernels of these ops import
    torch._dynamo (about 0.7 s of every `unmask generate`)."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    for name in saved:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def build_empty(
    cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> DiffusionTransformer:
    """A native model for cfg with uninitialized storage on device, to load a state dict into.

    Built on the meta device (no init, no memory), then `to_empty(device)`, `tie_weights()`
    (a tied head shares the embedding again) and cast to dtype (None: keep float32). Every
    tensor of the model is in its state dict, so a full `load_state_dict` fills it all.
    """
    if not FAMILIES[cfg.model_type].native:
        raise ValueError(f"build_empty builds native decoders; {cfg.model_type!r} is an encoder")
    with torch.device("meta"), _no_init():
        model = MODEL_BUILDERS[cfg.model_type](cfg)
    model.to_empty(device=device)
    model.tie_weights()
    for buffer_owner in moe_blocks(model):  # statistics buffers: not in the state dict
        buffer_owner.load.zero_()
        buffer_owner.aux_sum.zero_()
    if dtype is not None:
        model = model.to(dtype)
    return model


def from_pretrained(
    folder: str | Path,
    dtype: torch.dtype | None = None,
    attn_implementation: str = "auto",
    loss_implementation: str = "chunked",
) -> DiffusionTransformer:
    """Load a local HF folder of a native family (Qwen3, Qwen2, Llama, Dream, LLaDA, ...,
    DiffusionGemma) or an unmask-saved one; its config.json is kept as
    `model.hf_source_config` for saving, and the tensors of the folder the model does not run
    (the family's `carried` keys: DiffusionGemma's vision tower) as `model.hf_carried_weights`.

    dtype: parameter dtype; None keeps float32 (training master weights). A transformers
    encoder folder (bert, modernbert: what a run of those families writes) is read by
    transformers (`load_encoder`).
    """
    folder = Path(folder)
    if is_encoder_folder(folder):
        return load_encoder(folder).to(dtype or torch.float32)
    source = read_config(folder)
    cfg = config_from_hf(source)
    cfg = cfg.model_copy(
        update={
            "attn_implementation": attn_implementation,
            "loss_implementation": loss_implementation,
        }
    )
    state, carried = split_carried(read_state_dict(folder, cfg.model_type, cfg), cfg.model_type)
    if cfg.qk_norm and "unmask" in source and not any(".q_norm." in key for key in state):
        # a folder unmask wrote before config.json said qk_norm: false (its weights say it)
        cfg = cfg.model_copy(update={"qk_norm": False})
    model = build_empty(cfg, dtype=dtype or torch.float32)
    load_weights(model, state, folder)
    model.hf_source_config = source
    model.hf_carried_weights = carried
    return model


def build_empty_like(model: nn.Module) -> nn.Module:
    """`build_empty(model.config)` that also holds what model's state dict holds beyond the
    architecture: a registered (trained) vision tower, and the folder's config.json and
    carried tensors, so a full state loaded into it saves the folder `model` would (a
    sharded run's final save)."""
    plain = build_empty(model.config)
    source = getattr(model, "hf_source_config", None)
    carried = getattr(model, "hf_carried_weights", None)
    vision = next((m for m in model.modules() if isinstance(m, Vision)), None)
    if vision is None and not carried:
        return plain
    plain.hf_source_config, plain.hf_carried_weights = source, carried
    if vision is not None:
        register_empty_vision(plain, source)
    return plain
