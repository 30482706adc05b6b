"""Which source each row of a blended run comes from.

Weights w_s (normalized to sum 1) are met exactly block by block: the run's row positions
are cut into blocks of K (4096); block b holds n_s positions of source s, n_s = K w_s
rounded by largest remainders, in an order drawn from a generator seeded by (seed, b). So
the assignment of any position is a pure function of (weights, seed, position), computed in
O(K) per block, and any 10,000 consecutive rows are within a fraction of a point of the
weights.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from unmask.errors import InputError

BLOCK = 4096


def block_counts(weights: list[float], block: int = BLOCK) -> list[int]:
    """Positions per source in one block: block * w / sum(w), largest remainders rounded up,
    so the counts sum to `block`."""
    if not weights or any(not w > 0 or not math.isfinite(w) for w in weights):
        raise InputError(f"data.sources: weights must be positive numbers, got {weights}")
    total = sum(weights)
    exact = [block * w / total for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: block - sum(counts)]:
        counts[i] += 1
    return counts


class BlockMixer:
    """assign(positions) -> (source of each position, its count: how many earlier positions
    of the run went to that source), both (n,) long."""

    def __init__(self, weights: list[float], seed: int, block: int = BLOCK):
        self.counts = torch.tensor(block_counts(weights, block))
        self.seed, self.block = seed, block

    @lru_cache(maxsize=8)  # noqa: B019 - one mixer per run
    def _plan(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(source (K,), rank of the position among its source's positions in block b)."""
        sources = torch.repeat_interleave(torch.arange(len(self.counts)), self.counts)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + b)
        sources = sources[torch.randperm(self.block, generator=gen)]
        rank = torch.zeros(self.block, dtype=torch.long)
        for s in range(len(self.counts)):
            where = sources == s
            rank[where] = torch.arange(int(where.sum()))
        return sources, rank

    def assign(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        source = torch.empty_like(positions)
        count = torch.empty_like(positions)
        blocks = positions // self.block
        for b in blocks.unique().tolist():
            here = blocks == b
            plan, rank = self._plan(b)
            offset = positions[here] - b * self.block
            source[here] = plan[offset]
            count[here] = b * self.counts[plan[offset]] + rank[offset]
        return source, count
