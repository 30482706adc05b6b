"""Hugging Face folders <-> the native model: config.json mapping and safetensors weights.

Native parameter names equal HF Qwen3/Qwen2/Llama/Dream keys, so those load as a plain state
dict; LLaDA folders are renamed through `families.LLADA_KEY_MAP`. Only local folders are read
(no hub, no remote code); weights come from safetensors only. A loaded folder's config.json is
kept on the model (`hf_source_config`) and written back on save, so a Dream or LLaDA folder
round-trips with its own fields (mask_token_id, auto_map, ...).
"""

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from unmask.errors import InputError
from unmask.models.config import ModelConfig
from unmask.models.families import from_llada_keys, to_llada_keys
from unmask.models.transformer import DiffusionTransformer

# config.json model_type -> unmask family
HF_FAMILIES = {
    "qwen3": "qwen3_dllm",
    "qwen3_dllm": "qwen3_dllm",
    "qwen2": "qwen2_dllm",
    "llama": "llama_dllm",
    "Dream": "dream",
    "dream": "dream",
    "llada": "llada",
}
HF_MODEL_TYPES = tuple(HF_FAMILIES)
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
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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


def _llada_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """LLaDA's OLMo-style config names -> the HF names the rest of this module reads."""
    checks = {
        "block_type": "llama",
        "activation_type": "silu",
        "layer_norm_type": "rms",
        "rope": True,
        "alibi": False,
        "attention_layer_norm": False,
        "include_bias": False,
    }
    for key, want in checks.items():
        if key in hf and hf[key] != want:
            raise InputError(
                f"config.json: LLaDA {key}={hf[key]!r} is not supported; need {want!r}"
            )
    n_heads = hf["n_heads"]
    return {
        "vocab_size": hf.get("embedding_size") or hf["vocab_size"],
        "hidden_size": hf["d_model"],
        "intermediate_size": hf.get("mlp_hidden_size") or hf.get("mlp_ratio", 4) * hf["d_model"],
        "num_hidden_layers": hf["n_layers"],
        "num_attention_heads": n_heads,
        "num_key_value_heads": hf.get("n_kv_heads") or n_heads,
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-5),
        "rope_theta": hf.get("rope_theta", 10000.0),
        "max_position_embeddings": hf.get("max_sequence_length", 4096),
        "tie_word_embeddings": bool(hf.get("weight_tying", False)),
        "qkv_bias": bool(hf.get("include_qkv_bias", False)),
        "initializer_range": hf.get("init_std", 0.02),
    }


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a config.json dict: Qwen3, Qwen2, Llama, Dream, LLaDA or unmask's."""
    model_type = hf.get("model_type")
    if model_type not in HF_FAMILIES:
        raise InputError(
            f"config.json: model_type {model_type!r} is not supported; expected one of "
            f"{', '.join(HF_MODEL_TYPES)} (or a folder saved by unmask)"
        )
    family = (hf.get("unmask") or {}).get("model_type") or HF_FAMILIES[model_type]
    if family == "llada":
        try:
            return ModelConfig(model_type="llada", **_llada_fields(hf))
        except (KeyError, ValueError) as err:
            raise InputError(f"config.json: LLaDA config is missing or has bad {err}") from err
    if hf.get("mlp_bias"):
        raise InputError("config.json: mlp_bias=true is not supported; need false")
    if hf.get("hidden_act", "silu") != "silu":
        raise InputError(
            f"config.json: hidden_act {hf['hidden_act']!r} is not supported; need silu"
        )
    if hf.get("use_sliding_window"):
        raise InputError("config.json: use_sliding_window=true is not supported; set it to false")
    fields = {key: hf[key] for key in HF_DIRECT_KEYS if hf.get(key) is not None}
    theta = _rope_theta(hf)
    if theta is not None:
        fields["rope_theta"] = float(theta)
    if family == "llama_dllm" and "rope_theta" not in fields:
        fields["rope_theta"] = 10000.0  # transformers' Llama default
    try:
        return ModelConfig(model_type=family, **fields)
    except ValueError as err:
        raise InputError(f"config.json: {err}") from err


_FAMILY_HF = {  # family -> (config.json model_type, architecture)
    "qwen3_dllm": ("qwen3", "Qwen3ForCausalLM"),
    "qwen2_dllm": ("qwen2", "Qwen2ForCausalLM"),
    "llama_dllm": ("llama", "LlamaForCausalLM"),
    "dream": ("Dream", "DreamModel"),
}


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A config.json dict for cfg in its family's layout (Qwen3/Qwen2/Llama load in
    transformers as they are; Dream and LLaDA in their own remote-code layouts)."""
    dtype_name = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    if cfg.model_type == "llada":
        return _llada_config_dict(cfg, dtype_name)
    model_type, arch = _FAMILY_HF.get(cfg.model_type, _FAMILY_HF["qwen3_dllm"])
    out = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
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
    out["model_type"], out["architectures"] = model_type, [arch]
    if cfg.model_type != "qwen3_dllm":  # no q/k norm; bias switches by family
        out["attention_bias"] = cfg.attention_bias
        if cfg.model_type in ("qwen2_dllm", "dream"):
            out.pop("attention_bias")
            out.pop("head_dim")
        if cfg.model_type == "llama_dllm":
            out["mlp_bias"] = False
    return out


def _llada_config_dict(cfg: ModelConfig, dtype_name: str) -> dict[str, Any]:
    return {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
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
        "unmask": {"model_type": "llada"},
    }


def _read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise InputError(
            f"model folder {str(folder)!r} does not exist; set model.pretrained to a local "
            "folder holding config.json and model.safetensors"
        )
    path = folder / "config.json"
    if not path.is_file():
        raise InputError(
            f"{str(path)!r} is missing; model.pretrained must be a Hugging Face model folder "
            "with config.json and model.safetensors"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise InputError(f"{str(path)!r} is not valid JSON ({err}); fix or re-export it") from err


def _weight_files(folder: Path) -> list[Path]:
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing or not files:
            raise InputError(
                f"{str(index)!r} names missing shard files {missing}; copy the whole folder"
            )
        return files
    raise InputError(
        f"no weights in {str(folder)!r}: expected model.safetensors or "
        "model.safetensors.index.json (convert .bin weights to safetensors first)"
    )


def _read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        state.update(load_file(str(path)))
    if any(key.startswith("model.transformer.") for key in state):  # LLaDA layout
        state = from_llada_keys(state)
    if not any(key.startswith("model.") for key in state):  # a bare Qwen3Model checkpoint
        state = {(k if k == "lm_head.weight" else f"model.{k}"): v for k, v in state.items()}
    return {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}


def _load_weights(model: DiffusionTransformer, state: dict[str, torch.Tensor], folder: Path):
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        if "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise InputError(
            f"weights in {str(folder)!r} do not match config.json: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]} (is it a Qwen3 checkpoint with this config?)"
        )
    model.load_state_dict(state, strict=True)


def folder_mask_token_id(folder: str | Path) -> int | None:
    """`mask_token_id` from a model folder's config.json (LLaDA and Dream folders carry it),
    or None when the folder has no config.json or the key."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text()).get("mask_token_id")
    except json.JSONDecodeError:
        return None  # the model loader reports the broken file
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{str(path)!r}: mask_token_id {value!r} is not an integer token id")
    return value


def from_pretrained(
    folder: str | Path, dtype: torch.dtype | None = None, attn_implementation: str = "auto"
) -> DiffusionTransformer:
    """Load a local HF Qwen3 folder or an unmask-saved one.

    dtype: parameter dtype; None keeps float32 (training master weights).
    """
    folder = Path(folder)
    source = _read_config(folder)
    cfg = config_from_hf(source)
    cfg = cfg.model_copy(update={"attn_implementation": attn_implementation})
    state = _read_state_dict(folder)
    with torch.device("meta"):
        model = DiffusionTransformer(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    model = model.to(dtype or torch.float32)
    _load_weights(model, state, folder)
    model.hf_source_config = source
    return model


def save_pretrained(model: DiffusionTransformer, folder: str | Path) -> None:
    """Write config.json and model.safetensors (tied: embed_tokens only, like HF)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if model.config.model_type == "llada":
        state = to_llada_keys(state)
    dtype = next(model.parameters()).dtype
    config = hf_config_dict(model.config, dtype)
    source = getattr(model, "hf_source_config", None)
    if source is not None and config_from_hf(source) == _plain(model.config):
        # unchanged architecture: keep the folder's own config.json; Dream/LLaDA configs
        # (remote-code layouts) stay byte for byte, transformers-native ones get the tag
        config = dict(source)
        if model.config.model_type not in ("dream", "llada"):
            config["unmask"] = {"model_type": model.config.model_type}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _plain(cfg: ModelConfig) -> ModelConfig:
    return cfg.model_copy(update={"attn_implementation": "auto", "pretrained": None})
