"""Folder layout of the `diffusion_gemma` family: transformers' `diffusion_gemma` config.json
and weight names (models/diffusion_gemma.py is the model).

Weights. transformers' `DiffusionGemmaForBlockDiffusion` ties the encoder to the decoder:
every weight of the encoder's text model is the decoder's (its layers, final norm and
embedding), and the LM head is the decoder's embedding, so a folder stores the decoder's
copy only (`model.decoder.*`); the per-layer `layer_scalar` buffers and, with
attention_bias, the attention biases are not tied and are stored for both
(`model.encoder.language_model.layers.N.layer_scalar` and `.self_attn.q_proj.bias` ... too). unmask keeps
HF's decoder layout at the top level (`model.layers`, `model.embed_tokens`, `model.norm`:
what FSDP, the planner and models/shape.py read), so the folder names are unmask's names
with `model.` read as `model.decoder.` (`KEY_MAP`); the encoder's scalars are
`model.layers.N.encoder_layer_scalar`, its biases `model.layers.N.self_attn.encoder_q_proj_bias`
(k, v, o likewise). The vision tower (`model.encoder.vision_tower.*`,
`model.encoder.embed_vision.*`: transformers always builds one) is not run by unmask: its
tensors are carried unchanged from the folder read to the folder written (`CARRIED`).

config.json: the text model's keys are under `text_config` (transformers'
`DiffusionGemmaTextConfig`); the full-attention layers' head size and key/value heads are
`global_head_dim` / `num_global_key_value_heads` in Google's configs and a
`per_layer_config` of layer-index overrides in the ones transformers writes (both read);
RoPE is `rope_parameters` per layer type (`default` on sliding layers, `proportional` on
full ones). Fields of ModelConfig that transformers' config has no key for are written under
"unmask" as for every family.
"""

from __future__ import annotations

from typing import Any

from unmask.errors import InputError

HF_TEXT_TYPE = "diffusion_gemma_text"
SLIDING, FULL = "sliding_attention", "full_attention"
GLOBAL_HEAD_DIM = 512
"""transformers' default head size of the full-attention layers (its `global_head_dim`)."""
ACTIVATION = "gelu_pytorch_tanh"

LAYER_KEYS = (
    "layer_scalar",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "pre_feedforward_layernorm.weight",
    "post_feedforward_layernorm.weight",
    "pre_feedforward_layernorm_2.weight",
    "post_feedforward_layernorm_1.weight",
    "post_feedforward_layernorm_2.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.bias",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "router.proj.weight",
    "router.scale",
    "router.per_expert_scale",
    "experts.gate_up_proj",
    "experts.down_proj",
)
"""A layer's state-dict names, relative to the layer (full-attention layers have no
v_proj; biases only with attention_bias), the same in unmask and in the folders."""

ENCODER_BIASES = ("q_proj", "k_proj", "v_proj", "o_proj")
"""Projections whose bias the encoder holds apart from the decoder's (with attention_bias):
transformers ties the encoder's weights to the decoder's, never its biases, so a folder
stores both; unmask names the encoder's `model.layers.N.self_attn.encoder_<proj>_bias`."""

KEY_MAP = {
    "model.embed_tokens.weight": "model.decoder.embed_tokens.weight",
    "model.norm.weight": "model.decoder.norm.weight",
    "model.self_conditioning.pre_norm.weight": "model.decoder.self_conditioning.pre_norm.weight",
    "model.self_conditioning.gate_proj.weight": "model.decoder.self_conditioning.gate_proj.weight",
    "model.self_conditioning.up_proj.weight": "model.decoder.self_conditioning.up_proj.weight",
    "model.self_conditioning.down_proj.weight": "model.decoder.self_conditioning.down_proj.weight",
    "model.layers.N.encoder_layer_scalar": "model.encoder.language_model.layers.N.layer_scalar",
    **{f"model.layers.N.{key}": f"model.decoder.layers.N.{key}" for key in LAYER_KEYS},
    **{f"model.layers.N.self_attn.encoder_{proj}_bias":
       f"model.encoder.language_model.layers.N.self_attn.{proj}.bias" for proj in ENCODER_BIASES},
}  # fmt: skip
"""unmask state-dict key -> folder key (N = layer index); `lm_head.weight` is the tied
embedding and not stored."""

LORA_TOWER, LORA_PROJECTOR = "vision_tower", "embed_vision"
"""The vision tower's and the projector's module names under `model.encoder`: the
`lora_target_modules` entries that adapt the tower's layers' linear maps and the
projector's (models/lora.py)."""

TOWER, PROJECTOR = f"model.encoder.{LORA_TOWER}.", f"model.encoder.{LORA_PROJECTOR}."
"""Folder prefixes of the tower's and the projector's tensors."""

CARRIED = (TOWER, PROJECTOR)
"""Folder keys of the vision tower and projector: while the tower is frozen and held apart
(the default) carried from the folder read to the folder written; a trained or LoRA-adapted
tower is registered and its keys are in the state dict (models/diffusion_gemma_vision.py)."""

IMAGE_TOKEN_KEYS = ("image_token_id", "boi_token_id", "eoi_token_id")
"""config.json keys of a DiffusionGemma folder's image, begin-of-image and end-of-image
token ids."""

VISION_SOURCE_KEYS = ("vision_config", *IMAGE_TOKEN_KEYS, "image_token_index",
                      "mm_tokens_per_image")  # fmt: skip
"""config.json keys of a DiffusionGemma folder that describe its tower (a checkpoint's
config.json keeps them)."""

VISION_KEYS = (VISION_SOURCE_KEYS[0], LORA_TOWER, *IMAGE_TOKEN_KEYS, "pixel_values", "images")
"""Keys of a `model.diffusion_gemma` section that ask for images (refused: text only; the
message names the first one given, in this order)."""


def default_layer_types(layers: int) -> list[str]:
    """transformers' default pattern: five sliding-window layers, then one full-attention
    layer, repeated; the last layer is always a full-attention one."""
    types = [SLIDING if (i + 1) % 6 else FULL for i in range(layers)]
    types[-1] = FULL
    return types


def shared_encoder_biases(state: dict) -> dict:
    """A folder's (native-named) state with each attention bias the encoder lacks taken from
    the decoder: what folders unmask wrote before it kept the encoder's own meant (one
    stack, biases included); a transformers folder stores them all."""
    out = dict(state)
    for key, value in state.items():
        head, _, leaf = key.rpartition(".")
        layer, _, proj = head.rpartition(".")
        if leaf == "bias" and layer.endswith(".self_attn") and proj in ENCODER_BIASES:
            out.setdefault(f"{layer}.encoder_{proj}_bias", value)
    return out


# --- config.json -> ModelConfig fields -----------------------------------------------------


def _refuse(key: str, value: Any, need: str) -> None:
    raise InputError(f"config.json: text_config.{key}={value!r} is not supported; need {need}")


def _rope(params: dict[str, Any], layer_type: str) -> tuple[float, float]:
    """(theta, partial rotary factor) of one layer type's RoPE parameters."""
    rope_type = params.get("rope_type", "default")
    factor = params.get("partial_rotary_factor", 1.0)
    if rope_type not in ("default", "proportional"):
        _refuse(f"rope_parameters.{layer_type}.rope_type", rope_type, "default or proportional")
    if rope_type == "default" and factor != 1.0:  # transformers' default RoPE rotates whole heads
        _refuse(f"rope_parameters.{layer_type}.partial_rotary_factor", factor,
                "1.0 with rope_type default (or rope_type proportional)")  # fmt: skip
    if params.get("factor", 1.0) != 1.0:
        _refuse(f"rope_parameters.{layer_type}.factor", params["factor"], "1.0")
    if "rope_theta" not in params:
        raise InputError(f"config.json: text_config.rope_parameters.{layer_type} has no rope_theta")
    return float(params["rope_theta"]), float(factor)


def _full_layer_shape(text: dict[str, Any], types: list[str]) -> tuple[int, int | None]:
    """(head_dim, key/value heads or None = num_key_value_heads) of the full-attention
    layers, from Google's keys or transformers' per_layer_config."""
    overrides = text.get("per_layer_config")
    if overrides is None:
        return int(text.get("global_head_dim", GLOBAL_HEAD_DIM)), text.get(
            "num_global_key_value_heads"
        )
    seen: dict[str, set] = {SLIDING: set(), FULL: set()}
    for index, layer_type in enumerate(types):
        extra = dict(overrides.get(str(index), overrides.get(index, {})))
        unknown = sorted(set(extra) - {"head_dim", "num_key_value_heads"})
        if unknown:
            _refuse(f"per_layer_config.{index}", extra, "head_dim / num_key_value_heads only")
        seen[layer_type].add((extra.get("head_dim"), extra.get("num_key_value_heads")))
    if seen[SLIDING] - {(None, None)}:
        _refuse("per_layer_config", overrides, "overrides of the full-attention layers only")
    if len(seen[FULL]) > 1:
        _refuse("per_layer_config", overrides, "the same overrides on every full-attention layer")
    head_dim, kv_heads = next(iter(seen[FULL]), (None, None))
    return int(head_dim or text.get("head_dim")), kv_heads


def diffusion_gemma_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields (and its `diffusion_gemma` section) from a `diffusion_gemma`
    config.json; one InputError line for what unmask's text model cannot run."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise InputError("config.json: text_config is missing (a diffusion_gemma config "
                         "holds the text model's keys under text_config)")  # fmt: skip
    for where, tied in (("", hf.get("tie_word_embeddings", True)),
                        ("text_config.", text.get("tie_word_embeddings", True))):  # fmt: skip
        if not tied:
            raise InputError(
                f"config.json: {where}tie_word_embeddings=false (an encoder and a decoder with "
                "weights of their own) is not supported yet; need true"
            )
    if text.get("hidden_activation", ACTIVATION) != ACTIVATION:
        _refuse("hidden_activation", text["hidden_activation"], ACTIVATION)
    if text.get("use_bidirectional_attention") not in (None, "vision"):
        _refuse("use_bidirectional_attention", text["use_bidirectional_attention"],
                "null or vision (a causal prompt encoder; vision's bidirectional image "
                "blocks never occur in text)")  # fmt: skip
    if not text.get("num_experts") or not text.get("top_k_experts"):
        raise InputError("config.json: text_config.num_experts / top_k_experts are missing "
                         "(every DiffusionGemma layer has a mixture of experts)")  # fmt: skip
    try:
        layers = int(text["num_hidden_layers"])
        types = list(text.get("layer_types") or default_layer_types(layers))
        types[-1] = FULL  # transformers forces it
        rope = text.get("rope_parameters") or {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                   "rope_theta": 1_000_000.0},
        }  # fmt: skip
        theta, factor = _rope(rope.get(SLIDING, {"rope_theta": 10_000.0}), SLIDING)
        if factor != 1.0:  # unmask's sliding layers rotate whole heads
            _refuse(f"rope_parameters.{SLIDING}.partial_rotary_factor", factor, "1.0")
        global_theta, global_factor = _rope(rope[FULL], FULL)
        global_head_dim, global_kv = _full_layer_shape(text, types)
        fields = {
            "vocab_size": text["vocab_size"],
            "hidden_size": text["hidden_size"],
            "intermediate_size": text["intermediate_size"],
            "num_hidden_layers": layers,
            "num_attention_heads": text["num_attention_heads"],
            "num_key_value_heads": text["num_key_value_heads"],
            "head_dim": text["head_dim"],
            "rms_norm_eps": text.get("rms_norm_eps", 1e-6),
            "rope_theta": theta,
            "max_position_embeddings": text.get("max_position_embeddings", 131_072),
            "tie_word_embeddings": True,
            "attention_bias": bool(text.get("attention_bias", False)),
            "initializer_range": hf.get("initializer_range", text.get("initializer_range", 0.02)),
            "num_experts": text["num_experts"],
            "num_experts_per_tok": text["top_k_experts"],
            "moe_intermediate_size": text.get("moe_intermediate_size"),
            "norm_topk_prob": True,
            "diffusion_gemma": {
                "layer_types": types,
                "sliding_window": text.get("sliding_window", 512),
                "global_head_dim": global_head_dim,
                "num_global_key_value_heads": global_kv,
                "global_rope_theta": global_theta,
                "global_partial_rotary_factor": global_factor,
                "final_logit_softcapping": text.get("final_logit_softcapping", 30.0),
                "canvas_length": hf.get("canvas_length", 256),
            },
        }
    except KeyError as err:
        raise InputError(f"config.json: text_config is missing {err}") from None
    tagged = (hf.get("unmask") or {}).get("model") or {}
    return {**fields, **tagged}


# --- ModelConfig -> config.json ------------------------------------------------------------

_UNMASK_ONLY = ("moe_implementation",)
"""ModelConfig fields transformers' config has no key for (kept under "unmask")."""


def diffusion_gemma_config(cfg, architecture: str, dtype_name: str) -> dict[str, Any]:
    """A `diffusion_gemma` config.json dict that transformers loads as it is (it builds a
    vision tower of its default size, untrained: unmask's model is text only)."""
    section = cfg.diffusion_gemma
    types = section.resolved_layer_types(cfg.num_hidden_layers)
    rope = {
        SLIDING: {"rope_type": "default", "rope_theta": cfg.rope_theta},
        FULL: {"rope_type": "proportional", "rope_theta": section.global_rope_theta,
               "partial_rotary_factor": section.global_partial_rotary_factor},
    }  # fmt: skip
    text = {
        "model_type": HF_TEXT_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.resolved_head_dim,
        "global_head_dim": section.resolved_global_head_dim(cfg),
        "num_global_key_value_heads": section.num_global_key_value_heads,
        "hidden_activation": ACTIVATION,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "tie_word_embeddings": True,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "sliding_window": section.sliding_window,
        "layer_types": types,
        "final_logit_softcapping": section.final_logit_softcapping,
        "use_bidirectional_attention": None,
        "num_experts": cfg.num_experts,
        "top_k_experts": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.resolved_moe_intermediate_size,
    }
    return {
        "architectures": [architecture],
        "model_type": "diffusion_gemma",
        "text_config": text,
        "canvas_length": section.canvas_length,
        "tie_word_embeddings": True,
        "initializer_range": cfg.initializer_range,
        "dtype": dtype_name,
        "unmask": {"model_type": cfg.model_type,
                   "model": {key: getattr(cfg, key) for key in _UNMASK_ONLY}},
    }  # fmt: skip
