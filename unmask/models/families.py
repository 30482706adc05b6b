"""Model families: which architecture switches each name implies, and HF key layouts.

Native families all run `DiffusionTransformer` (one bidirectional decoder); they differ in
config switches and in how a Hugging Face folder names things:

| family (model_type) | HF model_type | q/k norm | q/k/v bias | key layout |
| --- | --- | --- | --- | --- |
| qwen3_dllm | qwen3 | yes | no | HF (model.layers.N.self_attn.q_proj ...) |
| qwen2_dllm | qwen2 | no | yes | HF |
| dream | Dream (DreamModel) | no | yes | HF (Qwen2 names) |
| llama_dllm | llama | no | attention_bias | HF |
| llada | llada (LLaDAModelLM) | no | include_qkv_bias | LLaDA (`LLADA_KEY_MAP`) |

Encoder families (`bert`, `modernbert`) run transformers' own masked-LM classes
(models/hf_wrapped.py). AR checkpoints converted to diffusion (A2D) keep their weights and
simply run with full (bidirectional) attention.
"""

import re

NATIVE_DEFAULTS: dict[str, dict] = {
    "qwen3_dllm": {},
    "qwen2_dllm": {"qk_norm": False, "qkv_bias": True},
    "dream": {"qk_norm": False, "qkv_bias": True},
    "llama_dllm": {"qk_norm": False},
    "llada": {"qk_norm": False},
}
ENCODER_FAMILIES = ("bert", "modernbert")

# Native (HF Llama-style) key -> LLaDA key; N is the layer index.
LLADA_KEY_MAP = {
    "model.embed_tokens.weight": "model.transformer.wte.weight",
    "model.norm.weight": "model.transformer.ln_f.weight",
    "lm_head.weight": "model.transformer.ff_out.weight",
    "model.layers.N.input_layernorm.weight": "model.transformer.blocks.N.attn_norm.weight",
    "model.layers.N.self_attn.q_proj.weight": "model.transformer.blocks.N.q_proj.weight",
    "model.layers.N.self_attn.k_proj.weight": "model.transformer.blocks.N.k_proj.weight",
    "model.layers.N.self_attn.v_proj.weight": "model.transformer.blocks.N.v_proj.weight",
    "model.layers.N.self_attn.q_proj.bias": "model.transformer.blocks.N.q_proj.bias",
    "model.layers.N.self_attn.k_proj.bias": "model.transformer.blocks.N.k_proj.bias",
    "model.layers.N.self_attn.v_proj.bias": "model.transformer.blocks.N.v_proj.bias",
    "model.layers.N.self_attn.o_proj.weight": "model.transformer.blocks.N.attn_out.weight",
    "model.layers.N.post_attention_layernorm.weight": "model.transformer.blocks.N.ff_norm.weight",
    "model.layers.N.mlp.gate_proj.weight": "model.transformer.blocks.N.ff_proj.weight",
    "model.layers.N.mlp.up_proj.weight": "model.transformer.blocks.N.up_proj.weight",
    "model.layers.N.mlp.down_proj.weight": "model.transformer.blocks.N.ff_out.weight",
}


def _compile(mapping: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    out = []
    for src, dst in mapping.items():
        pattern = re.escape(src).replace(r"\.N\.", r"\.(\d+)\.")
        out.append((re.compile(f"^{pattern}$"), dst.replace(".N.", r".\1.")))
    return out


_TO_LLADA = _compile(LLADA_KEY_MAP)
_FROM_LLADA = _compile({v: k for k, v in LLADA_KEY_MAP.items()})


def _rename(key: str, rules: list[tuple[re.Pattern, str]]) -> str:
    for pattern, repl in rules:
        if pattern.match(key):
            return pattern.sub(repl, key)
    raise KeyError(key)


def to_llada_keys(state: dict) -> dict:
    """Native state dict -> LLaDA key names (unknown keys raise KeyError)."""
    return {_rename(k, _TO_LLADA): v for k, v in state.items()}


def from_llada_keys(state: dict) -> dict:
    """LLaDA state dict -> native key names; keys outside the map are kept (reported later)."""
    out = {}
    for key, value in state.items():
        try:
            out[_rename(key, _FROM_LLADA)] = value
        except KeyError:
            out[key] = value
    return out
