"""Folder layouts of the MoE families: config.json fields and per-expert weight names.

Native MoE state dicts stack each layer's experts (models/moe.py: `mlp.experts.gate_proj`
(E, I, H), `up_proj`, `down_proj` (E, H, I)). Hugging Face folders of all three families
store one matrix per expert, `mlp.experts.<e>.{gate,up,down}_proj.weight` (transformers 5
fuses them on load and splits them again on save); a folder with transformers' fused
in-memory layout (`mlp.experts.gate_up_proj` (E, 2I, H), `mlp.experts.down_proj`) is read
too. LLaDA2.0 (inclusionAI's remote code, `LLaDA2MoeModelLM`) further names the embedding
`model.word_embeddings`, fuses q/k/v into `attention.query_key_value` ((Hq + 2 Hkv) D, H),
and calls o_proj `attention.dense` and the per-head q/k norms `attention.query_layernorm` /
`key_layernorm`.

config.json: Qwen3-MoE and OLMoE keys are transformers' (`num_experts`,
`num_experts_per_tok`, `moe_intermediate_size` (OLMoE: `intermediate_size` is the expert
width), `norm_topk_prob`, `router_aux_loss_coef`, `mlp_only_layers`, `clip_qkv`); LLaDA2.0's
are its own (`num_experts`, `num_experts_per_tok`, `n_group`, `topk_group`,
`routed_scaling_factor`, `num_shared_experts`, `moe_intermediate_size`,
`first_k_dense_replace`, `partial_rotary_factor`, `use_qkv_bias`, `use_bias`, ...). Every
MoE field of ModelConfig is also written under "unmask": {"moe": {...}}, so options the
upstream layout has no key for (z-loss, bias update rate, kernel) survive a round trip.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from unmask.errors import InputError

MOE_FIELDS = (
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
    "num_shared_experts",
    "first_k_dense_replace", "mlp_only_layers", "router_score", "norm_topk_prob",
    "routed_scaling_factor", "n_group", "topk_group", "router_aux_loss_coef",
    "router_z_loss_coef", "expert_bias_update_rate", "partial_rotary_factor",
    "qk_norm_scope", "clip_qkv", "moe_implementation",
)  # fmt: skip
"""ModelConfig fields written under config.json "unmask": {"moe": ...}."""

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


# --- config.json ---------------------------------------------------------------------------


def hf_moe_fields(hf: dict[str, Any], hf_type: str) -> dict[str, Any]:
    """ModelConfig MoE fields from a Qwen3-MoE or OLMoE config.json (transformers' keys)."""
    if hf.get("decoder_sparse_step", 1) != 1:
        raise InputError(
            f"config.json: decoder_sparse_step {hf['decoder_sparse_step']} is not supported; "
            "need 1 (list dense layers in mlp_only_layers instead)"
        )
    fields = {"num_experts": hf.get("num_experts", hf.get("num_local_experts"))}
    for key in ("num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef", "clip_qkv"):
        if hf.get(key) is not None:
            fields[key] = hf[key]
    if hf_type == "olmoe":  # OLMoE: intermediate_size is the experts' width, every layer MoE
        fields["moe_intermediate_size"] = hf.get("intermediate_size")
    else:
        fields["moe_intermediate_size"] = hf.get("moe_intermediate_size")
        fields["mlp_only_layers"] = list(hf.get("mlp_only_layers") or [])
    return {k: v for k, v in fields.items() if v is not None}


def hf_moe_config(cfg, hf_type: str) -> dict[str, Any]:
    """config.json keys of a Qwen3-MoE or OLMoE folder for cfg."""
    out = {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "norm_topk_prob": cfg.norm_topk_prob,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": False,
    }
    if hf_type == "olmoe":
        out["intermediate_size"] = cfg.resolved_moe_intermediate_size
        out["clip_qkv"] = cfg.clip_qkv
    else:
        out["moe_intermediate_size"] = cfg.resolved_moe_intermediate_size
        out["decoder_sparse_step"] = 1
        out["mlp_only_layers"] = sorted(
            set(cfg.mlp_only_layers) | set(range(cfg.first_k_dense_replace))
        )
    return out


def tagged_moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields unmask wrote under "unmask": {"moe": ...} ({} when absent)."""
    moe = (hf.get("unmask") or {}).get("moe") or {}
    return {k: v for k, v in moe.items() if k in MOE_FIELDS}


def moe_tag(cfg) -> dict[str, Any]:
    return {"moe": {key: getattr(cfg, key) for key in MOE_FIELDS}}


def llada2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields from a LLaDA2.0 config.json (its own key names)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise InputError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported")
    if hf.get("use_qkv_bias") and not hf.get("use_bias"):
        raise InputError("config.json: LLaDA2.0 use_qkv_bias without use_bias is not supported")
    if hf.get("use_bias") and not hf.get("use_qkv_bias"):
        raise InputError(
            "config.json: LLaDA2.0 use_bias=true (a bias on attention.dense only) is not "
            "supported; need use_bias=false"
        )
    if (hf.get("rope_scaling") or {}).get("type", "default") not in ("default", None):
        raise InputError("config.json: LLaDA2.0 rope_scaling is not supported")
    heads = hf["num_attention_heads"]
    fields = {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf.get("intermediate_size") or hf["moe_intermediate_size"],
        "num_hidden_layers": hf["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim"),
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-5),
        "rope_theta": float(hf.get("rope_theta", 10000.0)),
        "max_position_embeddings": hf.get("max_position_embeddings", 16384),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "attention_bias": bool(hf.get("use_bias", False)),
        "qk_norm": True,  # LLaDA2.0's attention always has query/key_layernorm
        "initializer_range": hf.get("initializer_range", 0.02),
        "num_experts": hf.get("num_experts") or 0,
        "num_experts_per_tok": hf.get("num_experts_per_tok", 2),
        "moe_intermediate_size": hf.get("moe_intermediate_size"),
        "num_shared_experts": hf.get("num_shared_experts") or 0,
        "first_k_dense_replace": hf.get("first_k_dense_replace", 0),
        "n_group": hf.get("n_group") or 1,
        "topk_group": hf.get("topk_group") or 1,
        "routed_scaling_factor": hf.get("routed_scaling_factor", 1.0),
        "partial_rotary_factor": hf.get("partial_rotary_factor", 1.0),
        "router_score": "sigmoid",
        "norm_topk_prob": True,
    }
    return {k: v for k, v in fields.items() if v is not None}


def llada2_config(cfg, architecture: str, dtype_name: str) -> dict[str, Any]:
    """A LLaDA2.0 config.json dict for cfg."""
    return {
        "architectures": [architecture],
        "model_type": "llada2_moe",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "use_qkv_bias": cfg.attention_bias,
        "use_bias": cfg.attention_bias,
        "use_qk_norm": True,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.initializer_range,
        "num_experts": cfg.num_experts,
        "num_shared_experts": cfg.num_shared_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "moe_intermediate_size": cfg.resolved_moe_intermediate_size,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "partial_rotary_factor": cfg.partial_rotary_factor,
        "embedding_dropout": 0.0,
        "attention_dropout": 0.0,
        "output_dropout": 0.0,
        "use_cache": False,
        "torch_dtype": dtype_name,
    }


# --- weights -------------------------------------------------------------------------------


def stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert (or transformers-fused) expert matrices -> native (E, ., .) stacks."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for key, value in state.items():
        match = _PER_EXPERT.match(key)
        if match:
            prefix, expert, proj = match.groups()
            groups.setdefault((prefix, proj), {})[int(expert)] = value
        elif key.endswith(".mlp.experts.gate_up_proj"):
            gate, up = value.chunk(2, dim=1)
            prefix = key.removesuffix(".gate_up_proj")
            out[f"{prefix}.gate_proj"], out[f"{prefix}.up_proj"] = gate, up
        else:
            out[key] = value
    for (prefix, proj), experts in groups.items():
        if sorted(experts) != list(range(len(experts))):
            raise InputError(
                f"expert weights {prefix}.<e>.{proj} are not numbered 0..{len(experts) - 1} "
                f"(found {sorted(experts)[:8]}...); the folder is incomplete"
            )
        out[f"{prefix}.{proj}"] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Native (E, ., .) expert stacks -> one matrix per expert (HF folder names)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        head, _, proj = key.rpartition(".")
        if head.endswith(".mlp.experts") and proj in _PROJECTIONS and value.ndim == 3:
            for expert in range(value.shape[0]):
                out[f"{head}.{expert}.{proj}.weight"] = value[expert].contiguous()
        else:
            out[key] = value
    return out


def expert_counts(state: dict[str, torch.Tensor]) -> dict[str, int]:
    """Layer prefix -> experts its weights hold (stacked native names)."""
    return {
        key.removesuffix(".gate_proj"): value.shape[0]
        for key, value in state.items()
        if key.endswith(".mlp.experts.gate_proj") and value.ndim == 3
    }


_LLADA2_RENAMES = (  # native suffix -> LLaDA2.0 suffix (layer keys)
    (".self_attn.o_proj.weight", ".attention.dense.weight"),
    (".self_attn.o_proj.bias", ".attention.dense.bias"),
    (".self_attn.q_norm.weight", ".attention.query_layernorm.weight"),
    (".self_attn.k_norm.weight", ".attention.key_layernorm.weight"),
)


def llada2_to_native(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """LLaDA2.0 folder names -> native names (q/k/v split, renames)."""
    q_rows = cfg.num_attention_heads * cfg.resolved_head_dim
    kv_rows = cfg.num_key_value_heads * cfg.resolved_head_dim
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key == "model.word_embeddings.weight":
            key = "model.embed_tokens.weight"
        if ".attention.query_key_value." in key:
            prefix, leaf = key.split(".attention.query_key_value.")
            if value.shape[0] != q_rows + 2 * kv_rows:
                raise InputError(
                    f"{key} has {value.shape[0]} rows; config.json's heads need "
                    f"{q_rows + 2 * kv_rows}"
                )
            q, k, v = value.split([q_rows, kv_rows, kv_rows])
            for name, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[f"{prefix}.self_attn.{name}.{leaf}"] = part
            continue
        for native, folder in _LLADA2_RENAMES:
            if key.endswith(folder):
                key = key.removesuffix(folder) + native
        out[key] = value
    return out


def native_to_llada2(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Native names -> LLaDA2.0 folder names (q/k/v fused, renames)."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if key == "model.embed_tokens.weight":
            key = "model.word_embeddings.weight"
        match = re.match(r"^(.*)\.self_attn\.(q_proj|k_proj|v_proj)\.(weight|bias)$", key)
        if match:
            prefix, name, leaf = match.groups()
            fused.setdefault(f"{prefix}.attention.query_key_value.{leaf}", {})[name] = value
            continue
        for native, folder in _LLADA2_RENAMES:
            if key.endswith(native):
                key = key.removesuffix(native) + folder
        out[key] = value
    for key, parts in fused.items():
        out[key] = torch.cat([parts["q_proj"], parts["k_proj"], parts["v_proj"]])
    return out
