"""The model section of a run config: one bidirectional decoder, Qwen3 layout.

Field names are the Hugging Face `config.json` names, so a Qwen3 folder's config maps
onto this class key for key (see `unmask.models.hf.config_from_hf`).
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from unmask.models.families import DEFAULT_FAMILY, FAMILIES, FAMILY_NAMES


class ModelConfig(BaseModel):
    """Architecture of the native diffusion transformer, or a local folder to load."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model_type: Literal[FAMILY_NAMES] = DEFAULT_FAMILY  # the names in models/families.py
    """Model family, a name in the registry models/families.py. `qwen3_dllm`, `qwen2_dllm`,
    `llama_dllm`, `dream`, `llada`: the native bidirectional decoder with that family's
    switches and HF layout; `bert`, `modernbert`: transformers' masked-LM encoders built
    from the size fields here."""

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

    initializer_range: float = Field(0.02, ge=0)
    """Standard deviation of the normal init of linear and embedding weights."""

    attn_implementation: Literal["auto", "sdpa", "flex"] = "auto"
    """Attention kernel: `sdpa` (scaled_dot_product_attention with a dense document
    mask), `flex` (flex_attention with a block document mask), or `auto` (flex for
    packed rows on CUDA, sdpa otherwise). All give the same numbers."""

    pretrained: str | None = None
    """Local folder to load: a Hugging Face Qwen3 folder or one saved by unmask. When
    set, the architecture comes from the folder's config.json and the fields above
    (except attn_implementation) are ignored."""

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
    whose dotted name ends with it) or a regex over full module names, as peft reads them."""

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
            for key, value in FAMILIES[name].config_defaults.items():
                data = {**data} if key not in data else data
                data.setdefault(key, value)
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
        return self

    @property
    def resolved_head_dim(self) -> int:
        """head_dim, or hidden_size // num_attention_heads when it is None."""
        return self.head_dim or self.hidden_size // self.num_attention_heads
