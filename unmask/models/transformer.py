"""One bidirectional decoder in the Qwen3 layout, for masked-diffusion language models.

Pre-norm decoder layers (RMSNorm -> GQA attention with per-head q/k RMSNorm and RoPE ->
RMSNorm -> SwiGLU MLP), attention without a causal mask. Parameter names equal
Hugging Face `Qwen3ForCausalLM` state-dict keys, so loading an HF folder is a plain
state-dict load and optimizers can route parameters by name.
"""

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from unmask.diffusion.loss import (
    SelectedRows,
    chunked_cross_entropy,
    full_cross_entropy,
    weighted_loss,
)
from unmask.models.attention import (
    AttentionMask,
    KVCache,
    attend,
    build_attention_mask,
    document_positions,
    resolve_backend,
)
from unmask.models.config import ModelConfig
from unmask.models.fused import rms_norm, swiglu
from unmask.models.hf import save_pretrained
from unmask.models.moe import SparseMoE, checkpoint_contexts, init_moe_weights
from unmask.models.shape import recomputes


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim; statistics in float32, output in input dtype.
    `backward_pass`: set by a zero-bubble pipeline stage (parallel/pipeline.py), whose
    input pass leaves the weight's gradient to its weight pass (models/fused.py)."""

    backward_pass = None

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.backward_pass)


@torch.no_grad()
def init_common(module: nn.Module, std: float) -> bool:
    """normal(0, std) for a linear or embedding weight (its bias zeroed), 1 for an RMSNorm's
    weight: True; False for any other module (a model's own kinds, which it initializes
    itself, in the same walk over its modules, so the draws keep their order)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        module.weight.normal_(0.0, std)
        if getattr(module, "bias", None) is not None:
            module.bias.zero_()
        return True
    if isinstance(module, RMSNorm):
        module.weight.fill_(1.0)
        return True
    return False


def embed(embedding: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    """The embedding's rows in the compute dtype: autocast's where it is on (bf16 under
    train.bf16, as FSDP2's bf16 parameters give them on several GPUs), so the residual
    stream, the norms' outputs and the hidden rows the LM head reads have the same dtype on
    one device as on many; else the embedding's own. nn.Embedding is not an autocast op: on
    its own it would keep a float32 stream (and a float32 head) wherever the parameters are
    float32."""
    x = embedding(input_ids)
    device = x.device.type
    if torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
    return x


def rotary_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for (B, L) positions -> cos, sin: (B, 1, L, head_dim) float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device)
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    freqs = position_ids[..., None].float() * inv_freq  # (B, L, D/2)
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # rotate-half layout
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, L, D) by the RoPE tables, rotate-half convention (as HF Qwen3). Tables
    narrower than D (partial rotary, LLaDA2.0) rotate the first features and pass the rest."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        rotated = apply_rotary(x[..., :rotary], cos, sin)
        return torch.cat((rotated, x[..., rotary:]), dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def context_rows(context, input_ids: torch.Tensor, doc_ids: torch.Tensor | None,
                 position_ids: torch.Tensor | None):  # fmt: skip
    """Context parallelism (input_ids: this rank's (B, L/cp) slice of each row): the whole
    rows' doc ids (B, L) for the document mask, and the slice's global positions (B, L/cp)
    (given ones are kept: they are the slice's already)."""
    if doc_ids is not None:
        doc_ids = context.gather_tokens(doc_ids)
    if position_ids is None:
        batch, length = input_ids.shape[0], input_ids.shape[1] * context.size
        if doc_ids is not None:
            whole = document_positions(doc_ids)
        else:
            whole = torch.arange(length, device=input_ids.device).expand(batch, length)
        position_ids = whole[:, context.local(length)]
    return doc_ids, position_ids


def pad_to_multiple(multiple: int, input_ids, doc_ids, position_ids, attention_mask):
    """Rows padded at the end to a multiple of `multiple` tokens (sequence parallelism's
    even shards): the padding is a document of its own, so no real token attends to it or
    it to them, and the real tokens keep their positions and their outputs."""
    rows, length = input_ids.shape
    extra = -length % multiple
    if doc_ids is None:
        doc_ids = torch.zeros_like(input_ids)

    input_ids = torch.cat([input_ids, input_ids.new_zeros(rows, extra)], dim=1)
    doc_ids = torch.cat([doc_ids, (doc_ids.max() + 1).expand(rows, extra)], dim=1)
    position_ids = position_ids.expand(rows, length)
    position_ids = torch.cat([position_ids, position_ids.new_zeros(rows, extra)], dim=1)
    if attention_mask is not None:  # the document mask keeps the padding apart
        attention_mask = torch.nn.functional.pad(attention_mask, (0, extra, 0, extra), value=True)
    return input_ids, doc_ids, position_ids, attention_mask


class Attention(nn.Module):
    """Grouped-query self-attention with q/k RMSNorm per head (or over the whole q / k
    projection: OLMoE) and RoPE, no causal mask."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden, head_dim, bias = cfg.hidden_size, cfg.resolved_head_dim, cfg.attention_bias
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.clip = cfg.clip_qkv
        # QK-clip's capture (train/qk_clip.py sets it): (heads of this tp rank,) float32, the
        # step's largest pre-softmax logit per query head so far; None: nothing captured
        self.qk_logits: torch.Tensor | None = None
        self.norm_projection = cfg.qk_norm_scope == "projection"
        q_width, kv_width = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
        qkv_bias = bias or cfg.qkv_bias  # Qwen2/Dream: bias on q, k, v but not o
        self.q_proj = nn.Linear(hidden, cfg.num_attention_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, cfg.num_key_value_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, cfg.num_key_value_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * head_dim, hidden, bias=bias)
        # Qwen3 normalizes q and k per head; Qwen2 / Llama / LLaDA / Dream do not.
        q_dim, k_dim = (q_width, kv_width) if self.norm_projection else (head_dim, head_dim)
        self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask,
        cache: tuple[KVCache, int] | None = None,
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        shape = (batch, length, -1, self.head_dim)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.norm_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q, k, v = q.view(shape), k.view(shape), v.view(shape)
        if not self.norm_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, L, D)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:  # sampling: record, or attend over cached K/V of the canvas
            k, v = cache[0].update(cache[1], k, v)
        record = None
        if self.qk_logits is not None and cache is None and self.training:
            record = self._record_logits if torch.is_grad_enabled() else None
        out = attend(q, k, v.to(q.dtype), mask, scale=self.head_dim**-0.5, record=record)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))

    def _record_logits(self, values: torch.Tensor, first: int) -> None:
        """QK-clip's capture: the running max of the per-head max logits `values` of heads
        [first, first + len(values)) (a training forward's; a recomputed forward records
        the same values again, which leaves the max unchanged)."""
        part = self.qk_logits[first : first + values.shape[0]]
        part.copy_(torch.maximum(part, values.to(part.device)))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); the MLP is a
    mixture of experts (models/moe.py) in the MoE layers of an MoE config."""

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = SparseMoE(cfg) if cfg.is_moe_layer(index) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask,
        cache: tuple[KVCache, int] | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Embedding, decoder layers and final norm: the `model.` prefix of HF Qwen3."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DiffusionTransformer(nn.Module):
    """Bidirectional Qwen3-layout decoder with an LM head; see `forward` for the call."""

    #: forward takes `target_weights` (objectives.weighted_token_loss)
    accepts_target_weights = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.gradient_checkpointing = False
        # context parallelism (unmask.parallel.context.ContextShard), set by the trainer:
        # every call then takes this rank's slice of each row
        self.context_parallel = None
        # sequence parallelism (parallel/tensor.py): the tp degree N, set when the residual
        # stream is sharded over the sequence; rows are then padded to a multiple of N
        self.sequence_parallel = None
        self.model = DecoderStack(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.init_weights()

    def checkpoints(self, index: int) -> bool:
        """Whether layer ``index`` recomputes its activations in backward:
        ``gradient_checkpointing`` True = every layer, an int n = every n-th (0, n, 2n, ...:
        selective, counted over the whole model's layers), False = none (models/shape.py
        `recomputes`, which the planner reads too)."""
        return recomputes(self.gradient_checkpointing, index)

    def tie_weights(self) -> None:
        """Make lm_head share the embedding's Parameter when tie_word_embeddings is set."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """normal(0, initializer_range) for linear/embedding weights, zero biases, unit norms.
        Nothing to do on the meta device (no storage; `build_empty` loads a state dict)."""
        if self.lm_head.weight.is_meta:
            return
        std = self.config.initializer_range
        for module in self.modules():
            init_common(module, std)
        init_moe_weights(self, std)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        *,
        layers: Sequence[int] | None = None,
        first: bool = True,
        last: bool = True,
    ) -> torch.Tensor:
        """Final-norm hidden states (B, L, H) for input_ids (B, L); see `forward`.

        A pipeline stage runs this same forward over its layers (models/shape.py
        `StagedModel`): `layers` the indices of the layers to run (None: all), `first`
        False when input_ids are the hidden states (B, L, H) of the stage before (no
        embedding), `last` False to return the last layer's output without the final norm."""
        batch, length = input_ids.shape[0], input_ids.shape[1]
        device = input_ids.device
        context = self.context_parallel
        if context is not None:
            if kv_cache is not None or attention_mask is not None:
                raise ValueError("context parallelism serves training forwards only (no KV "
                                 "cache, no explicit attention mask)")  # fmt: skip
            doc_ids, position_ids = context_rows(context, input_ids, doc_ids, position_ids)
        if position_ids is None:
            if doc_ids is not None:
                position_ids = document_positions(doc_ids)
            else:
                position_ids = torch.arange(length, device=device).expand(batch, length)
        shards = self.sequence_parallel
        if shards is not None and length % shards:
            if kv_cache is not None or not first:
                raise ValueError(f"sequence parallelism over {shards} ranks needs a multiple of "
                                 f"{shards} tokens with a KV cache; got {length}")  # fmt: skip
            input_ids, doc_ids, position_ids, attention_mask = pad_to_multiple(
                shards, input_ids, doc_ids, position_ids, attention_mask
            )
        backend = resolve_backend(
            self.config.attn_implementation, doc_ids, device, self.config.resolved_head_dim
        )
        if attention_mask is not None:  # an explicit mask (block diffusion) needs sdpa
            backend = "sdpa"
        elif kv_cache is not None and backend == "varlen":  # fed tokens: fewer q than k
            backend = "sdpa"
        mask = build_attention_mask(doc_ids, backend)
        mask.context = context
        if attention_mask is not None:
            dense = attention_mask if mask.dense is None else mask.dense & attention_mask
            mask = AttentionMask("sdpa", dense=dense)
        cos, sin = rotary_cos_sin(position_ids, self.config.rotary_dim, self.config.rope_theta)
        x = embed(self.model.embed_tokens, input_ids) if first else input_ids
        for index in range(len(self.model.layers)) if layers is None else layers:
            layer = self.model.layers[index]
            if kv_cache is not None:
                x = layer(x, cos, sin, mask, (kv_cache, index))
            elif self.checkpoints(index) and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, mask, use_reentrant=False,
                               context_fn=checkpoint_contexts)  # fmt: skip
            else:
                x = layer(x, cos, sin, mask)
        if not last:
            return x
        return self.model.norm(x)[:, :length]

    def forward(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        vocab_chunk: int = 8192,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        target_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits, or per-token losses when targets are given.

        input_ids: (B, L) long. doc_ids: (B, L) long or None; a token attends only to
        tokens with the same id (packing); None = full attention. position_ids: (B, L)
        or None; None restarts positions at 0 at each document start (0..L-1 without
        doc_ids). targets None -> logits (B, L, V) in the compute dtype. targets (B, L)
        long, -100 = no loss -> cross-entropy (B, L) float32, 0 at ignored positions; the
        LM head runs only on the selected rows, chunked over vocab_chunk ids.
        attention_mask: (B or 1, 1, L, L) bool, True = may attend, or None; combined (and)
        with the document mask (block diffusion uses it).
        kv_cache: a `KVCache` for sampling: with store=True the call covers the whole canvas
        and records each layer's K/V; otherwise input_ids are the canvas tokens from
        kv_cache.start on, attending over the cached K/V of the rest (position_ids and
        attention_mask, (B, 1, Lq, L), must then be given for the fed tokens).
        target_weights: (B, L) float with targets: return sum_i w_i CE_i (0-d float32)
        over the target positions instead of the per-token losses, with the LM head's
        gradients computed in the forward (`weighted_cross_entropy`: one pass over the
        head fewer). Under `loss_implementation: full` the losses come from the whole
        logits instead (`full_cross_entropy`).
        """
        implementation = self.config.loss_implementation
        selected = None  # the target rows' count goes to the host while the forward runs
        if targets is not None and implementation != "full":
            selected = SelectedRows(targets)
        hidden = self.hidden_states(input_ids, doc_ids, position_ids, attention_mask, kv_cache)
        if targets is None:
            return self.lm_head(hidden)
        if target_weights is not None:
            return self.weighted_head_loss(hidden, targets, target_weights, vocab_chunk,
                                           selected=selected)  # fmt: skip
        if implementation == "full":  # the whole logits, as HF / torchtitan
            return full_cross_entropy(hidden, self.lm_head.weight, targets)
        rows = chunked_cross_entropy(selected.take(hidden), self.lm_head.weight,
                                     selected.take(targets), vocab_chunk)  # fmt: skip
        return selected.scatter(rows.float())

    def weighted_head_loss(self, hidden: torch.Tensor, targets: torch.Tensor,
                           target_weights: torch.Tensor, vocab_chunk: int = 8192, *,
                           fused: bool = True,
                           selected: SelectedRows | None = None) -> torch.Tensor:  # fmt: skip
        """The LM head's loss on the final norm's output `hidden` (B, L, H): sum_i w_i CE_i
        (0-d float32) over the target positions, by `loss_implementation`; what `forward`
        returns with target_weights, and what a pipeline's last stage calls
        (parallel/pipeline.py). fused False makes the head's gradients in the backward (the
        logits recomputed there) instead of in the forward. selected: the target rows,
        when the caller took them before the layers ran."""
        return weighted_loss(hidden, self.lm_head.weight, targets, target_weights, vocab_chunk,
                             self.config.loss_implementation, fused=fused,
                             selected=selected)  # fmt: skip

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters (a tied matrix counts once)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.model.embed_tokens.weight.numel()
        return total

    @torch.no_grad()
    def resize_token_embeddings(self, new_size: int) -> None:
        """Grow (or truncate) the vocabulary to new_size; new rows = mean of the old rows."""
        self.model.embed_tokens = _resized(self.model.embed_tokens, new_size)
        if self.config.tie_word_embeddings:
            self.lm_head = nn.Linear(self.config.hidden_size, new_size, bias=False)
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = _resized(self.lm_head, new_size)
        self.config = self.config.model_copy(update={"vocab_size": new_size})

    def save_pretrained(self, folder: str) -> None:
        """Write an HF folder in this family's layout (config.json + model.safetensors)."""
        save_pretrained(self, folder)


def _resized(module: nn.Module, new_size: int) -> nn.Module:
    """Copy of an Embedding or bias-free Linear with new_size rows; new rows = mean row."""
    old = module.weight
    keep = min(new_size, old.shape[0])
    weight = torch.empty(new_size, old.shape[1], dtype=old.dtype, device=old.device)
    weight[:keep] = old[:keep]
    weight[keep:] = old.float().mean(0).to(old.dtype)
    if isinstance(module, nn.Embedding):
        new = nn.Embedding(new_size, old.shape[1], device=old.device, dtype=old.dtype)
    else:
        new = nn.Linear(old.shape[1], new_size, bias=False, device=old.device, dtype=old.dtype)
    new.weight.data.copy_(weight)
    new.weight.requires_grad_(old.requires_grad)
    return new
