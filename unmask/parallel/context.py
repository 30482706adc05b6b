"""Context parallelism (Ulysses sequence parallelism) for bidirectional attention.

Each of the `cp` ranks of a context-parallel group holds a contiguous L/cp slice of every
row. Everything in the model but attention works token by token, so it runs on the slice as
is (RoPE with the slice's global positions). Attention needs every token: an all-to-all
turns q, k, v from (B, H, L/cp, D), all heads of this rank's tokens, into (B, H/cp, L, D),
this rank's heads for every token; attention runs over the whole row (document mask of
packed rows included, built from the row's gathered doc ids) and a second all-to-all turns
the output back. Attention is non-causal, so contiguous slices balance the work (no zig-zag
layout is needed, unlike causal ring attention).

The all-to-alls are torch's functional collectives with autograd (gradients flow back by
the opposite all-to-all); a rank sends (cp - 1)/cp of its q, k, v and attention output
per layer (`alltoall_bytes` counts them).
K/V heads fewer than cp are repeated up to cp first (DeepSpeed-Ulysses does the same);
a head count that neither divides by cp nor divides cp is refused (`check_context_parallel`).
Ring attention (for models with fewer heads than ranks) is not implemented.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from unmask.errors import InputError
from unmask.models.attention import document_positions

#: batch keys holding one value per token, (B, L): sliced along the sequence
TOKEN_KEYS = ("input_ids", "doc_ids", "position_ids", "maskable", "noisy_input_ids", "masked")


def check_context_parallel(
    cp: int, *, world_size: int, heads: int, kv_heads: int, length: int, tp: int = 1
) -> None:
    """One-line InputError when `cp` cannot split this run: it must divide the query heads
    (per tensor-parallel rank, `tp`), the row length and the world size, and divide or be
    divided by the K/V heads. Pure: called before any process group exists (the model's
    limits first, so one process reports them too)."""
    key = f"parallel.context_parallel={cp}"
    if cp < 1:
        raise InputError(f"parallel.context_parallel must be >= 1, got {cp}")
    if cp == 1:
        return
    per_tp = f" / parallel.tensor_parallel={tp}" if tp > 1 else ""
    if (heads // tp) % cp:
        raise InputError(
            f"{key} does not divide model.num_attention_heads={heads}{per_tp} (each rank "
            f"attends with 1/{cp} of the heads); pick a divisor of {heads // tp}"
        )
    kv = max(kv_heads // tp, 1)
    if kv % cp and cp % kv:
        raise InputError(
            f"{key} and model.num_key_value_heads={kv_heads}{per_tp}: neither divides the "
            f"other (K/V heads are split over, or repeated up to, the {cp} ranks); pick a "
            f"divisor or a multiple of {kv}"
        )
    if length % cp:
        raise InputError(
            f"{key} does not divide data.packing_length={length} (each rank holds 1/{cp} "
            f"of every row); use a multiple of {cp}"
        )
    if world_size % cp:
        raise InputError(
            f"{key} does not divide the world size {world_size}; launch a multiple of "
            f"{cp} processes or pick a divisor of {world_size}"
        )


def pad_rows(batch: dict, multiple: int) -> dict:
    """Whole rows (noise drawn) padded at the end to a multiple of `multiple` tokens, for
    rows cut to a random length. The padding is a document of its own (it and the real
    tokens never attend to each other), neither maskable nor masked: it adds nothing to a
    loss or a count, and the real tokens keep their positions."""
    ids = batch["input_ids"]
    rows, length = ids.shape
    extra = -length % multiple
    if extra == 0:
        return batch
    batch = dict(batch)
    if batch.get("doc_ids") is None:
        batch["doc_ids"] = torch.zeros_like(ids)
    if batch.get("maskable") is None:
        batch["maskable"] = torch.ones_like(ids, dtype=torch.bool)
    pad_doc = batch["doc_ids"].max() + 1
    for key in TOKEN_KEYS:
        value = batch.get(key)
        if value is None:
            continue
        fill = pad_doc if key == "doc_ids" else 0
        tail = torch.full((rows, extra), fill, dtype=value.dtype, device=value.device)
        batch[key] = torch.cat([value, tail], dim=1)
    return batch


@dataclass(frozen=True)
class ContextShard:
    """This rank's place in its context-parallel group: `size` ranks, this one `rank`-th,
    holding tokens [rank * L / size, (rank + 1) * L / size) of every row."""

    group: dist.ProcessGroup
    size: int
    rank: int

    @classmethod
    def from_mesh(cls, mesh, dim: str = "cp") -> ContextShard | None:
        """The shard of a mesh's `dim`; None without a mesh or when that dim has size 1."""
        if mesh is None or dim not in (mesh.mesh_dim_names or ()) or mesh[dim].size() == 1:
            return None
        sub = mesh[dim]
        return cls(sub.get_group(), sub.size(), sub.get_local_rank())

    def local(self, length: int) -> slice:
        """This rank's columns of a row of `length` (the full length) tokens."""
        part = length // self.size
        return slice(self.rank * part, (self.rank + 1) * part)

    def shard_batch(self, batch: dict) -> dict:
        """This rank's slice of every per-token tensor of a batch of whole rows. Position ids
        are filled in first (restarting at each document, as the model does), so the slice
        keeps the global positions; (B,) tensors (the noise level t) are kept whole."""
        ids = batch["input_ids"]
        length = ids.shape[1]
        if length % self.size:
            raise ValueError(f"rows of {length} tokens do not split over {self.size} cp ranks")
        if batch.get("position_ids") is None:
            doc_ids = batch.get("doc_ids")
            if doc_ids is not None:
                positions = document_positions(doc_ids)
            else:
                positions = torch.arange(length, device=ids.device).expand_as(ids)
            batch = {**batch, "position_ids": positions}
        cols = self.local(length)
        return {
            k: (v[:, cols] if k in TOKEN_KEYS and v is not None else v) for k, v in batch.items()
        }

    def sum(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """0-d tensors summed over the group (the slices' parts of a row's total)."""
        stacked = torch.stack([v.detach() for v in values])
        dist.all_reduce(stacked, group=self.group)
        return tuple(stacked.unbind(0))

    def gather_tokens(self, local: torch.Tensor) -> torch.Tensor:
        """(B, L/cp) ids of this rank -> (B, L) of the whole rows (no gradient: doc ids)."""
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Attention over whole rows from this rank's tokens: q (B, Hq, L/cp, D) and k, v
        (B, Hkv, L/cp, D) are redistributed by heads, `attention(q, k, v)` runs on
        (B, H/cp, L, D) and its output comes back as (B, Hq, L/cp, D)."""
        kv_heads = k.shape[1]
        if kv_heads < self.size:  # GQA with fewer K/V heads than ranks: one copy per rank
            k = k.repeat_interleave(self.size // kv_heads, dim=1)
            v = v.repeat_interleave(self.size // kv_heads, dim=1)
        q, k, v = (seq_to_heads(x, self) for x in (q, k, v))
        return heads_to_seq(attention(q, k, v), self)


def attach_context(model: torch.nn.Module, shard: ContextShard | None) -> None:
    """Make every native decoder inside `model` (under LoRA or FSDP2 wrappers too) take this
    rank's slice of each row: it reads `context_parallel` at each forward."""
    for module in model.modules():
        if hasattr(module, "context_parallel"):
            module.context_parallel = shard


def _all_to_all(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """Equal-split all-to-all along dim 0 with autograd (backward: the opposite one)."""
    out = funcol.all_to_all_single_autograd(x.contiguous(), None, None, shard.group)
    return funcol.wait_tensor(out)


def seq_to_heads(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """(B, H, L/cp, D), all heads of this rank's tokens -> (B, H/cp, L, D), heads
    [rank * H/cp, (rank + 1) * H/cp) of every token."""
    batch, heads, part, dim = x.shape
    cp = shard.size
    send = x.reshape(batch, cp, heads // cp, part, dim).transpose(0, 1)  # (cp, B, H/cp, Lc, D)
    got = _all_to_all(send, shard)  # chunk s: rank s's tokens, this rank's heads
    return got.permute(1, 2, 0, 3, 4).reshape(batch, heads // cp, cp * part, dim)


def heads_to_seq(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """Inverse of `seq_to_heads`: (B, H/cp, L, D) -> (B, H, L/cp, D)."""
    batch, heads_part, length, dim = x.shape
    cp = shard.size
    part = length // cp
    send = x.reshape(batch, heads_part, cp, part, dim).permute(2, 0, 1, 3, 4)  # (cp, B, Hc, Lc, D)
    got = _all_to_all(send, shard)  # chunk s: rank s's heads, this rank's tokens
    return got.transpose(0, 1).reshape(batch, cp * heads_part, part, dim)


def alltoall_bytes(
    tokens: int, heads: int, kv_heads: int, head_dim: int, layers: int, cp: int,
    element_bytes: int = 4, backward: bool = True,
) -> int:  # fmt: skip
    """Bytes one rank sends in the all-to-alls of one forward (and backward) over `tokens`
    tokens of whole rows (all ranks' tokens together). Per layer and forward, a rank sends
    (cp - 1)/cp of its q, k, v and attention output, each (tokens/cp) x heads x head_dim
    (K/V heads repeated up to cp when fewer); the backward sends as many gradients back."""
    if cp == 1:
        return 0
    kv = max(kv_heads, cp)
    per_token = (2 * heads + 2 * kv) * head_dim  # q, output; k, v
    local = tokens // cp
    sent = local * per_token * (cp - 1) // cp * element_bytes * layers
    return sent * (2 if backward else 1)
