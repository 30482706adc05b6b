"""AUP, accuracy under parallelism (d3LLM): one number for a model's accuracy across
sampler settings of growing tokens per forward (TPF), so a sampler or a distilled student
that decodes faster at the same accuracy scores higher, and one that buys speed with
accuracy is penalized.

For points (rho_i, y_i) sorted by rho (TPF) with y in percent: points more than
`drop` (5) points below the accuracy of the lowest-TPF point are left out; with the
weight W(y) = min(exp(-alpha (1 - y / y_max)), 1) (alpha 3; y_max the best accuracy
compared, by default these points'), AUP = rho_1 y_1 + sum over i >= 2 of
(rho_i - rho_{i-1}) (W(y_i) y_i + W(y_{i-1}) y_{i-1}) / 2: the area under the weighted
accuracy-TPF curve, with the first point's rectangle from TPF 0.
"""

from __future__ import annotations

import math


def aup_weight(accuracy: float, best: float, alpha: float = 3.0) -> float:
    """W(y) = min(exp(-alpha (1 - y / y_max)), 1)."""
    return min(math.exp(-alpha * (1.0 - accuracy / best)), 1.0)


def aup(
    points: list[tuple[float, float]],
    best: float | None = None,
    alpha: float = 3.0,
    drop: float = 5.0,
) -> float:
    """AUP of (tokens per forward, accuracy in percent) points (see the module doc).
    ValueError for no points or a TPF that is not positive."""
    if not points:
        raise ValueError("AUP needs at least one (tokens per forward, accuracy) point")
    if any(rho <= 0 for rho, _ in points):
        raise ValueError("tokens per forward must be positive")
    ordered = sorted(points)
    floor = ordered[0][1] - drop
    kept = [(rho, y) for rho, y in ordered if y >= floor]
    best = max(y for _, y in kept) if best is None else best
    weighted = [(rho, aup_weight(y, best, alpha) * y) for rho, y in kept]
    total = weighted[0][0] * weighted[0][1]
    for (r0, w0), (r1, w1) in zip(weighted, weighted[1:]):
        total += (r1 - r0) * (w0 + w1) / 2.0
    return total
