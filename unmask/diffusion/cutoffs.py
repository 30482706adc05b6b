"""Batch reshaping done before noising: LLaDA's random length, Dream's answer cutoffs.

All act on a batch dict of (B, L) tensors (`input_ids`, optional `doc_ids`, `position_ids`,
`maskable`) and return a new dict; the batch layout is described in unmask/data/packing.py.
"""

import torch

from unmask.host import host_read

_ROW_KEYS = ("input_ids", "doc_ids", "position_ids", "maskable")


def _slice_columns(batch: dict, length: int) -> dict:
    return {k: (v[:, :length] if k in _ROW_KEYS else v) for k, v in batch.items()}


def random_length_cut(batch: dict, prob: float, seed: int, step: int) -> dict:
    """With probability `prob`, cut every row to one length drawn from [1, L].

    The draw comes from a CPU generator seeded by (seed, step) only, so every rank and every
    micro-batch of one optimizer step cuts the same way (LLaDA: prob = 0.01).
    """
    if prob <= 0:
        return batch
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(step))
    length = batch["input_ids"].shape[1]
    with host_read():  # draws of a CPU generator: no device is waited for
        fire = torch.rand((), generator=gen).item() < prob
        new_length = int(torch.randint(1, length + 1, (), generator=gen))
    return _slice_columns(batch, new_length) if fire else batch


def prompt_positions(maskable: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
    """Prompt tokens: not maskable and before the first maskable token of their document.

    maskable (B, L) bool, doc_ids (B, L) or None -> (B, L) bool. Padding after an answer and
    documents without any maskable token (packing fill) are not prompt.
    """
    batch, length = maskable.shape
    suffix = maskable.flip(1).long().cumsum(1).flip(1)  # maskable tokens at or after i
    suffix = torch.cat([suffix, suffix.new_zeros(batch, 1)], dim=1)  # (B, L + 1)
    if doc_ids is None:
        next_start = torch.full_like(suffix[:, :length], length)
    else:
        cols = torch.arange(length, device=maskable.device).expand(batch, length)
        starts = torch.zeros_like(maskable)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        start_col = torch.where(starts, cols, torch.full_like(cols, length))
        # next_start[i] = first document start after i (L when none)
        shifted = torch.cat([start_col[:, 1:], start_col.new_full((batch, 1), length)], dim=1)
        next_start = shifted.flip(1).cummin(1).values.flip(1)
    later = (suffix[:, :length] - suffix.gather(1, next_start)) > 0
    return ~maskable & later


def document_starts(batch: dict) -> torch.Tensor:
    """(B, L) bool: the first token of each document (position id 0, or column 0)."""
    position_ids = batch.get("position_ids")
    if position_ids is not None:
        return position_ids == 0
    starts = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
    starts[:, 0] = True
    doc_ids = batch.get("doc_ids")
    if doc_ids is not None:
        starts[:, 1:] |= doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts


def perbatch_cutoff(batch: dict, generator: torch.Generator | None) -> dict:
    """Dream's per-batch cutoff: pick one answer length among the rows, trim every answer.

    Answer length = maskable tokens per row. Trimmed answer tokens are moved to their own
    document id (hidden from the kept tokens), made not maskable, and trailing columns no
    row needs are dropped.
    """
    maskable = batch["maskable"].bool()
    lengths = maskable.sum(1)  # (B,)
    pick = torch.randint(0, lengths.numel(), (1,), generator=generator, device=lengths.device)
    kept = lengths[pick]  # (1,)
    rank = maskable.long().cumsum(1)  # 1-based rank of each answer token
    trimmed = maskable & (rank > kept)
    out = dict(batch)
    doc_ids = batch.get("doc_ids")
    if doc_ids is None:
        doc_ids = torch.zeros_like(batch["input_ids"])
    if out.get("position_ids") is None:
        cols = torch.arange(maskable.shape[1], device=maskable.device)
        out["position_ids"] = cols.expand_as(batch["input_ids"]).clone()
    hidden_id = doc_ids.max() + 1
    out["doc_ids"] = torch.where(trimmed, hidden_id, doc_ids)
    out["maskable"] = maskable & ~trimmed
    used = (~trimmed).long() * torch.arange(1, maskable.shape[1] + 1, device=maskable.device)
    return _slice_columns(out, int(used.max()))


def resp_cutoff(batch: dict, ratio: float, generator: torch.Generator | None) -> dict:
    """With probability `ratio`, chop k in [1, shortest answer - 1] columns off the batch end."""
    if ratio <= 0:
        return batch
    device = batch["input_ids"].device
    fire = torch.rand((), generator=generator, device=device).item() < ratio
    min_len = int(batch["maskable"].bool().sum(1).min())
    if not fire or min_len < 2:
        return batch
    k = int(torch.randint(1, min_len, (), generator=generator, device=device))
    return _slice_columns(batch, batch["input_ids"].shape[1] - k)
