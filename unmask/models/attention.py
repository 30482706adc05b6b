"""Bidirectional attention backends with document masks for packed rows.

A packed row holds several documents; a token attends only to tokens with the same
document id, so attention is block-diagonal per document. Two kernels compute the same
thing: `sdpa` (scaled_dot_product_attention with a dense boolean mask) and `flex`
(flex_attention with a sparse block mask). The mask is built once per forward and
shared by every layer.
"""

import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # torch without flex attention
    create_block_mask = flex_attention = None

_compiled_flex: Any = None


@dataclass
class AttentionMask:
    """What every layer needs to attend: the backend and its document mask.

    dense: (B, 1, L, L) bool for sdpa (True = may attend), None = full attention.
    block: a flex BlockMask, None = full attention.
    context: context parallelism (unmask.parallel.context.ContextShard) or None: q, k, v
    hold this rank's slice of each row and attention runs over whole rows by heads (the
    masks above are then the whole rows').
    """

    backend: str
    dense: torch.Tensor | None = None
    block: Any = None
    context: Any = None


#: the compiled (Triton) flex kernel refuses smaller heads: "NYI: embedding dimension of the
#: query, key, and value must be at least 16" (seen on an H200 with torch 2.11)
FLEX_MIN_HEAD_DIM = 16


def flex_usable(device: torch.device, head_dim: int = FLEX_MIN_HEAD_DIM) -> bool:
    """True where flex attention runs as a fused compiled kernel (CUDA, heads of at least
    FLEX_MIN_HEAD_DIM).

    On CPU flex runs only unfused (it materializes the scores) or after a slow inductor
    compile, so `auto` picks sdpa there; `flex` still works on CPU for tests.
    """
    return flex_attention is not None and device.type == "cuda" and head_dim >= FLEX_MIN_HEAD_DIM


def resolve_backend(
    name: str, doc_ids: torch.Tensor | None, device: torch.device, head_dim: int
) -> str:
    """Map "auto" to a concrete backend: flex for packed rows where usable, else sdpa."""
    if name == "auto":
        return "flex" if doc_ids is not None and flex_usable(device, head_dim) else "sdpa"
    if name == "flex" and flex_attention is None:
        raise RuntimeError("attn_implementation=flex needs torch>=2.5 (flex_attention)")
    if name not in ("sdpa", "flex"):
        raise ValueError(f"unknown attention backend {name!r}; use auto, sdpa or flex")
    return name


def build_attention_mask(doc_ids: torch.Tensor | None, backend: str) -> AttentionMask:
    """Document mask for one forward. doc_ids: (B, L) long, or None for full attention."""
    if doc_ids is None:
        return AttentionMask(backend)
    if backend == "sdpa":
        return AttentionMask(backend, dense=(doc_ids[:, :, None] == doc_ids[:, None, :])[:, None])
    batch, length = doc_ids.shape

    def same_document(b, h, q_idx, kv_idx):
        return doc_ids[b, q_idx] == doc_ids[b, kv_idx]

    block = create_block_mask(same_document, batch, None, length, length, device=doc_ids.device)
    return AttentionMask(backend, block=block)


def _flex_function(device: torch.device, head_dim: int):
    """Compiled flex on CUDA (compiled once, lazily); the unfused eager path elsewhere and
    for heads the compiled kernel refuses (an explicit `flex` with head_dim < 16)."""
    global _compiled_flex
    if not flex_usable(device, head_dim):
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, scale: float
) -> torch.Tensor:
    """Non-causal attention. q: (B, Hq, L, D), k/v: (B, Hkv, L, D) -> (B, Hq, L, D)."""
    if mask.context is not None:  # context parallelism: L is this rank's slice
        whole = replace(mask, context=None)
        return mask.context.attend(q, k, v, lambda q, k, v: attend(q, k, v, whole, scale))
    if mask.backend == "flex":
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*flex_attention called without torch.compile"
            )
            return _flex_function(q.device, q.shape[-1])(
                q, k, v, block_mask=mask.block, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
            )
    groups = q.shape[1] // k.shape[1]
    gqa = groups > 1 and sdpa_gqa_usable(q.device, mask.dense is not None)
    if groups > 1 and not gqa:  # explicit GQA expansion: every sdpa kernel accepts it
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.dense, scale=scale, enable_gqa=gqa
    )


def sdpa_gqa_usable(device: torch.device, masked: bool) -> bool:
    """True where sdpa's `enable_gqa` reads the shared K/V heads in its fused kernel, so
    they need not be repeated per query head: CPU (flash, with or without a mask) and any
    device without a mask. With a mask on CUDA only the math kernel takes enable_gqa, so
    the K/V heads are repeated there and the memory-efficient kernel runs instead."""
    return device.type == "cpu" or not masked


@dataclass
class KVCache:
    """Per-layer keys/values of a whole canvas, for diffusion sampling with caching.

    A forward with `store=True` must cover the whole canvas (B, L): every layer records its
    K/V (after RoPE). A later forward feeds only the tokens at [start, start + Lq) of the
    canvas: each layer computes fresh K/V for them, puts them in place of the cached ones
    (kept in the cache) and attends over the full length L. Prefix caching feeds
    [block_start, L); dual caching feeds only the current block.
    """

    keys: list = None  # per layer (B, Hkv, L, D)
    values: list = None
    start: int = 0
    store: bool = True

    def __post_init__(self) -> None:
        self.keys = [] if self.keys is None else self.keys
        self.values = [] if self.values is None else self.values

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Record (store) or splice in (use) this layer's fresh k/v; returns full-length k, v."""
        if self.store:
            if layer == len(self.keys):
                self.keys.append(k)
                self.values.append(v)
            else:
                self.keys[layer], self.values[layer] = k, v
            return k, v
        stop = self.start + k.shape[2]
        keys, values = self.keys[layer], self.values[layer]
        keys[:, :, self.start : stop] = k
        values[:, :, self.start : stop] = v
        return keys, values

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (finished rows leave the batch)."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
