"""The model section of a run config: one bidirectional decoder, Qwen3 layout.

Field names are the Hugging Face `config.json` names, so a Qwen3 folder's config maps
onto this class key for key (see `unmask.models.hf.config_from_hf`). A family whose blocks
need fields no other family reads keeps them in a sub-section of its own
(`Family.section`: `model.diffusion_gemma`, `DiffusionGemmaSection`), filled with its
defaults for that family and refused for the others, so the flat fields stay the ones
every decoder shares.
"""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from unmask.errors import OneOf
from unmask.models.diffusion_gemma_layout import (
    FULL,
    LORA_PROJECTOR,
    LORA_TOWER,
    SLIDING,
    VISION_KEYS,
    default_layer_types,
)
from unmask.models.families import DEFAULT_FAMILY, FAMILIES, family_names


class DiffusionGemmaSection(BaseModel):
    """`model.diffusion_gemma`: the fields of Google's DiffusionGemma (models/diffusion_gemma.py)
    beyond the shared ones. There, num_key_value_heads / head_dim / rope_theta are the
    sliding-window layers'; the full-attention layers have their own below. The vision tower
    comes from a pretrained folder (its config.json's vision_config, models/
    diffusion_gemma_vision.py), not from this section: keys asking for images here are
    refused."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    layer_types: list[Literal["sliding_attention", "full_attention"]] | None = None
    """Each layer's attention: sliding_attention (a window of sliding_window tokens) or
    full_attention; the last layer must be full_attention. None = five sliding layers, then
    one full layer, repeated (the last one full)."""

    sliding_window: int = Field(512, ge=2)
    """Window of the sliding layers, in tokens (config.json's value: a prompt token sees
    itself and the sliding_window - 1 before it; a canvas sees the last sliding_window - 1
    prompt tokens and the whole canvas)."""

    global_head_dim: int | None = Field(None, ge=2)
    """Features per head of the full-attention layers (26B-A4B: 512); None = head_dim."""

    num_global_key_value_heads: int | None = Field(None, ge=1)
    """Key/value heads of the full-attention layers (26B-A4B: 2), whose values are their
    normed keys (no v_proj); None = num_key_value_heads."""

    global_rope_theta: float = Field(1e6, gt=0)
    """RoPE base of the full-attention layers (rope_theta is the sliding layers')."""

    global_partial_rotary_factor: float = Field(0.25, gt=0, le=1)
    """Share of each full-attention head's frequency pairs that rotate (transformers'
    `proportional` RoPE: the first pairs keep the frequencies of the whole head, the rest
    are left unrotated)."""

    final_logit_softcapping: float = Field(30.0, gt=0)
    """Logits are c * tanh(logits / c) with this c."""

    canvas_length: int = Field(256, ge=1)
    """Tokens of one canvas (the block of block diffusion) the decoder denoises."""

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data):
        asked = [key for key in VISION_KEYS if isinstance(data, dict) and key in data]
        if asked:
            raise ValueError(
                f"{asked[0]}: unmask's diffusion_gemma is text only (no vision tower, no image "
                "embedding): images are not supported; remove it"
            )
        return data

    def resolved_layer_types(self, layers: int) -> list[str]:
        """layer_types, or the default pattern for `layers` layers."""
        return list(self.layer_types) if self.layer_types else default_layer_types(layers)

    def resolved_global_head_dim(self, cfg: "ModelConfig") -> int:
        """global_head_dim, or cfg's head_dim when it is None."""
        return self.global_head_dim or cfg.resolved_head_dim

    def resolved_global_key_value_heads(self, cfg: "ModelConfig") -> int:
        """num_global_key_value_heads, or cfg's num_key_value_heads when it is None."""
        return self.num_global_key_value_heads or cfg.num_key_value_heads

    def layer_shape(self, cfg: "ModelConfig", index: int) -> tuple[bool, int, int]:
        """(sliding, head_dim, key/value heads) of layer `index`."""
        if self.resolved_layer_types(cfg.num_hidden_layers)[index] == SLIDING:
            return True, cfg.resolved_head_dim, cfg.num_key_value_heads
        return False, self.resolved_global_head_dim(cfg), self.resolved_global_key_value_heads(cfg)

    def check(self, cfg: "ModelConfig") -> None:
        """ValueError for a section that does not fit cfg's sizes, or shared fields set to
        what this family's blocks do not have."""
        fixed = {"tie_word_embeddings": True, "qkv_bias": False, "qk_norm": True,
                 "qk_norm_scope": "head", "clip_qkv": None, "partial_rotary_factor": 1.0,
                 "num_shared_experts": 0, "first_k_dense_replace": 0, "mlp_only_layers": [],
                 "router_score": "softmax", "norm_topk_prob": True,
                 "routed_scaling_factor": 1.0, "n_group": 1, "router_aux_loss_coef": 0.0,
                 "router_z_loss_coef": 0.0, "expert_bias_update_rate": 0.0}  # fmt: skip
        for key, value in fixed.items():
            if getattr(cfg, key) != value:
                raise ValueError(
                    f"model_type diffusion_gemma has {key}={value!r} (not "
                    f"{getattr(cfg, key)!r}): its blocks have no other form yet"
                )
        if not cfg.num_experts:
            raise ValueError("model_type diffusion_gemma needs num_experts > 0 (every layer "
                             "has a mixture of experts beside its dense MLP)")  # fmt: skip
        types = self.resolved_layer_types(cfg.num_hidden_layers)
        if len(types) != cfg.num_hidden_layers:
            raise ValueError(
                f"diffusion_gemma.layer_types names {len(types)} layers; num_hidden_layers is "
                f"{cfg.num_hidden_layers}"
            )
        if types[-1] != FULL:
            raise ValueError("diffusion_gemma.layer_types: the last layer must be full_attention")
        heads = self.resolved_global_key_value_heads(cfg)
        if cfg.num_attention_heads % heads:
            raise ValueError(
                f"num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
                f"diffusion_gemma.num_global_key_value_heads ({heads})"
            )
        if self.resolved_global_head_dim(cfg) % 2:
            raise ValueError("diffusion_gemma.global_head_dim must be even for RoPE")
        # resolved, so that folders round-trip them (as moe_intermediate_size)
        self.layer_types = types
        self.global_head_dim = self.resolved_global_head_dim(cfg)


class ModelConfig(BaseModel):
    """Architecture of the native diffusion transformer, or a local folder to load."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model_type: Annotated[str, OneOf(family_names)] = DEFAULT_FAMILY  # models/families.py
    """Model family, a name in the registry models/families.py. `qwen3_dllm`, `qwen2_dllm`,
    `llama_dllm`, `dream`, `llada`: the native bidirectional decoder with that family's
    switches and HF layout; `qwen3_moe_dllm`, `llada_moe`, `llada2_moe`: the same decoder with
    mixture-of-experts MLPs (Qwen3-MoE, OLMoE / LLaDA-MoE and LLaDA2.0 layouts, the MoE fields
    below); `diffusion_gemma`: Google's DiffusionGemma (a prompt encoder and a canvas decoder
    sharing one Gemma 4 MoE stack; text only; its own fields in `diffusion_gemma`); `bert`,
    `modernbert`: transformers' masked-LM encoders built from the size fields here; or a
    family added with `unmask.models.register_family`."""

    vocab_size: int = Field(256, ge=1)
    """Number of token ids (rows of the embedding and of the LM head)."""

    hidden_size: int = Field(128, ge=1)
    """Width of the residual stream (features per token)."""

    intermediate_size: int = Field(384, ge=1)
    """Width of the SwiGLU MLP's hidden layer (features per token)."""

    num_hidden_layers: int = Field(4, ge=1)
    """Number of decoder layers."""

    num_attention_heads: int = Field(4, ge=1)
    """Number of query heads per attention layer."""

    num_key_value_heads: int = Field(2, ge=1)
    """Number of key/value heads (grouped-query attention); divides num_attention_heads."""

    head_dim: int | None = Field(None, ge=1)
    """Features per attention head; None means hidden_size // num_attention_heads."""

    rms_norm_eps: float = Field(1e-6, ge=0)
    """Epsilon added to the mean square inside every RMSNorm (unitless)."""

    rope_theta: float = Field(1e6, gt=0)
    """RoPE base: the wavelength scale of the rotary position embedding (in tokens)."""

    max_position_embeddings: int = Field(4096, ge=1)
    """Longest sequence (in tokens) the model is meant to see; written to config.json."""

    tie_word_embeddings: bool = False
    """Share one matrix between the input embedding and the LM head."""

    attention_bias: bool = False
    """Add a bias to the q/k/v/o projections."""

    qkv_bias: bool = False
    """Add a bias to the q/k/v projections only (Qwen2 / Dream layout)."""

    qk_norm: bool = True
    """RMSNorm on each head's queries and keys before RoPE (Qwen3); false for Qwen2, Llama,
    LLaDA and Dream."""

    num_experts: int = Field(0, ge=0)
    """Routed experts per MoE layer; 0 = dense model (every layer a SwiGLU MLP)."""

    num_experts_per_tok: int = Field(2, ge=1)
    """Experts each token is sent to (top-k)."""

    moe_intermediate_size: int | None = Field(None, ge=1)
    """Hidden width of each routed expert's SwiGLU; None = intermediate_size (an MoE config
    resolves it on load)."""

    num_shared_experts: int = Field(0, ge=0)
    """Always-on experts (one SwiGLU of width num_shared_experts x moe_intermediate_size,
    LLaDA2.0's `shared_experts`) added to the routed output."""

    first_k_dense_replace: int = Field(0, ge=0)
    """The first k layers keep a dense MLP (width intermediate_size), LLaDA2.0's key."""

    mlp_only_layers: list[int] = Field(default_factory=list)
    """Further layer indices with a dense MLP (Qwen3-MoE's key)."""

    router_score: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over experts (Qwen3-MoE, OLMoE) or per-expert sigmoid
    (LLaDA2.0, DeepSeek-V3); sigmoid routers carry an `expert_bias` buffer."""

    norm_topk_prob: bool = False
    """Renormalize the top-k weights of each token to sum to 1 (always on for sigmoid)."""

    routed_scaling_factor: float = Field(1.0, gt=0)
    """Factor on the routed experts' weights (LLaDA2.0: 2.5)."""

    n_group: int = Field(1, ge=1)
    """Expert groups for group-limited routing; a token picks its experts inside its
    topk_group best groups (group score: sum of the group's top-2 scores). 1 = off."""

    topk_group: int = Field(1, ge=1)
    """Groups each token may route into (<= n_group)."""

    router_aux_loss_coef: float = Field(0.0, ge=0)
    """Weight of the Switch/OLMoE load-balancing loss E * sum_e f_e P_e (f: fraction of
    routed slots, P: mean router probability), computed over each micro-batch of the whole
    data-parallel group and added to the objective's loss."""

    router_z_loss_coef: float = Field(0.0, ge=0)
    """Weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE); 0 = off."""

    expert_bias_update_rate: float = Field(0.0, ge=0)
    """Aux-loss-free balancing (sigmoid routers): once per optimizer step every expert's
    bias moves by this rate toward the mean load, bias += rate * sign(mean - load), with the
    load summed over the step's micro-batches and ranks. 0 = bias frozen (as loaded)."""

    partial_rotary_factor: float = Field(1.0, gt=0, le=1)
    """Fraction of each head's features that RoPE rotates (LLaDA2.0: 0.5); the rest pass."""

    qk_norm_scope: Literal["head", "projection"] = "head"
    """q/k RMSNorm over each head (Qwen3, LLaDA2.0) or over the whole q / k projection
    (OLMoE / LLaDA-MoE)."""

    clip_qkv: float | None = Field(None, gt=0)
    """Clamp q, k, v to [-clip_qkv, clip_qkv] after projection (OLMoE's key); None = off."""

    moe_implementation: Literal["auto", "grouped_mm", "loop"] = "auto"
    """Expert compute: `grouped_mm` (torch._grouped_mm over tokens sorted by expert),
    `loop` (one matmul per expert over the same sorted tokens), `auto` (grouped_mm where
    the shapes allow it). Both give the same result."""

    initializer_range: float = Field(0.02, ge=0)
    """Standard deviation of the normal init of linear and embedding weights."""

    diffusion_gemma: DiffusionGemmaSection | None = None
    """model_type diffusion_gemma's own fields (layer_types, sliding_window, global_head_dim,
    num_global_key_value_heads, global_rope_theta, global_partial_rotary_factor,
    final_logit_softcapping, canvas_length; their defaults when not given); null for every
    other family."""

    attn_implementation: Literal["auto", "sdpa", "flex", "varlen"] = "auto"
    """Attention kernel: `sdpa` (scaled_dot_product_attention with a dense document
    mask), `flex` (flex_attention with a block document mask), `varlen` (one sdpa call per
    document, no mask), or `auto` (for packed rows flex on CUDA, varlen elsewhere; sdpa
    without document ids). All give the same numbers."""

    loss_implementation: Literal["chunked", "full"] = "chunked"
    """The LM head's cross-entropy: `chunked` (the head only on the rows with a target, in
    blocks over the vocabulary, float32, its gradients made in the forward; no (rows x
    vocabulary) logits kept) or `full` (logits of every position over the whole vocabulary
    in the compute dtype, their float32 copy, torch's cross_entropy: what transformers'
    and torchtitan's losses allocate, for comparing memory with them). Equal losses and
    gradients in float32; under bf16 `full`'s logits are rounded to bf16. Native decoders
    (wrapped transformers encoders always compute full logits); not with
    parallel.tensor_parallel (its head is split by vocabulary)."""

    pretrained: str | None = None
    """Local folder to load: a Hugging Face Qwen3 folder or one saved by unmask. When
    set, the architecture comes from the folder's config.json and the fields above
    (except attn_implementation and loss_implementation) are ignored."""

    freeze_vision: bool | Literal["tower", "projector"] = True
    """A diffusion_gemma folder's vision tower and `embed_vision` projector: true keeps both
    frozen (held apart from the model's parameters, saved as read), false trains both,
    `tower` freezes the tower and trains the projector (LLaVA's fine-tuning recipe),
    `projector` the reverse. Needs `pretrained` (a folder with a vision tower); with LoRA,
    name `vision_tower` / `embed_vision` in lora_target_modules instead. docs/multimodal.md."""

    lora: bool = False
    """Train LoRA adapters (peft) instead of all weights; LoRA factors always use AdamW."""

    lora_r: int = Field(32, ge=1)
    """LoRA rank."""

    lora_alpha: int = Field(64, ge=1)
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_r)."""

    lora_dropout: float = Field(0.05, ge=0.0, lt=1.0)
    """Dropout on the LoRA input."""

    lora_target_modules: str | list[str] = "all-linear"
    """Modules that get adapters: "all-linear" (every linear layer of the decoder blocks;
    transformers' choice for encoders), a list of module names (a name matches a module
    whose dotted name ends with it) or a regex over full module names, as peft reads them. On
    a native MoE model, `experts` in a list also adapts the routed expert stacks (peft's
    target_parameters; needs lora_dropout 0); "all-linear" leaves them frozen. On a
    diffusion_gemma folder with a vision tower, `vision_tower` (its layers' attention and
    MLP maps) and `embed_vision` (the projector) in a list adapt those, each on its own;
    the list's other names (`all-linear` too) then leave the vision modules alone."""

    adaptor_name: str = "adaptor"
    """Folder (under output_dir) for the adapter in peft's format."""

    lora_merge: bool = False
    """Also export the merged model (base + adapter) to output_dir/final."""

    load_in_4bit: bool = False
    """QLoRA: with `lora: true`, the linear layers LoRA targets are quantized to 4-bit NF4
    (bitsandbytes, double quantization) and frozen; embeddings, norms and the LM head stay
    full precision. Needs a CUDA device and the `qlora` extra; fails at start elsewhere."""

    def to_dict(self) -> dict:
        """The fields as a dict (peft reads a model's config this way)."""
        return self.model_dump()

    @model_validator(mode="before")
    @classmethod
    def _family_defaults(cls, data):
        name = data.get("model_type") if isinstance(data, dict) else None
        if isinstance(name, str) and name in FAMILIES:
            family = FAMILIES[name]
            for key, value in family.config_defaults.items():
                data = {**data} if key not in data else data
                data.setdefault(key, value)
            if family.section and data.get(family.section) is None:  # its defaults
                data = {**data, family.section: {}}
        return data

    @model_validator(mode="after")
    def _check_shapes(self) -> "ModelConfig":
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads}), or set head_dim"
            )
        if self.resolved_head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.resolved_head_dim}) must be even for RoPE")
        if self.rotary_dim % 2 != 0 or self.rotary_dim == 0:
            raise ValueError(
                f"partial_rotary_factor ({self.partial_rotary_factor}) x head_dim "
                f"({self.resolved_head_dim}) must be a positive even number of features"
            )
        for family in FAMILIES.values():  # a family's own section: that family only
            section = getattr(self, family.section, None) if family.section else None
            if section is not None and family.name != self.model_type:
                raise ValueError(
                    f"{family.section} holds model_type {family.name}'s fields; model_type is "
                    f"{self.model_type}: remove it"
                )
            if section is not None:
                section.check(self)
        family = FAMILIES[self.model_type]
        if self.num_experts and family.native and not family.moe:
            moe = ", ".join(name for name, fam in FAMILIES.items() if fam.native and fam.moe)
            raise ValueError(
                f"model_type {self.model_type} is dense; num_experts ({self.num_experts}) needs "
                f"an MoE family ({moe}) or num_experts: 0"
            )
        if family.native:  # what the family's folders cannot hold (models/layouts.py)
            family.layout.check(self)
        if self.num_experts:
            self._check_experts()
        self._check_vision()
        return self

    def _check_vision(self) -> None:
        targets = self.lora_target_modules
        adapted = self.lora and isinstance(targets, list) and bool(
            {LORA_TOWER, LORA_PROJECTOR} & set(targets))  # fmt: skip
        if adapted and self.pretrained is None:
            raise ValueError(
                f"model.lora_target_modules names {LORA_TOWER} / {LORA_PROJECTOR}: needs "
                "model.pretrained, a diffusion_gemma folder with a vision tower"
            )
        if self.freeze_vision is True:
            return
        if self.lora:
            raise ValueError(
                f"model.freeze_vision={self.freeze_vision!r} with model.lora: LoRA trains "
                f"adapters only; keep freeze_vision: true and name {LORA_TOWER} / "
                f"{LORA_PROJECTOR} in lora_target_modules"
            )
        if self.pretrained is None:
            raise ValueError(
                f"model.freeze_vision={self.freeze_vision!r} needs model.pretrained: a "
                "diffusion_gemma folder with a vision tower (a model built from the config "
                "has none)"
            )

    def _check_experts(self) -> None:
        if self.moe_intermediate_size is None:  # resolved, so folders round-trip it
            self.moe_intermediate_size = self.intermediate_size
        experts, top_k = self.num_experts, self.num_experts_per_tok
        if top_k > experts:
            raise ValueError(
                f"num_experts_per_tok ({top_k}) is above num_experts ({experts}); lower it"
            )
        if experts % self.n_group != 0:
            raise ValueError(f"n_group ({self.n_group}) must divide num_experts ({experts})")
        if self.topk_group > self.n_group:
            raise ValueError(
                f"topk_group ({self.topk_group}) is above n_group ({self.n_group}); lower it"
            )
        if self.n_group > 1 and top_k > self.topk_group * (experts // self.n_group):
            raise ValueError(
                f"num_experts_per_tok ({top_k}) is above the experts of topk_group "
                f"({self.topk_group}) groups of {experts // self.n_group}"
            )
        if self.n_group > 1 and experts // self.n_group < 2:
            raise ValueError("group-limited routing needs at least 2 experts per group")
        if self.expert_bias_update_rate > 0 and self.router_score != "sigmoid":
            raise ValueError(
                "expert_bias_update_rate needs router_score: sigmoid (the expert bias lives "
                "on sigmoid routers)"
            )

    @property
    def native(self) -> bool:
        """Whether model_type is a native decoder family (else a wrapped transformers
        encoder: models/families.py `Family.kind`)."""
        return FAMILIES[self.model_type].native

    @property
    def resolved_moe_intermediate_size(self) -> int:
        """moe_intermediate_size, or intermediate_size when it is None."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def rotary_dim(self) -> int:
        """Features per head that RoPE rotates: head_dim x partial_rotary_factor."""
        return int(self.resolved_head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` has routed experts (else a dense MLP)."""
        return (
            self.num_experts > 0
            and index >= self.first_k_dense_replace
            and index not in self.mlp_only_layers
        )

    @property
    def resolved_head_dim(self) -> int:
        """head_dim, or hidden_size // num_attention_heads when it is None."""
        return self.head_dim or self.hidden_size // self.num_attention_heads
