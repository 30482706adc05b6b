"""A family's folder: how its config.json and weights map to unmask's ModelConfig and native
state dict. Each `Family` (models/families.py) names one `FolderLayout`; models/hf.py reads
and writes every folder through it and switches on no family.

A layout says four things (the base class is the HF Llama / Qwen layout, whose weight names
are the native ones):

- `fields(hf, family)`: ModelConfig fields from a config.json dict (one InputError line for
  what unmask cannot run);
- `config(cfg, family, dtype_name)`: the config.json dict for a ModelConfig, with unmask's
  tag ("unmask": {"model_type": ...});
- `to_native(state, cfg, folder)` / `to_folder(state)`: the state dict's layout (experts one
  matrix each or stacked, fused or renamed tensors) after / before the family's key map
  (`Family.key_map`, plain renames);
- `check(cfg)`: a ValueError for a ModelConfig its folders cannot hold (ModelConfig's
  validation calls it), and `moe`: whether its folders hold mixture-of-experts layers.

A family from another package subclasses FolderLayout for a folder of its own (a nested
config, fused weights) and passes it as `Family(layout=...)`: nothing under unmask/ changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from unmask.errors import InputError
from unmask.models.diffusion_gemma_layout import (
    diffusion_gemma_config,
    diffusion_gemma_fields,
    shared_encoder_biases,
)
from unmask.models.moe_layout import (
    expert_counts,
    hf_moe_config,
    hf_moe_fields,
    llada2_config,
    llada2_fields,
    llada2_to_native,
    moe_tag,
    native_to_llada2,
    split_experts,
    stack_experts,
    tagged_moe_fields,
)

HF_DIRECT_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "initializer_range",
)
"""HF-style config.json keys that are ModelConfig fields of the same name."""

State = dict[str, torch.Tensor]


def _rope_theta(hf: dict[str, Any]) -> float | None:
    """rope_theta from a transformers 5 `rope_parameters` dict or the older top-level key."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise InputError(
            f"config.json: RoPE scaling type {rope_type!r} is not supported; only the default "
            "RoPE is (remove rope_scaling / rope_parameters.rope_type or use a plain Qwen3 model)"
        )
    return params.get("rope_theta", hf.get("rope_theta"))


class FolderLayout:
    """HF Llama / Qwen folders (transformers' own config keys and weight names), dense."""

    moe: bool = False
    """Its folders hold mixture-of-experts layers (an MoE family)."""

    def fields(self, hf: dict[str, Any], family) -> dict[str, Any]:
        """ModelConfig fields from an HF Llama/Qwen-style config.json."""
        if hf.get("mlp_bias"):
            raise InputError("config.json: mlp_bias=true is not supported; need false")
        if hf.get("hidden_act", "silu") != "silu":
            raise InputError(
                f"config.json: hidden_act {hf['hidden_act']!r} is not supported; need silu"
            )
        if hf.get("use_sliding_window"):
            raise InputError(
                "config.json: use_sliding_window=true is not supported; set it to false"
            )
        fields = {key: hf[key] for key in HF_DIRECT_KEYS if hf.get(key) is not None}
        theta = _rope_theta(hf)
        if theta is not None:
            fields["rope_theta"] = float(theta)
        elif family.hf_rope_theta_default is not None:
            fields["rope_theta"] = family.hf_rope_theta_default
        fields.update(tagged_moe_fields(hf))
        return fields

    def config(self, cfg, family, dtype_name: str) -> dict[str, Any]:
        """The config.json dict of cfg, transformers' Llama / Qwen keys."""
        return {
            "architectures": [family.architecture],
            "model_type": family.hf_model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.resolved_head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "attention_bias": cfg.attention_bias,
            "attention_dropout": 0.0,
            "initializer_range": cfg.initializer_range,
            "use_sliding_window": False,
            "sliding_window": None,
            "layer_types": ["full_attention"] * cfg.num_hidden_layers,
            "use_cache": False,
            "torch_dtype": dtype_name,
            "dtype": dtype_name,
            "unmask": {"model_type": cfg.model_type},
        }

    def to_native(self, state: State, cfg, folder: Path) -> State:
        """A folder's tensors (after the key map) in the native layout."""
        return state

    def to_folder(self, state: State) -> State:
        """Native tensors (after the key map) in the folder's layout."""
        return state

    def check(self, cfg) -> None:
        """A ValueError for a ModelConfig this layout's folders cannot hold."""


class LladaLayout(FolderLayout):
    """LLaDA's remote-code folders: OLMo-style config keys (its weight names are the
    family's key map)."""

    _CHECKS = {
        "block_type": "llama",
        "activation_type": "silu",
        "layer_norm_type": "rms",
        "rope": True,
        "alibi": False,
        "attention_layer_norm": False,
        "include_bias": False,
    }

    def fields(self, hf: dict[str, Any], family) -> dict[str, Any]:
        try:
            return self._fields(hf, family)
        except (KeyError, ValueError) as err:
            raise InputError(f"config.json: LLaDA config is missing or has bad {err}") from err

    def _fields(self, hf: dict[str, Any], family) -> dict[str, Any]:
        for key, want in self._CHECKS.items():
            if key in hf and hf[key] != want:
                raise InputError(
                    f"config.json: LLaDA {key}={hf[key]!r} is not supported; need {want!r}"
                )
        n_heads = hf["n_heads"]
        fields = {
            "vocab_size": hf.get("embedding_size") or hf["vocab_size"],
            "hidden_size": hf["d_model"],
            "intermediate_size": hf.get("mlp_hidden_size")
            or hf.get("mlp_ratio", 4) * hf["d_model"],
            "num_hidden_layers": hf["n_layers"],
            "num_attention_heads": n_heads,
            "num_key_value_heads": hf.get("n_kv_heads") or n_heads,
            "rms_norm_eps": hf.get("rms_norm_eps", 1e-5),
            "max_position_embeddings": hf.get("max_sequence_length", 4096),
            "tie_word_embeddings": bool(hf.get("weight_tying", False)),
            "qkv_bias": bool(hf.get("include_qkv_bias", False)),
            "initializer_range": hf.get("init_std", 0.02),
        }
        if "rope_theta" in hf or family.hf_rope_theta_default is not None:
            fields["rope_theta"] = hf.get("rope_theta", family.hf_rope_theta_default)
        return fields

    def config(self, cfg, family, dtype_name: str) -> dict[str, Any]:
        return {
            "architectures": [family.architecture],
            "model_type": family.hf_model_type,
            "activation_type": "silu",
            "block_type": "llama",
            "layer_norm_type": "rms",
            "rope": True,
            "alibi": False,
            "attention_layer_norm": False,
            "include_bias": False,
            "include_qkv_bias": cfg.qkv_bias,
            "d_model": cfg.hidden_size,
            "n_heads": cfg.num_attention_heads,
            "n_kv_heads": cfg.num_key_value_heads,
            "n_layers": cfg.num_hidden_layers,
            "mlp_hidden_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size,
            "embedding_size": cfg.vocab_size,
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta,
            "max_sequence_length": cfg.max_position_embeddings,
            "weight_tying": cfg.tie_word_embeddings,
            "init_std": cfg.initializer_range,
            "use_cache": False,
            "torch_dtype": dtype_name,
            "unmask": {"model_type": cfg.model_type},
        }

    def check(self, cfg) -> None:
        extra = [key for key in ("qk_norm", "attention_bias") if getattr(cfg, key)]
        if extra:  # LLaDA's folders (its key names) have no tensors for them
            raise ValueError(
                f"model_type {cfg.model_type}'s folders (LLaDA's layout) have no q/k norms "
                f"and no o_proj bias: set {extra[0]}: false, or use model_type qwen3_dllm"
            )


def _check_expert_counts(state: State, cfg, folder: Path) -> None:
    """One clear line when config.json's num_experts disagrees with the weights."""
    if cfg is None:
        return
    for layer, count in expert_counts(state).items():
        if count != cfg.num_experts:
            raise InputError(
                f"{str(folder)!r}: config.json says num_experts={cfg.num_experts} but the "
                f"weights of {layer} hold {count} experts; fix config.json or the weights"
            )


class MoeFolderLayout(FolderLayout):
    """transformers' Qwen3-MoE / OLMoE folders: the MoE config keys, one weight matrix per
    expert (stacked in the native model); no shared experts."""

    moe = True

    def fields(self, hf: dict[str, Any], family) -> dict[str, Any]:
        fields = super().fields(hf, family)
        fields.update(hf_moe_fields(hf, hf.get("model_type")))
        fields.update(tagged_moe_fields(hf))
        return fields

    def config(self, cfg, family, dtype_name: str) -> dict[str, Any]:
        out = super().config(cfg, family, dtype_name)
        out.update(hf_moe_config(cfg, family.hf_model_type))
        out["unmask"].update(moe_tag(cfg))
        return out

    def to_native(self, state: State, cfg, folder: Path) -> State:
        state = stack_experts(state)
        _check_expert_counts(state, cfg, folder)
        return state

    def to_folder(self, state: State) -> State:
        return split_experts(state)

    def check(self, cfg) -> None:
        if cfg.num_shared_experts:
            raise ValueError(
                f"model_type {cfg.model_type}'s folders (transformers' Qwen3-MoE / OLMoE) have "
                "no shared experts, so transformers would drop them: use model_type "
                "llada2_moe for shared experts, or num_shared_experts: 0"
            )


class Llada2Layout(FolderLayout):
    """LLaDA2.0's remote-code folders: its own config keys, its fused query/key/value and
    expert names (models/moe_layout.py)."""

    moe = True

    def fields(self, hf: dict[str, Any], family) -> dict[str, Any]:
        try:
            return {**llada2_fields(hf), **tagged_moe_fields(hf)}
        except KeyError as err:
            raise InputError(f"config.json: LLaDA2.0 config is missing {err}") from None

    def config(self, cfg, family, dtype_name: str) -> dict[str, Any]:
        out = llada2_config(cfg, family.architecture, dtype_name)
        out["unmask"] = {"model_type": cfg.model_type, **moe_tag(cfg)}
        return out

    def to_native(self, state: State, cfg, folder: Path) -> State:
        state = stack_experts(llada2_to_native(state, cfg))
        _check_expert_counts(state, cfg, folder)
        return state

    def to_folder(self, state: State) -> State:
        return native_to_llada2(split_experts(state))


class DiffusionGemmaLayout(FolderLayout):
    """transformers' DiffusionGemma folders: the text model's keys under a nested
    `text_config`, the experts stacked as the model holds them (models/
    diffusion_gemma_layout.py; the renames are the family's key map)."""

    moe = True

    def fields(self, hf: dict[str, Any], family) -> dict[str, Any]:
        return diffusion_gemma_fields(hf)

    def config(self, cfg, family, dtype_name: str) -> dict[str, Any]:
        out = diffusion_gemma_config(cfg, family.architecture, dtype_name)
        out["unmask"].update(moe_tag(cfg))
        return out

    def to_native(self, state: State, cfg, folder: Path) -> State:
        return shared_encoder_biases(state)


HF = FolderLayout()
HF_MOE = MoeFolderLayout()
LLADA = LladaLayout()
LLADA2 = Llada2Layout()
DIFFUSION_GEMMA = DiffusionGemmaLayout()
