"""Model families: the one registry of what each `model.model_type` means.

Every family is one frozen `Family` entry in `FAMILIES`; nothing else in unmask spells out a
family's names, switches or folder layout. Native families all run `DiffusionTransformer`
(one bidirectional decoder) and differ in config switches and in how a Hugging Face folder
names things; encoder families run transformers' own masked-LM classes (models/hf_wrapped.py).

| family (model_type) | config.json model_type | q/k norm | q/k/v bias | keys | mask id |
| --- | --- | --- | --- | --- | --- |
| qwen3_dllm | qwen3 | yes | no | HF | - |
| qwen2_dllm | qwen2 | no | yes | HF | - |
| llama_dllm | llama | no | attention_bias | HF | - |
| dream | Dream (DreamModel, remote code) | no | yes | HF (Qwen2) | 151666 |
| llada | llada (LLaDAModelLM, remote code) | no | include_qkv_bias | `LLADA_KEY_MAP` | 126336 |
| qwen3_moe_dllm | qwen3_moe | yes | no | HF, experts per expert | - |
| llada_moe | olmoe, llada_moe | over the projection | no | HF (OLMoE), experts per expert | - |
| llada2_moe | llada2_moe (LLaDA2MoeModelLM, remote code) | yes | use_qkv_bias | LLaDA2.0 | 156895 |
| diffusion_gemma | diffusion_gemma (DiffusionGemmaForBlockDiffusion) | yes | attention_bias | decoder's, `DIFFUSION_GEMMA_KEY_MAP` | - |
| bert, modernbert | bert, modernbert (transformers encoders) | | | HF | - |

MoE families (a `layout` whose `moe` is set) run the same decoder with mixture-of-experts
MLPs (models/moe.py); their folders' keys are in models/moe_layout.py. Each family's folder
(config.json in and out, weights in and out) is its `layout` (models/layouts.py).

`diffusion_gemma` (Google's DiffusionGemma, models/diffusion_gemma.py) has blocks of its own:
a prompt encoder and a canvas decoder sharing one Gemma 4 stack (sliding and full attention
layers, a dense MLP beside a mixture of experts in every layer), its own `ModelShape`, builder
(models/build.py) and fields (`section`: ModelConfig's `diffusion_gemma`); its folder layout
is in models/diffusion_gemma_layout.py.

AR checkpoints converted to diffusion (A2D) keep their weights and simply run with full
(bidirectional) attention. Dream was trained to predict position i from the output at i - 1,
so it samples with the logit shift (`samples_with_logit_shift`).

To add a family: append one `Family(...)` to `_ENTRIES` below. Name it (that name becomes a
valid `model.model_type`), list the config.json `model_type` values it loads from (the first
is the one it writes) and its architecture, and set only the fields that differ from the
defaults: `config_defaults` for the ModelConfig switches it implies, `key_map` if its folders
name weights differently from HF Llama, `layout` if its config.json or weights are not HF
Llama-style (a `FolderLayout` subclass, models/layouts.py, defined where the family is),
`hf_absent_keys` / `hf_extra` for keys its transformers config lacks or adds,
`keeps_source_config`,
`mask_token_id` and `logit_shift` for remote-code releases. Then add a round-trip case to
tests/unit/test_families.py; ModelConfig, the builder, loading and saving read the rest from
here. A family with blocks of its own also declares them (`shape`, models/shape.py) and is
added with models/build.py `register_family(family, builder)`, from outside the package too.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from unmask.models import layouts
from unmask.models.diffusion_gemma_layout import CARRIED as DIFFUSION_GEMMA_CARRIED
from unmask.models.diffusion_gemma_layout import KEY_MAP as DIFFUSION_GEMMA_KEY_MAP
from unmask.models.layouts import FolderLayout
from unmask.models.shape import DECODER, DIFFUSION_GEMMA, WRAPPED, ModelShape

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


@dataclass(frozen=True)
class Family:
    """Everything unmask knows about one model family (see the module docstring)."""

    name: str
    """The `model.model_type` users write."""
    kind: Literal["native", "encoder"]
    """native: unmask's bidirectional decoder; encoder: a transformers masked-LM class."""
    hf_model_types: tuple[str, ...]
    """config.json `model_type` values that load as this family; the first is written."""
    architecture: str
    """config.json `architectures[0]` written (for encoders: the transformers class built)."""
    config_defaults: Mapping[str, Any] = field(default_factory=dict)
    """ModelConfig fields this family implies unless the config sets them."""
    key_map: Mapping[str, str] = field(default_factory=dict)
    """Native state-dict key -> the key in this family's folders (N = layer index);
    empty = HF Llama names, which are the native names."""
    layout: FolderLayout = layouts.HF
    """How its folders hold a model (models/layouts.py): config.json keys in and out, the
    weights' layout after the key map (experts per matrix or stacked, fused tensors), the
    configs its folders cannot hold, and whether it is an MoE family (`layout.moe`).
    Default: HF Llama / Qwen, dense."""
    hf_absent_keys: tuple[str, ...] = ()
    """HF-style keys this family's transformers config lacks (not written)."""
    hf_extra: Mapping[str, Any] = field(default_factory=dict)
    """Extra config keys written for this family (for encoders: transformers config kwargs)."""
    hf_rope_theta_default: float | None = None
    """rope_theta for a config.json that names none (the family's own default);
    None = ModelConfig's default."""
    encoder_rope_key: str | None = None
    """Encoders: the transformers config kwarg that takes ModelConfig.rope_theta (None: not
    passed). Native families always write `rope_theta`."""
    keeps_source_config: bool = False
    """Folders carry a remote-code config.json, written back byte for byte on save when the
    architecture is unchanged (no "unmask" tag is added to it)."""
    mask_token_id: int | None = None
    """Mask token id of the family's released checkpoints (used when a folder in the
    released layout names none)."""
    logit_shift: bool = False
    """Position i is predicted from the output at i - 1 (Dream); sampled with the shift."""
    shape: ModelShape | None = None
    """The declaration of its blocks that parallelism, the planner and the FLOP count read
    (models/shape.py); None = the native decoder's (`DECODER`), or for encoders `WRAPPED`."""
    section: str = ""
    """The ModelConfig field holding this family's own fields (a sub-section: filled with
    its defaults for this family, refused for the others); "" = none."""
    carried: tuple[str, ...] = ()
    """Folder key prefixes of tensors unmask does not run (DiffusionGemma's vision tower):
    kept from the folder read (`model.hf_carried_weights`) and written back on save."""
    decoding: Mapping[str, Any] = field(default_factory=dict)
    """How the family's authors decode its released checkpoints: sampling options
    (SamplingConfig fields) that a folder in the family's released layout (config.json
    without unmask's tag) samples with when neither its generation_config.json nor the
    user sets them (sampling/config.py `saved_sampling`; docs/sampling.md, Decoding a
    released model)."""

    def __post_init__(self) -> None:
        for name in ("config_defaults", "key_map", "hf_extra", "decoding"):  # read-only views
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        if self.shape is None:
            object.__setattr__(self, "shape", DECODER if self.native else WRAPPED)

    @property
    def native(self) -> bool:
        return self.kind == "native"

    @property
    def moe(self) -> bool:
        """Its folders hold mixture-of-experts layers (its layout says)."""
        return self.layout.moe

    @property
    def hf_model_type(self) -> str:
        """The config.json `model_type` this family writes."""
        return self.hf_model_types[0]


_ENTRIES = (
    Family("qwen3_dllm", "native", ("qwen3", "qwen3_dllm"), "Qwen3ForCausalLM"),
    Family(
        "qwen2_dllm",
        "native",
        ("qwen2",),
        "Qwen2ForCausalLM",
        config_defaults={"qk_norm": False, "qkv_bias": True},
        hf_absent_keys=("attention_bias", "head_dim"),
    ),
    Family(
        "llama_dllm",
        "native",
        ("llama",),
        "LlamaForCausalLM",
        config_defaults={"qk_norm": False},
        hf_extra={"mlp_bias": False},
        hf_rope_theta_default=10000.0,  # transformers' Llama default
    ),
    Family(
        "dream",
        "native",
        ("Dream", "dream"),
        "DreamModel",
        config_defaults={"qk_norm": False, "qkv_bias": True},
        hf_absent_keys=("attention_bias", "head_dim"),
        keeps_source_config=True,
        mask_token_id=151666,
        logit_shift=True,
        # Dream's `diffusion_generate` (DreamGenerationConfig's defaults: alg origin, eps
        # 1e-3, temperature 0); its steps default (512) is not taken: steps = gen_length
        decoding={"schedule": "dream", "remasking": "origin"},
    ),
    Family(
        "llada",
        "native",
        ("llada",),
        "LLaDAModelLM",
        config_defaults={"qk_norm": False},
        key_map=LLADA_KEY_MAP,
        layout=layouts.LLADA,
        hf_rope_theta_default=10000.0,  # LLaDA / OLMo default
        keeps_source_config=True,
        mask_token_id=126336,
        # LLaDA's generate.py `generate` at its defaults (low_confidence, temperature 0)
        decoding={"gen_length": 128, "block_length": 128, "steps": 128},
    ),
    Family(
        "qwen3_moe_dllm",
        "native",
        ("qwen3_moe",),
        "Qwen3MoeForCausalLM",
        config_defaults={"num_experts": 8, "num_experts_per_tok": 2},
        layout=layouts.HF_MOE,
    ),
    Family(
        "llada_moe",
        "native",
        ("olmoe", "llada_moe"),
        "OlmoeForCausalLM",
        config_defaults={
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "qk_norm_scope": "projection",
            "rms_norm_eps": 1e-5,
        },  # fmt: skip
        layout=layouts.HF_MOE,
        hf_absent_keys=("head_dim", "layer_types", "use_sliding_window", "sliding_window"),
        hf_rope_theta_default=10000.0,  # transformers' OLMoE default
    ),
    Family(
        "llada2_moe",
        "native",
        ("llada2_moe",),
        "LLaDA2MoeModelLM",
        config_defaults={
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "router_score": "sigmoid",
            "norm_topk_prob": True,
            "partial_rotary_factor": 0.5,
            "num_shared_experts": 1,
        },  # fmt: skip
        layout=layouts.LLADA2,
        keeps_source_config=True,
        mask_token_id=156895,
        # LLaDA2.0's own `generate` (modeling_llada2_moe.py) at its defaults
        decoding={
            "block_length": 32,
            "block_origin": "request",
            "block_causal": True,
            "gen_length": 2048,
            "block_steps": 32,
            "threshold": 0.95,
            "fill_rule": "llada2",
            "growing_canvas": True,
        },
    ),
    Family(
        "diffusion_gemma",
        "native",
        ("diffusion_gemma",),
        "DiffusionGemmaForBlockDiffusion",
        config_defaults={
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
        },  # fmt: skip
        key_map=DIFFUSION_GEMMA_KEY_MAP,
        layout=layouts.DIFFUSION_GEMMA,
        shape=DIFFUSION_GEMMA,
        section="diffusion_gemma",
        carried=DIFFUSION_GEMMA_CARRIED,
    ),
    Family("bert", "encoder", ("bert",), "BertForMaskedLM"),
    Family(
        "modernbert",
        "encoder",
        ("modernbert",),
        "ModernBertForMaskedLM",
        hf_extra={"bos_token_id": 1, "eos_token_id": 1, "cls_token_id": 1, "sep_token_id": 1},
        encoder_rope_key="global_rope_theta",
    ),
)

FAMILIES: dict[str, Family] = {}
"""family name (`model.model_type`) -> Family, in the order the docs list them (then the
families added with models/build.py `register_family`)."""
DEFAULT_FAMILY = "qwen3_dllm"
_BY_HF_TYPE: dict[str, Family] = {}


def family_names() -> tuple[str, ...]:
    """Every `model.model_type` value, registration order (read when a config is validated,
    so a family registered from outside is a valid model_type)."""
    return tuple(FAMILIES)


def native_families() -> list[str]:
    """The model_type names of native decoder families, registration order."""
    return [name for name, fam in FAMILIES.items() if fam.native]


def native_hf_model_types() -> tuple[str, ...]:
    """config.json `model_type` values the native loader reads, in registry order."""
    return tuple(t for t, f in _BY_HF_TYPE.items() if f.native)


def add_family(family: Family) -> None:
    """Add `family` to the registry (ValueError when its name or one of its config.json
    model_types is taken). models/build.py `register_family` also names its builder."""
    if family.name in FAMILIES:
        raise ValueError(f"model family {family.name!r} is already registered")
    for hf_type in family.hf_model_types:
        if hf_type in _BY_HF_TYPE:
            raise ValueError(f"config.json model_type {hf_type!r} names two families")
    FAMILIES[family.name] = family
    for hf_type in family.hf_model_types:
        _BY_HF_TYPE[hf_type] = family
    _TO_FOLDER[family.name] = _compile(family.key_map)
    _FROM_FOLDER[family.name] = _compile({v: k for k, v in family.key_map.items()})


def remove_family(name: str) -> None:
    """Take a registered family out again (tests that register one clean up with it)."""
    family = FAMILIES.pop(name)
    for hf_type in family.hf_model_types:
        _BY_HF_TYPE.pop(hf_type, None)
    _TO_FOLDER.pop(name, None)
    _FROM_FOLDER.pop(name, None)


def family_for_hf_type(model_type: Any) -> Family | None:
    """The family a config.json `model_type` value loads as, or None."""
    return _BY_HF_TYPE.get(model_type) if isinstance(model_type, str) else None


def family_of_config(config: Mapping[str, Any]) -> Family | None:
    """The family a config.json dict describes: unmask's own tag first ("unmask":
    {"model_type": ...}, written on save), else its `model_type`; None when unknown."""
    tagged = (config.get("unmask") or {}).get("model_type")
    if tagged in FAMILIES:
        return FAMILIES[tagged]
    return family_for_hf_type(config.get("model_type"))


def released_mask_token_id(config: Mapping[str, Any]) -> int | None:
    """The family's released mask id for a config.json in that family's own layout (not
    written by unmask, i.e. without an "unmask" entry); None otherwise."""
    if "unmask" in config:
        return None
    fam = family_for_hf_type(config.get("model_type"))
    return fam.mask_token_id if fam is not None else None


def samples_with_logit_shift(config: Mapping[str, Any]) -> bool:
    """True when a config.json dict is a family that predicts position i from the output at
    i - 1 (Dream), so sampling and likelihoods read logits shifted by one."""
    fam = family_of_config(config)
    return fam is not None and fam.logit_shift


def _compile(mapping: Mapping[str, str]) -> list[tuple[re.Pattern, str]]:
    out = []
    for src, dst in mapping.items():
        pattern = re.escape(src).replace(r"\.N\.", r"\.(\d+)\.")
        out.append((re.compile(f"^{pattern}$"), dst.replace(".N.", r".\1.")))
    return out


_TO_FOLDER: dict[str, list[tuple[re.Pattern, str]]] = {}
_FROM_FOLDER: dict[str, list[tuple[re.Pattern, str]]] = {}
for _fam in _ENTRIES:
    add_family(_fam)


def _rename(key: str, rules: list[tuple[re.Pattern, str]]) -> str:
    for pattern, repl in rules:
        if pattern.match(key):
            return pattern.sub(repl, key)
    raise KeyError(key)


def to_folder_keys(state: dict, family: str) -> dict:
    """Native state dict -> the family's folder key names (with a key map, unknown keys
    raise KeyError; without one the dict comes back as it is)."""
    if not FAMILIES[family].key_map:
        return state
    rules = _TO_FOLDER[family]
    return {_rename(k, rules): v for k, v in state.items()}


def from_folder_keys(state: dict, family: str) -> dict:
    """A family folder's state dict -> native key names; keys outside the map are kept (the
    loader reports them)."""
    rules = _FROM_FOLDER[family]
    out = {}
    for key, value in state.items():
        try:
            out[_rename(key, rules)] = value
        except KeyError:
            out[key] = value
    return out
