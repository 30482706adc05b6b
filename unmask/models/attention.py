"""Bidirectional attention backends with document masks for packed rows.

A packed row holds several documents; a token attends only to tokens with the same
document id, so attention is block-diagonal per document. Three kernels compute the same
thing: `sdpa` (scaled_dot_product_attention with a dense (B, 1, L, L) boolean mask, which
CPU sdpa turns into a float matrix it keeps for backward), `flex` (flex_attention with a
sparse block mask; fused only when compiled on CUDA, no backward on CPU) and `varlen`
(one unmasked sdpa call per document, on views of q, k, v: O(L) memory, no L x L mask).
The mask is built once per forward and shared by every layer.
"""

import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # torch without flex attention
    create_block_mask = flex_attention = None

_compiled_flex: Any = None
_compiled_block_mask: Any = None  # torch.compile(create_block_mask), or False once it failed


@dataclass
class AttentionMask:
    """What every layer needs to attend: the backend and its document mask.

    dense: (B, 1, L, L) bool for sdpa (True = may attend), None = full attention.
    block: a flex BlockMask, None = full attention.
    documents: for varlen, `document_runs(doc_ids)`; None = full attention.
    context: context parallelism (unmask.parallel.context.ContextShard) or None: q, k, v
    hold this rank's slice of each row and attention runs over whole rows by heads (the
    masks above are then the whole rows').
    doc_ids: (B, L) document ids behind `block` / `documents` (None: full attention, or
    `dense` says it): what `head_max_logits` masks with.
    """

    backend: str
    dense: torch.Tensor | None = None
    block: Any = None
    documents: tuple | None = None
    context: Any = None
    doc_ids: torch.Tensor | None = None


#: the compiled (Triton) flex kernel refuses smaller heads: "NYI: embedding dimension of the
#: query, key, and value must be at least 16" (seen on an H200 with torch 2.11)
FLEX_MIN_HEAD_DIM = 16


def flex_usable(device: torch.device, head_dim: int = FLEX_MIN_HEAD_DIM) -> bool:
    """True where flex attention runs as a fused compiled kernel (CUDA, heads of at least
    FLEX_MIN_HEAD_DIM).

    On CPU flex runs only unfused (it materializes the scores) or after a slow inductor
    compile, and has no backward either way (torch 2.13), so `auto` picks varlen there;
    `flex` still runs forwards on CPU for tests.
    """
    return flex_attention is not None and device.type == "cuda" and head_dim >= FLEX_MIN_HEAD_DIM


def resolve_backend(
    name: str, doc_ids: torch.Tensor | None, device: torch.device, head_dim: int
) -> str:
    """Map "auto" to a concrete backend: for packed rows flex where usable (CUDA, heads the
    compiled kernel takes), else varlen; sdpa without document ids (one unmasked call)."""
    if name == "auto":
        if doc_ids is None:
            return "sdpa"
        return "flex" if flex_usable(device, head_dim) else "varlen"
    if name == "flex" and flex_attention is None:
        raise RuntimeError("attn_implementation=flex needs torch>=2.5 (flex_attention)")
    if name not in ("sdpa", "flex", "varlen"):
        raise ValueError(f"unknown attention backend {name!r}; use auto, sdpa, flex or varlen")
    return name


def document_runs(doc_ids: torch.Tensor) -> tuple:
    """Each row's documents for `varlen`: rows[b] is a tuple of documents in order of first
    appearance, each a tuple of its (start, stop) runs of consecutive tokens (one run for
    packed rows; a document id that comes back after another's tokens has several, and
    they attend to each other as in the dense mask). doc_ids: (B, L); one read of them to
    the host per forward (a device sync on a GPU, where `auto` takes flex unless its heads
    are too small for the compiled kernel)."""
    rows = []
    for ids in doc_ids.tolist():  # the one read from the device
        documents: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for index in range(1, len(ids) + 1):
            if index == len(ids) or ids[index] != ids[start]:
                documents.setdefault(ids[start], []).append((start, index))
                start = index
        rows.append(tuple(tuple(runs) for runs in documents.values()))
    return tuple(rows)


def build_attention_mask(doc_ids: torch.Tensor | None, backend: str) -> AttentionMask:
    """Document mask for one forward. doc_ids: (B, L) long, or None for full attention."""
    if doc_ids is None:
        return AttentionMask(backend)
    if backend == "sdpa":
        return AttentionMask(backend, dense=(doc_ids[:, :, None] == doc_ids[:, None, :])[:, None])
    if backend == "varlen":
        return AttentionMask(backend, documents=document_runs(doc_ids), doc_ids=doc_ids)
    batch, length = doc_ids.shape

    def same_document(b, h, q_idx, kv_idx):
        return doc_ids[b, q_idx] == doc_ids[b, kv_idx]

    block = _block_mask(same_document, batch, length, doc_ids.device)
    return AttentionMask(backend, block=block, doc_ids=doc_ids)


def _block_mask(mask_mod, batch: int, length: int, device: torch.device):
    """flex's BlockMask of mask_mod: on CUDA through a compiled create_block_mask (one graph
    per (rows, length), as torchtitan builds them: the eager one evaluates mask_mod on every
    (query, key) pair, a (B, L, L) tensor per forward); eagerly elsewhere, and from then on
    if compiling it fails (said once)."""
    global _compiled_block_mask
    if device.type == "cuda" and _compiled_block_mask is not False:
        if _compiled_block_mask is None:
            _compiled_block_mask = torch.compile(create_block_mask, dynamic=False)
        try:
            return _compiled_block_mask(mask_mod, batch, None, length, length, device=device)
        except Exception as err:  # a compiler failure: the eager path works
            warnings.warn(f"unmask: the compiled flex block mask failed ({type(err).__name__}: "
                          f"{err}); building block masks eagerly", stacklevel=2)  # fmt: skip
            _compiled_block_mask = False
    return create_block_mask(mask_mod, batch, None, length, length, device=device)


def _flex_function(device: torch.device, head_dim: int):
    """Compiled flex on CUDA (compiled once, lazily); the unfused eager path elsewhere and
    for heads the compiled kernel refuses (an explicit `flex` with head_dim < 16)."""
    global _compiled_flex
    if not flex_usable(device, head_dim):
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


#: called with each attention's per-head max logit (Hq,) and the index of its first head
LogitRecord = Callable[[torch.Tensor, int], None]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    scale: float,
    record: LogitRecord | None = None,
) -> torch.Tensor:
    """Non-causal attention. q: (B, Hq, L, D), k/v: (B, Hkv, L, D) -> (B, Hq, L, D).

    record (QK-clip's capture): called with `head_max_logits` of q and k over whole rows
    and the index of the first of those heads among this rank's (under context
    parallelism a rank attends with heads [rank * Hq / cp, (rank + 1) * Hq / cp))."""
    if mask.context is not None:  # context parallelism: L is this rank's slice
        whole = replace(mask, context=None)
        shard = mask.context
        inner = None
        if record is not None:
            first = shard.rank * (q.shape[1] // shard.size)
            inner = lambda values, start: record(values, first + start)  # noqa: E731
        return shard.attend(q, k, v, lambda q, k, v: attend(q, k, v, whole, scale, inner))
    if record is not None:
        record(head_max_logits(q, k, mask, scale), 0)
    if mask.backend == "flex":
        if torch.compiler.is_compiling():  # inside a compiled block: flex is traced with it
            return flex_attention(q, k, v, block_mask=mask.block, scale=scale,
                                  enable_gqa=k.shape[1] != q.shape[1])  # fmt: skip
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*flex_attention called without torch.compile"
            )
            return _flex_function(q.device, q.shape[-1])(
                q, k, v, block_mask=mask.block, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
            )
    if mask.documents is not None:
        return attend_documents(q, k, v, mask.documents, scale)
    return _sdpa(q, k, v, mask.dense, scale)


#: most score elements one chunk of `head_max_logits` holds (float32: 64 MiB)
LOGIT_CHUNK_NUMEL = 1 << 24


def head_max_logits(
    q: torch.Tensor, k: torch.Tensor, mask: AttentionMask, scale: float
) -> torch.Tensor:
    """The largest pre-softmax logit q . k * scale of each query head, over every batch row
    and every (query, key) pair the mask lets attend (what the softmax sees; masked pairs
    left out): (Hq,) float32, without gradient. q: (B, Hq, L, D), k: (B, Hkv, L, D) (query
    head h reads key head h // (Hq / Hkv), as `attend`). Computed from q and k, so the
    same for every backend, in float32 (autocast off), by query chunks of at most
    LOGIT_CHUNK_NUMEL scores: no (B, H, L, L) tensor beyond one chunk."""
    batch, heads, length, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    dense, doc_ids = mask.dense, mask.doc_ids
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        qg = q.detach().float().reshape(batch, kv_heads, heads // kv_heads, length, dim)
        kt = k.detach().float().transpose(-1, -2)[:, :, None]  # (B, Hkv, 1, D, Lk)
        step = max(1, LOGIT_CHUNK_NUMEL // max(1, batch * heads * keys))
        best = torch.full((kv_heads, heads // kv_heads), -math.inf, device=q.device)
        for start in range(0, length, step):
            rows = slice(start, min(start + step, length))
            scores = torch.matmul(qg[:, :, :, rows], kt) * scale  # (B, Hkv, G, c, Lk)
            allowed = None
            if dense is not None:  # sdpa's mask: (L, Lk) or (B or 1, 1 or Hq, L, Lk)
                allowed = _grouped(dense, rows, kv_heads)
            elif doc_ids is not None:
                allowed = (doc_ids[:, rows, None] == doc_ids[:, None, :])[:, None, None]
            if allowed is not None and allowed.dtype == torch.bool:
                scores = scores.masked_fill(~allowed, -math.inf)
            elif allowed is not None:  # an additive float mask, as sdpa adds it
                scores = scores + allowed.float()
            best = torch.maximum(best, scores.amax(dim=(0, 3, 4)))
    return best.reshape(heads)


def _grouped(dense: torch.Tensor, rows: slice, kv_heads: int) -> torch.Tensor:
    """Query rows `rows` of an sdpa mask, shaped to broadcast with (B, Hkv, G, c, Lk)."""
    if dense.dim() == 2:
        dense = dense[None, None]
    part = dense[:, :, rows]
    if part.shape[1] == 1:
        return part[:, :, None]
    return part.reshape(part.shape[0], kv_heads, -1, *part.shape[2:])


def _sdpa(q, k, v, dense: torch.Tensor | None, scale: float) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    gqa = groups > 1 and sdpa_gqa_usable(q.device, dense is not None)
    if groups > 1 and not gqa:  # explicit GQA expansion: every sdpa kernel accepts it
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale, enable_gqa=gqa)


_uncompiled_attend_documents: Any = None


def attend_documents(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: tuple, scale: float
) -> torch.Tensor:
    """varlen: one unmasked sdpa call per document of each row (`document_runs`) on views
    of q, k, v, the outputs put back in token order. Rows with the same documents go
    through together. Nothing of size L x L exists; autograd keeps q, k, v (views),
    each document's output and its log-sum-exp: as dense sdpa keeps, without the mask.
    Left out of torch.compile (a graph break): traced, every new document layout would be
    a new graph. The disabled wrapper is made only once the compiler is loaded, so that a
    process that never compiles (sampling) never imports it."""
    global _uncompiled_attend_documents
    if "torch._dynamo" not in sys.modules:
        return _attend_documents(q, k, v, documents, scale)
    if _uncompiled_attend_documents is None:
        _uncompiled_attend_documents = torch.compiler.disable(_attend_documents)
    return _uncompiled_attend_documents(q, k, v, documents, scale)


def _attend_documents(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: tuple, scale: float
) -> torch.Tensor:
    """attend_documents' work."""
    if all(row == documents[0] for row in documents):
        return _attend_row(q, k, v, documents[0], scale)
    rows = [
        _attend_row(q[b : b + 1], k[b : b + 1], v[b : b + 1], row, scale).transpose(1, 2)
        for b, row in enumerate(documents)
    ]
    return torch.cat(rows, dim=0).transpose(1, 2)


def _attend_row(q, k, v, row: tuple, scale: float) -> torch.Tensor:
    """Attention of rows that share the document layout `row` (see `document_runs`)."""
    if len(row) == 1 and len(row[0]) == 1:  # one document over the whole row
        return _sdpa(q, k, v, None, scale)
    pieces = []  # (start, output of the run)
    for runs in row:
        if len(runs) == 1:
            cols = slice(*runs[0])
            pieces.append((runs[0][0], _sdpa(q[:, :, cols], k[:, :, cols], v[:, :, cols], None,
                                             scale)))  # fmt: skip
            continue
        index = torch.cat([torch.arange(*run, device=q.device) for run in runs])
        out = _sdpa(*(x.index_select(2, index) for x in (q, k, v)), None, scale)
        parts = out.split([stop - start for start, stop in runs], dim=2)
        pieces.extend((start, part) for (start, _), part in zip(runs, parts))
    pieces.sort(key=lambda piece: piece[0])
    # joined as (B, L, H, D) and handed back transposed, the layout sdpa's own output has:
    # the caller's transpose(1, 2).reshape for o_proj is then a view, not a second copy
    return torch.cat([part.transpose(1, 2) for _, part in pieces], dim=1).transpose(1, 2)


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


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 where doc_ids changes along a row. (B, L) -> (B, L) long."""
    length = doc_ids.shape[1]
    index = torch.arange(length, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    last_start = torch.where(starts, index, 0).cummax(dim=1).values
    return index - last_start
