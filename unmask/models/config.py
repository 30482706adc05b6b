"""The model section of a run config: one bidirectional decoder, Qwen3 layout.

Field names are the Hugging Face `config.json` names, so a Qwen3 folder's config maps
onto this class key for key (see `unmask.models.hf.config_from_hf`).
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator


class ModelConfig(BaseModel):
    """Architecture of the native diffusion transformer, or a local folder to load."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model_type: Literal["qwen3_dllm"] = "qwen3_dllm"
    """Model family: a key of `unmask.models.MODEL_BUILDERS`. `qwen3_dllm` is a Qwen3
    decoder with bidirectional (non-causal) attention."""

    vocab_size: int = 256
    """Number of token ids (rows of the embedding and of the LM head)."""

    hidden_size: int = 128
    """Width of the residual stream (features per token)."""

    intermediate_size: int = 384
    """Width of the SwiGLU MLP's hidden layer (features per token)."""

    num_hidden_layers: int = 4
    """Number of decoder layers."""

    num_attention_heads: int = 4
    """Number of query heads per attention layer."""

    num_key_value_heads: int = 2
    """Number of key/value heads (grouped-query attention); divides num_attention_heads."""

    head_dim: int | None = None
    """Features per attention head; None means hidden_size // num_attention_heads."""

    rms_norm_eps: float = 1e-6
    """Epsilon added to the mean square inside every RMSNorm (unitless)."""

    rope_theta: float = 1e6
    """RoPE base: the wavelength scale of the rotary position embedding (in tokens)."""

    max_position_embeddings: int = 4096
    """Longest sequence (in tokens) the model is meant to see; written to config.json."""

    tie_word_embeddings: bool = False
    """Share one matrix between the input embedding and the LM head."""

    attention_bias: bool = False
    """Add a bias to the q/k/v/o projections."""

    initializer_range: float = 0.02
    """Standard deviation of the normal init of linear and embedding weights."""

    attn_implementation: Literal["auto", "sdpa", "flex"] = "auto"
    """Attention kernel: `sdpa` (scaled_dot_product_attention with a dense document
    mask), `flex` (flex_attention with a block document mask), or `auto` (flex for
    packed rows on CUDA, sdpa otherwise). All give the same numbers."""

    pretrained: str | None = None
    """Local folder to load: a Hugging Face Qwen3 folder or one saved by unmask. When
    set, the architecture comes from the folder's config.json and the fields above
    (except attn_implementation) are ignored."""

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
