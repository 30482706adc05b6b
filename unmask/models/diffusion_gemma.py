"""Google's DiffusionGemma (`model_type: diffusion_gemma`): a prompt encoder and a canvas
decoder that share one Gemma 4 mixture-of-experts stack, for block diffusion.

What transformers' `DiffusionGemmaForBlockDiffusion` (transformers 5.24,
models/diffusion_gemma) computes, and this module computes the same way:

- Encoder: the stack over the prompt, causal (sliding layers: a window of `sliding_window`
  tokens, the token itself included). Only its keys and values are used: the decoder reads
  every layer's K/V (full layers: the whole prompt; sliding layers: the last
  `sliding_window - 1` tokens, what transformers' sliding cache keeps), so the encoder's
  last layer needs no MLP and its final norm is never applied.
- Decoder: the same stack over a canvas of `canvas_length` tokens at the positions after
  the prompt, each layer attending bidirectionally to the prompt's K/V and the canvas's own
  (no window inside: the sliding layers see the kept prompt K/V and the whole canvas).
- Self-conditioning: the canvas embedding gets softmax(previous logits) @ embedding x
  sqrt(hidden) through a gated MLP (pre-norm with weight), added, then a weightless RMSNorm
  (also without previous logits: the first step adds zero and still normalizes).
- Embeddings are scaled by sqrt(hidden) (in the weight dtype, as transformers rounds it).
- Layers: input norm -> attention -> post-attention norm -> residual; then a dense gated
  MLP (pre_feedforward_layernorm, post_feedforward_layernorm_1) beside a mixture of experts
  (its router reads the residual stream, its experts pre_feedforward_layernorm_2's output;
  post_feedforward_layernorm_2), summed, post_feedforward_layernorm, residual; the output
  times a per-layer scalar (a buffer: the encoder's and the decoder's are separate folder
  tensors; so are the attention biases, with attention_bias: the encoder's are
  `self_attn.encoder_<proj>_bias`). Every layer has both MLPs; the activation is GELU
  (tanh approximation).
- Attention: q/k RMSNorm per head, values RMS-normalized without weight, scale 1.0.
  Sliding layers: head_dim, num_key_value_heads, RoPE theta `rope_theta` over the whole
  head. Full layers: `global_head_dim`, `num_global_key_value_heads`, no v_proj (V is the
  k projection before k_norm, normalized), "proportional" RoPE: the first
  global_partial_rotary_factor x head_dim / 2 frequency pairs rotate with the frequencies
  of the whole head, the rest do not.
- RMSNorm multiplies by its weight w (not 1 + w). Router: weightless RMSNorm, times `scale`
  and hidden^-1/2, a linear `proj`, softmax over experts (float32), top-k, renormalized,
  times `per_expert_scale` of the chosen experts. Experts: stacked `gate_up_proj` (E, 2I, H)
  and `down_proj` (E, H, I).
- Logits: the tied embedding as LM head, in float32, soft-capped c * tanh(logits / c).

The names are the folder's with `model.decoder.` read as `model.` (the layout models/shape.py
names; models/diffusion_gemma_layout.py maps them, and the encoder's layer scalars are
`model.layers.N.encoder_layer_scalar`). The vision tower transformers always builds is not
part of this model's parameters by default: `from_pretrained` carries its tensors to the
folder it saves, and `encode(..., images=)` runs them (models/diffusion_gemma_vision.py,
frozen); trained (`model.freeze_vision`) or LoRA-adapted, it is the registered
`model.encoder` under the folder's names.

Config: the sizes every decoder shares stay ModelConfig's flat fields (for this family the
sliding layers' heads, head_dim and rope_theta); the fields only this family reads are one
sub-section, `ModelConfig.diffusion_gemma` (models/config.py `DiffusionGemmaSection`), rather
than eight more top-level fields every other family would have to document as "ignored", and
rather than transformers' nesting (text_config / vision_config), which would split the
sizes the planner, the MFU and the loaders read for every family.

Sampling API: `encode(prompt)` once per prompt (a `PromptCache` of every layer's K/V;
`encode(canvas, cache)` appends an accepted canvas, as transformers' block loop does), then
`decode(canvas, cache, self_conditioning_logits)` per denoising step; `forward` is both.

Training (the `uniform` objective, unmask/diffusion/uniform.py): `forward(prompt, canvas,
prompt_mask=, position_ids=, canvas_position_ids=, self_condition=, targets=,
target_weights=)` runs the encoder once, the decoder twice when `self_condition` (B,) bool
is given (a first pass without gradients and without a signal, whose logits are the signal
of the rows marked True in the second: NeMo AutoModel's two-pass self-conditioning), and
returns the cross-entropy of `targets` over the canvas from the soft-capped float32 logits
(per position, or its `target_weights`-weighted sum): one call of the module, so FSDP2's
hooks see every use of the shared stack.
Expert parallelism (`parallel.expert_parallel`, parallel/expert.py): `Experts` is an expert
block (`expert_stacks`, `expert_parallel`); its sorted rows go to the ranks that own their
experts and back, the router and the dense MLP stay where they are.
Tensor parallelism (`parallel.tensor_parallel`, parallel/tensor.py with models/shape.py
`DIFFUSION_GEMMA_TENSOR_PLAN`): attention's projections and the dense MLP split over the tp
ranks (each rank's attention runs on its own heads, and caches their K/V only); the
routers, experts, embedding / LM head and self-conditioning MLP stay whole on every rank.
Not yet: pipeline parallelism, activation checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from unmask.errors import InputError
from unmask.models.attention import AttentionMask, attend
from unmask.models.config import ModelConfig
from unmask.models.diffusion_gemma_layout import ENCODER_BIASES
from unmask.models.diffusion_gemma_vision import Images, require_vision
from unmask.models.hf import save_pretrained
from unmask.models.moe import (
    expert_counts,
    expert_stack,
    grouped_mm_fits,
    local_experts,
    router_logits,
)
from unmask.models.transformer import RMSNorm, apply_rotary, init_common


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (statistics in float32, output in x's dtype)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """transformers' `gelu_pytorch_tanh`."""
    return F.gelu(x, approximate="tanh")


def rope_tables(position_ids: torch.Tensor, head_dim: int, theta: float, factor: float = 1.0):
    """cos, sin (B, 1, L, head_dim) float32 for (B, L) positions: the first
    int(factor x head_dim / 2) frequency pairs theta^(-2i / head_dim), the rest 0 (not rotated:
    transformers' `proportional` RoPE; factor 1 is the default RoPE), rotate-half layout."""
    pairs = int(factor * head_dim // 2)
    exponents = torch.arange(0, 2 * pairs, 2, dtype=torch.float32, device=position_ids.device)
    inv_freq = F.pad(1.0 / (theta ** (exponents / head_dim)), (0, head_dim // 2 - pairs))
    freqs = position_ids[..., None].float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]
    return angles.cos(), angles.sin()


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose gradient is made contiguous (grouped_mm's CPU backward refuses
    expanded gradients)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


@dataclass
class PromptCache:
    """The encoder's keys and values, per layer (B, Hkv, kept, D) after RoPE: full layers
    keep every encoded token, sliding layers the last sliding_window - 1 (transformers'
    sliding cache). `length`: tokens encoded so far (the canvas's first position index);
    `mask`: (B, length) bool, False = a padding token no query attends to, None = none."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int
    mask: torch.Tensor | None = None

    def detached(self) -> PromptCache:
        """The cache without its autograd history (views of the same K/V)."""
        return PromptCache([k.detach() for k in self.keys], [v.detach() for v in self.values],
                           self.length, self.mask)  # fmt: skip

    def select_rows(self, rows: torch.Tensor) -> PromptCache:
        """The cache of batch rows `rows` only."""
        return PromptCache([k[rows] for k in self.keys], [v[rows] for v in self.values],
                           self.length, None if self.mask is None else self.mask[rows])  # fmt: skip


class Attention(nn.Module):
    """One layer's attention (module docstring): sliding or full, over cached K/V too.
    Under tensor parallelism q/k/v hold a rank's heads only: every reshape takes the head
    count from the projection (`view(..., -1, head_dim)`), so the forward and the K/V it
    returns (the `PromptCache`) are of the local heads."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        sliding, head_dim, kv_heads = cfg.diffusion_gemma.layer_shape(cfg, index)
        hidden, heads, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
        self.sliding, self.head_dim, self.eps = sliding, head_dim, cfg.rms_norm_eps
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        # full layers: V is the (normed) k projection
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias) if sliding else None
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps)
        if bias:  # the encoder's own biases: transformers ties weights only (ENCODER_BIASES)
            for name in ENCODER_BIASES:
                linear = getattr(self, name)
                if linear is not None:
                    self.register_parameter(f"encoder_{name}_bias",
                                            nn.Parameter(torch.zeros(linear.out_features)))  # fmt: skip

    def _project(self, name: str, x: torch.Tensor, encoder: bool) -> torch.Tensor:
        """Projection `name` of x: the shared weight, with the encoder's bias in the
        encoder pass (where the layer has biases). A wrapped projection (a LoRA layer) is
        called as it is, its own bias swapped for the encoder's, so its adapter runs too."""
        linear = getattr(self, name)
        if not encoder or linear.bias is None:
            return linear(x)
        bias = getattr(self, f"encoder_{name}_bias")
        if type(linear) is nn.Linear:
            return F.linear(x, linear.weight, bias)
        return linear(x) - linear.bias + bias

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    encoder: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(B, L, H) normed input -> k, v (B, Hkv, L, D), k after RoPE."""
        shape = (*x.shape[:2], -1, self.head_dim)
        k = self._project("k_proj", x, encoder).view(shape)
        v = self._project("v_proj", x, encoder).view(shape) if self.v_proj is not None else k
        k = apply_rotary(self.k_norm(k).transpose(1, 2), cos, sin)
        return k, rms(v.transpose(1, 2), self.eps)  # a new tensor, not a view (FSDP2)

    def forward(self, x, cos, sin, mask: torch.Tensor | None,
                past: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                encoder: bool = False):  # fmt: skip
        """x (B, L, H) -> (output (B, L, H), this call's k, v); the queries attend over
        `past` K/V (B, Hkv, P, D) followed by their own, under `mask` (B or 1, 1, L, P + L)
        bool (True = may attend) or none; `encoder`: the encoder pass (its own biases)."""
        batch, length, _ = x.shape
        q = self._project("q_proj", x, encoder).view(batch, length, -1, self.head_dim)
        q = apply_rotary(self.q_norm(q).transpose(1, 2), cos, sin)
        k, v = self.keys_values(x, cos, sin, encoder)
        keys, values = k, v
        if past is not None:
            keys, values = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        out = attend(q, keys, values.to(q.dtype), AttentionMask("sdpa", dense=mask), scale=1.0)
        return self._project("o_proj", out.transpose(1, 2).reshape(batch, length, -1),
                             encoder), (k, v)  # fmt: skip


class MLP(nn.Module):
    """Gated GELU MLP: down(gelu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """DiffusionGemma's router (module docstring)."""

    is_moe_router = True  # optim/routing.py: AdamW, not Muon

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.eps = cfg.num_experts_per_tok, cfg.rms_norm_eps
        self.root = cfg.hidden_size**-0.5
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, H) -> experts (T, k) long, weights (T, k) float32, logits (T, E); under
        autocast the logits in float32 (autocast would run the projection in bf16), else in
        the weights' dtype (as transformers)."""
        h = rms(x, self.eps) * self.scale * self.root
        if x.device.type != "meta" and torch.is_autocast_enabled(x.device.type):
            logits = router_logits(h, self.proj.weight)
        else:
            logits = self.proj(h)
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights * self.per_expert_scale[experts], logits


class Experts(nn.Module):
    """E gated-GELU experts as stacks; tokens sorted by expert, one grouped GEMM
    (`torch._grouped_mm`) or one matmul per expert (`moe_implementation`). An expert block
    of parallel/expert.py: under expert parallelism the stacks are DTensors split on the
    expert dim and `expert_parallel` sends the sorted rows to their experts' ranks."""

    # its expert stacks: what expert parallelism splits and LoRA's `experts` adapts (as
    # models/moe.py SparseMoE.expert_stacks)
    expert_stacks = ("gate_up_proj", "down_proj")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        experts, hidden = cfg.num_experts, cfg.hidden_size
        inner = cfg.resolved_moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inner))
        self.top_k, self.implementation = cfg.num_experts_per_tok, cfg.moe_implementation
        self.num_experts = experts
        self.expert_parallel = None  # an ExpertShard (parallel/expert.py shard_experts)

    def active_matmul_params(self) -> int:
        """Matmul weights one token uses: its top-k experts (train/mfu.py counts these; the
        router is an nn.Linear, counted as one)."""
        hidden, inner = self.down_proj.shape[1:]
        return self.top_k * 3 * inner * hidden

    def forward(self, x: torch.Tensor, experts: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """x (T, H), each token's experts and weights (T, k) -> the weighted sum (T, H),
        the k slots of a token summed in float32 in a fixed order."""
        top_k = experts.shape[1]
        chosen = experts.reshape(-1)
        order = chosen.argsort(stable=True)
        counts = expert_counts(chosen[order], self.num_experts)
        rows = x.index_select(0, order // top_k)
        if self.expert_parallel is not None:  # there, through this rank's experts, and back
            out = self.expert_parallel.run(self._local, rows, counts)
        else:
            out = self._local(rows, counts)
        unsorted = out.index_select(0, order.argsort()).float()
        y = (unsorted * weights.reshape(-1, 1)).view(-1, top_k, out.shape[-1]).sum(1)
        return y.to(x.dtype)

    def _local(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (N, H) sorted by this rank's experts, counts (local experts,) -> their
        outputs (N, H): on one process every expert, under expert parallelism the local
        part of the stacks (whose gradients stay partial sums over the replicas)."""
        if torch.is_autocast_enabled(rows.device.type):
            dtype = torch.get_autocast_dtype(rows.device.type)
            rows = rows.to(dtype)  # the stacks' copies made once a step (models/moe.py)
            gate_up, down = (expert_stack(w, dtype) for w in (self.gate_up_proj, self.down_proj))
        else:
            gate_up, down = local_experts(self.gate_up_proj), local_experts(self.down_proj)
            rows = rows.to(gate_up.dtype)
        return self._run(rows, counts, gate_up, down)

    def _run(self, rows, counts, gate_up, down) -> torch.Tensor:
        inner, hidden = down.shape[2], down.shape[1]
        grouped = self.implementation != "loop" and grouped_mm_fits(inner, hidden,
                                                                    dtype=rows.dtype)  # fmt: skip
        if self.implementation == "grouped_mm" and not grouped:
            raise ValueError("moe_implementation grouped_mm needs float32, bfloat16 or float16 "
                             "weights and hidden_size and moe_intermediate_size rows of "
                             f"multiples of 16 bytes (here {rows.dtype})")  # fmt: skip
        if grouped:
            offsets = counts.cumsum(0).to(torch.int32)
            gate, up = torch._grouped_mm(_ContiguousGrad.apply(rows), gate_up.transpose(1, 2),
                                         offs=offsets).chunk(2, dim=-1)  # fmt: skip
            return torch._grouped_mm(gelu(gate) * up, down.transpose(1, 2), offs=offsets)
        outputs, start = [], 0
        for expert, count in enumerate(counts.tolist()):
            part = rows[start : start + count]
            start += count
            gate, up = (part @ gate_up[expert].T).chunk(2, dim=-1)
            outputs.append((gelu(gate) * up) @ down[expert].T)
        return torch.cat(outputs)


class DiffusionGemmaLayer(nn.Module):
    """One layer of the shared stack (module docstring); `encoder` picks its layer scalar."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, index)
        self.mlp = MLP(hidden, cfg.intermediate_size)
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "pre_feedforward_layernorm_2",
                     "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"):  # fmt: skip
            setattr(self, name, RMSNorm(hidden, eps))
        self.register_buffer("layer_scalar", torch.ones(1))
        self.register_buffer("encoder_layer_scalar", torch.ones(1))

    def forward(self, x, cos, sin, mask, past=None, *, encoder: bool = False,
                keys_only: bool = False):  # fmt: skip
        """x (B, L, H) -> (x, this layer's k, v for the cache); keys_only: (None, its k, v)
        and nothing else computed (the encoder's last layer: through the module's call, so
        FSDP2's hooks gather its weights)."""
        if keys_only:
            return None, self.self_attn.keys_values(self.input_layernorm(x), cos, sin, encoder)
        # encoder by keyword: tensor parallelism prepares the call's 5 positional inputs
        attended, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, past,
                                      encoder=encoder)  # fmt: skip
        x = x + self.post_attention_layernorm(attended)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
        flat = x.reshape(-1, x.shape[-1])
        experts, weights, _ = self.router(flat)
        routed = self.experts(self.pre_feedforward_layernorm_2(flat), experts, weights)
        routed = self.post_feedforward_layernorm_2(routed.view(x.shape))
        x = x + self.post_feedforward_layernorm(dense + routed)
        return x * (self.encoder_layer_scalar if encoder else self.layer_scalar), kv


class SelfConditioning(nn.Module):
    """The previous step's soft embeddings through a gated MLP, added to the canvas
    embedding, then a weightless RMSNorm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.pre_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor | None) -> torch.Tensor:
        if soft is not None:  # none: the MLP of zeros is zero
            h = self.pre_norm(soft)
            embeds = embeds + self.down_proj(gelu(self.gate_proj(h)) * self.up_proj(h))
        return rms(embeds, self.eps)


class DiffusionGemmaStack(nn.Module):
    """The `model.` prefix: embedding, layers, final norm, self-conditioning."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DiffusionGemmaLayer(cfg, i)
                                    for i in range(cfg.num_hidden_layers))  # fmt: skip
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_conditioning = SelfConditioning(cfg)


class DiffusionGemma(nn.Module):
    """DiffusionGemma: `forward(prompt, canvas, self_conditioning_logits)` -> canvas logits;
    `encode` / `decode` split it for sampling (module docstring)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.section = cfg.diffusion_gemma
        self.model = DiffusionGemmaStack(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.init_weights()

    def tie_weights(self) -> None:
        """The LM head is the embedding (always tied in this family)."""
        self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """normal(0, initializer_range) for linear, embedding and expert weights, zero
        biases, unit norms, router scales and layer scalars. Nothing on the meta device."""
        if self.lm_head.weight.is_meta:
            return
        std = self.config.initializer_range
        for module in self.modules():
            if init_common(module, std):
                continue
            if isinstance(module, Router):
                module.scale.fill_(1.0)
                module.per_expert_scale.fill_(1.0)
            elif isinstance(module, Experts):
                module.gate_up_proj.normal_(0.0, std)
                module.down_proj.normal_(0.0, std)
            elif isinstance(module, DiffusionGemmaLayer):
                module.layer_scalar.fill_(1.0)
                module.encoder_layer_scalar.fill_(1.0)
            elif isinstance(module, Attention):
                for name in ENCODER_BIASES:
                    bias = getattr(module, f"encoder_{name}_bias", None)
                    if bias is not None:
                        bias.zero_()

    # -- the two passes ------------------------------------------------------------------------

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows x sqrt(hidden), the scale rounded to the weight's dtype (as
        transformers); then in autocast's dtype where it is on."""
        weight = self.model.embed_tokens.weight
        x = self.model.embed_tokens(ids) * self._embed_scale(weight.dtype)
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return x

    def _embed_scale(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32).to(dtype)

    def _tables(self, position_ids: torch.Tensor) -> dict[bool, tuple]:
        """RoPE tables of the sliding (True) and full (False) layers."""
        cfg, section = self.config, self.section
        return {
            True: rope_tables(position_ids, cfg.resolved_head_dim, cfg.rope_theta),
            False: rope_tables(position_ids, section.resolved_global_head_dim(cfg),
                               section.global_rope_theta, section.global_partial_rotary_factor),
        }  # fmt: skip

    def encode(self, input_ids: torch.Tensor, cache: PromptCache | None = None,
               position_ids: torch.Tensor | None = None,
               prompt_mask: torch.Tensor | None = None,
               images: Images | None = None) -> PromptCache:  # fmt: skip
        """The encoder pass: input_ids (B, n) after the `cache`'s tokens (None: a new prompt),
        causal over them; returns the cache extended by them (a new object). position_ids
        (B, n): their RoPE positions (None: cache.length onward). prompt_mask (B, n) bool:
        False marks padding, which no later token attends to (None: all real). images: the
        prompts' pictures (models/diffusion_gemma_vision.py), a new prompt's only."""
        batch, count = input_ids.shape
        device = input_ids.device
        start = 0 if cache is None else cache.length
        if position_ids is None:
            position_ids = torch.arange(start, start + count, device=device).expand(batch, -1)
        mask = _joined_mask(cache, prompt_mask, batch, count, device)
        tables = self._tables(position_ids)
        window = self.section.sliding_window
        x = self._embed(input_ids)
        groups = None
        if images is not None:
            if cache is not None:
                raise InputError("images go with a new prompt, not with tokens appended to a cache")
            vision = require_vision(self)
            x, groups = vision.insert(x, input_ids, images), vision.groups(input_ids)
        # the residual stream's dtype, kept between layers: under autocast a layer's output is
        # float32 (its float32 layer scalar), and a compiled layer would see a new input dtype
        stream = x.dtype
        keys, values = [], []
        layers = self.model.layers
        for index, layer in enumerate(layers):
            sliding = layer.self_attn.sliding
            past = None if cache is None else (cache.keys[index], cache.values[index])
            cos, sin = tables[sliding]
            if index == len(layers) - 1:  # only its K/V are read: no MLP, no final norm
                _, (k, v) = layer(x, cos, sin, None, encoder=True, keys_only=True)
            else:
                kept = 0 if past is None else past[0].shape[2]
                allowed = _encoder_mask(start, count, kept, window if sliding else None,
                                        mask, device)  # fmt: skip
                if groups is not None:  # each image's tokens see each other
                    allowed = allowed | _same_image(groups)
                x, (k, v) = layer(x, cos, sin, allowed, past, encoder=True)
                x = x.to(stream)
            if past is not None:
                k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
            if sliding:  # what transformers' sliding cache keeps
                k, v = k[:, :, -(window - 1) :], v[:, :, -(window - 1) :]
            keys.append(k)
            values.append(v)
        return PromptCache(keys, values, start + count, mask)

    def decode(self, canvas_ids: torch.Tensor, cache: PromptCache,
               self_conditioning_logits: torch.Tensor | None = None,
               self_conditioning_mask: torch.Tensor | None = None,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """The decoder pass: canvas_ids (B, C) after the encoded tokens of `cache` ->
        soft-capped logits (B, C, V) float32. self_conditioning_logits (B, C, V): the
        previous step's logits (None: the first step); self_conditioning_mask (B,) bool:
        rows whose signal is dropped (False). position_ids (B, C): None = cache.length on."""
        batch, length = canvas_ids.shape
        if position_ids is None:
            position_ids = torch.arange(cache.length, cache.length + length,
                                        device=canvas_ids.device).expand(batch, -1)  # fmt: skip
        x = self._embed(canvas_ids)
        soft = None
        if self_conditioning_logits is not None:
            weight = self.model.embed_tokens.weight
            probs = self_conditioning_logits.softmax(dim=-1, dtype=torch.float32)
            soft = (probs.to(weight.dtype) @ weight) * self._embed_scale(weight.dtype).to(x.dtype)
            if self_conditioning_mask is not None:
                soft = soft * self_conditioning_mask.to(soft.dtype)[:, None, None]
        x = self.model.self_conditioning(x, soft)
        stream = x.dtype  # kept between layers, as in encode
        tables = self._tables(position_ids)
        for index, layer in enumerate(self.model.layers):
            past = (cache.keys[index], cache.values[index])
            allowed = None
            if cache.mask is not None:  # padding keys: the kept ones, then the canvas's own
                kept = cache.mask[:, cache.length - past[0].shape[2] :]
                keys = torch.cat((kept, kept.new_ones(batch, length)), dim=1)
                allowed = keys[:, None, None, :].expand(batch, 1, length, keys.shape[1])
            x, _ = layer(x, *tables[layer.self_attn.sliding], allowed, past)
            x = x.to(stream)
        logits = self.lm_head(self.model.norm(x)).float()
        cap = self.section.final_logit_softcapping
        return torch.tanh(logits / cap) * cap

    def forward(self, input_ids: torch.Tensor, canvas_ids: torch.Tensor | None = None,
                self_conditioning_logits: torch.Tensor | None = None,
                self_conditioning_mask: torch.Tensor | None = None,
                prompt_mask: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None,
                canvas_position_ids: torch.Tensor | None = None,
                self_condition: torch.Tensor | None = None,
                targets: torch.Tensor | None = None,
                target_weights: torch.Tensor | None = None, images: Images | None = None,
                **decoder_call) -> torch.Tensor:  # fmt: skip
        """Canvas logits (B, C, V) float32 for prompts input_ids (B, L) and canvases
        canvas_ids (B, C): `decode(canvas_ids, encode(input_ids))` (see both; position_ids
        (B, L) and canvas_position_ids (B, C) are their RoPE positions, None: from 0 and
        after the prompt).

        Training: `self_condition` (B,) bool runs the two-pass self-conditioning (a first
        decoder pass under no_grad without a signal; its logits are the signal of the rows
        marked True in the second, the others get none; instead of self_conditioning_logits).
        `targets` (B, C) long (-100: not scored) returns the cross-entropy per canvas
        position (B, C) float32 (0 where not scored) instead of the logits; with
        `target_weights` (B, C) too, their weighted sum (0-d).

        Called as `DiffusionTransformer` is (one row of tokens: doc_ids, a KV cache, no
        canvas), it refuses in one line."""
        if canvas_ids is None or decoder_call:
            raise InputError(
                "model_type diffusion_gemma is called as model(prompt_ids, canvas_ids, "
                "self_conditioning_logits): a prompt encoder and a canvas decoder, not one row "
                "of tokens; train it with diffusion.objective uniform"
            )
        if self_condition is not None and self_conditioning_logits is not None:
            raise ValueError("give self_condition (two passes) or self_conditioning_logits")
        cache = self.encode(input_ids, position_ids=position_ids, prompt_mask=prompt_mask,
                            images=images)  # fmt: skip
        if self_condition is not None:
            with torch.no_grad():  # pass 1 on every row, so every rank runs the same passes
                # on a detached cache: the sampler's and evaluation's decoder call (a compiled
                # layer guards on its inputs' requires_grad: one graph fewer)
                self_conditioning_logits = self.decode(canvas_ids, cache.detached(),
                                                       position_ids=canvas_position_ids)  # fmt: skip
            self_conditioning_mask = self_condition
        logits = self.decode(canvas_ids, cache, self_conditioning_logits, self_conditioning_mask,
                             canvas_position_ids)  # fmt: skip
        if targets is None:
            return logits
        return canvas_cross_entropy(logits, targets, target_weights)

    def compiled_layer_graphs(self) -> int:
        """At most how many graphs `torch.compile` of the layers (train.torch_compile: each
        layer compiled whole, fullgraph) makes of the forward every layer shares, over
        training and evaluation: per kind of layer (sliding, full) the encoder's call and
        the decoder's, each with and without gradients (the self-conditioning pass and
        evaluation run under no_grad, on a detached cache), and the encoder's last layer
        (keys only) both ways; twice that once sizes change (the static graph, then a
        dynamic one). Above torch's default recompile limit (8) for most stacks: the
        trainer raises the limit to this."""
        kinds = len({layer.self_attn.sliding for layer in self.model.layers})
        return 2 * (2 * kinds + 2 * kinds + 2)

    @property
    def canvas_length(self) -> int:
        """Tokens of one canvas (`model.diffusion_gemma.canvas_length`)."""
        return self.section.canvas_length

    # -- counts and folders --------------------------------------------------------------------

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters (the tied head counts once)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.model.embed_tokens.weight.numel()
        return total

    def num_active_parameters(self) -> int:
        """Parameters one token uses: all but the experts it is not routed to."""
        experts = [m for m in self.modules() if isinstance(m, Experts)]
        stacks = sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in experts)
        return self.num_parameters() - stacks + sum(m.active_matmul_params() for m in experts)

    def save_pretrained(self, folder: str) -> None:
        """Write a transformers `diffusion_gemma` folder (config.json + model.safetensors)."""
        save_pretrained(self, folder)


def canvas_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                         weights: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Cross-entropy of targets (B, C) (-100: not scored) under soft-capped logits (B, C, V)
    float32, in float32 over the whole vocabulary (a canvas is short): per position (B, C),
    0 where not scored; given weights (B, C), the weighted sum (0-d) of the scored ones."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                         reduction="none").view(targets.shape)  # fmt: skip
    if weights is None:
        return ce
    return torch.where(targets != -100, ce * weights.float(), 0.0).sum()


def _joined_mask(cache: PromptCache | None, prompt_mask: torch.Tensor | None, batch: int,
                 count: int, device: torch.device) -> torch.Tensor | None:  # fmt: skip
    """The (B, all tokens) padding mask after this call, or None when nothing is padding."""
    before = None if cache is None else cache.mask
    if before is None and prompt_mask is None:
        return None
    if before is None:
        before = torch.ones(batch, 0 if cache is None else cache.length, dtype=torch.bool,
                            device=device)  # fmt: skip
    if prompt_mask is None:
        prompt_mask = torch.ones(batch, count, dtype=torch.bool, device=device)
    return torch.cat((before, prompt_mask.to(device=device, dtype=torch.bool)), dim=1)


def _same_image(groups: torch.Tensor) -> torch.Tensor:
    """(B, 1, L, L) bool: query and key in the same run of image tokens (groups (B, L): the
    run's index, -1 for text)."""
    same = (groups[:, :, None] == groups[:, None, :]) & (groups[:, :, None] >= 0)
    return same[:, None]


def _encoder_mask(start: int, count: int, kept: int, window: int | None,
                  padding: torch.Tensor | None, device: torch.device) -> torch.Tensor:  # fmt: skip
    """(B or 1, 1, count, kept + count) bool: the encoder's new tokens [start, start + count)
    attend causally to the `kept` cached tokens before them and to each other, within
    `window` tokens (themselves included) on sliding layers, never to padding (but always to
    themselves, so a padding row is not empty)."""
    query = torch.arange(start, start + count, device=device)[:, None]
    key = torch.arange(start - kept, start + count, device=device)[None, :]
    allowed = key <= query
    if window is not None:
        allowed &= query - key < window
    allowed = allowed[None, None]
    if padding is not None:
        allowed = (allowed & padding[:, None, None, start - kept :]) | (key == query)[None, None]
    return allowed
