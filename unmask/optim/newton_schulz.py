"""Newton-Schulz orthogonalization for Muon, as pure batched functions.

Every function here takes a stack of matrices ``x`` of shape ``(..., A, B)`` and returns
``(..., A, B)``: an approximation of ``U V^T`` for each matrix ``U S V^T``. Nothing here knows
about parameters, optimizer state or devices, so a sharded (DTensor) path can gather whole
matrices, call these functions and scatter the result.

Two iterations are implemented:

* standard NS (Keller Jordan): with ``X`` wide (``A <= B``), ``S = X X^T`` and
  ``X <- a X + (b S + c S^2) X``. Cost per matrix, n = min(A, B), m = max(A, B):
  ``5 * (4 n^2 m + 2 n^3) = 20 n^2 m + 10 n^3`` FLOPs for five steps.
* Gram NS (Dao-AILab): iterate on the small Gram matrix ``R = X X^T`` (n x n) and an
  accumulated left factor ``Q``, touching the n x m matrix only at the start, at each restart
  and at the end. With one restart at step 2: ``8 n^2 m + 28 n^3`` FLOPs. It is algebraically
  the same map as standard NS with the same coefficients, so it only pays off for non-square
  matrices; square ones fall back to standard NS.

Numerics follow ``torch.optim.Muon``: cast to the iteration dtype first, transpose tall
matrices, then divide by ``max(||X||_F, eps)`` in that dtype. With torch's settings (jordan,
bfloat16, the only dtype it has) the two agree bit for bit on CPU: the tests assert
``torch.equal`` against torch's kernel for wide, tall and square matrices, and between a
batched call and one call per matrix. The one exception is float16, whose range (65504) a
large momentum could overflow, so the norm is divided out in float32 before the cast (as
Gram NS and dmuon do).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

Coefficients = tuple[float, float, float]

#: Keller Jordan's fixed quintic, used at every step. Singular values end up spread around 1
#: (roughly 0.7 to 1.2 in practice), not at 1: the slope at zero is maximised instead.
JORDAN: tuple[Coefficients, ...] = ((3.4445, -4.7750, 2.0315),)

#: You Jiacheng's per-step schedule (five steps).
YOU: tuple[Coefficients, ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

#: Polar Express (arXiv 2505.16932) raw per-step coefficients, before the safety factor.
POLAR_EXPRESS_RAW: tuple[Coefficients, ...] = (
    (8.28721, -23.59589, 17.30039),
    (4.10706, -2.94785, 0.54484),
    (3.94869, -2.90890, 0.55182),
    (3.31842, -2.48849, 0.51005),
    (2.30065, -1.66890, 0.41881),
)

#: Safety factor s for Polar Express: each step uses (a / s, b / s^3, c / s^5), which
#: evaluates the polynomial at x / s and keeps rounding from pushing values past the
#: interval the coefficients were fitted on.
POLAR_EXPRESS_SAFETY = 1.05

#: Names accepted by :func:`coefficient_schedule` and :func:`orthogonalize`. ``gram`` is Gram
#: NS with the Polar Express schedule, the pairing Dao-AILab's reference uses.
NS_METHODS = ("jordan", "you", "polar_express", "gram")

#: Iteration dtypes accepted by name.
NS_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float16": torch.float16,
}

#: Default step indices before which Gram NS rebuilds X and R from scratch.
GRAM_RESTARTS: tuple[int, ...] = (2,)


def _with_safety(coefficients: Sequence[Coefficients], s: float) -> list[Coefficients]:
    return [(a / s, b / s**3, c / s**5) for a, b, c in coefficients]


def coefficient_schedule(name: str, steps: int = 5) -> list[Coefficients]:
    """The (a, b, c) to use at each of ``steps`` NS iterations for a named set.

    Fixed sets repeat; per-step sets repeat their last entry past their length (the tail of
    Polar Express is the most conservative polynomial). ``gram`` returns the Polar Express
    schedule, which Gram NS uses.
    """
    if steps < 1:
        raise ValueError(f"ns_steps must be >= 1, got {steps}")
    if name == "jordan":
        base: Sequence[Coefficients] = JORDAN
    elif name == "you":
        base = YOU
    elif name in ("polar_express", "gram"):
        base = _with_safety(POLAR_EXPRESS_RAW, POLAR_EXPRESS_SAFETY)
    else:
        raise ValueError(f"unknown NS coefficient set {name!r}; expected one of {NS_METHODS}")
    return [tuple(base[min(i, len(base) - 1)]) for i in range(steps)]


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``"float32"`` / ``"float16"`` (or the torch dtype itself) -> dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in NS_DTYPES.values():
            raise ValueError(f"NS dtype must be one of {sorted(NS_DTYPES)}, got {dtype}")
        return dtype
    if dtype not in NS_DTYPES:
        raise ValueError(f"NS dtype must be one of {sorted(NS_DTYPES)}, got {dtype!r}")
    return NS_DTYPES[dtype]


def _normalized_wide(x: Tensor, dtype: torch.dtype, eps: float) -> tuple[Tensor, bool]:
    """Cast, make each matrix wide and scale it to unit Frobenius norm.

    x: (..., A, B) -> (..., n, m) in ``dtype`` with n = min(A, B), plus whether it was
    transposed. The norm is over each whole matrix, so the spectral norm is at most 1.
    """
    if x.ndim < 2:
        raise ValueError(f"Newton-Schulz needs matrices (..., A, B), got shape {tuple(x.shape)}")
    tall = x.size(-2) > x.size(-1)
    if dtype == torch.float16:
        x = x.float()
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
        x = x.to(dtype)
        return (x.mT if tall else x), tall
    x = x.to(dtype)
    if tall:
        x = x.mT
    return x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps), tall


def _as_batch(x: Tensor) -> tuple[Tensor, torch.Size]:
    """(..., n, m) -> (N, n, m) and the leading shape to undo it."""
    lead = x.shape[:-2]
    return x.reshape(-1, *x.shape[-2:]), lead


def _standard_iterations(x: Tensor, schedule: Sequence[Coefficients]) -> Tensor:
    """x: (N, n, m) wide, unit norm -> (N, n, m) after one NS step per schedule entry."""
    for a, b, c in schedule:
        s = x @ x.mT  # (N, n, n)
        poly = torch.baddbmm(s, s, s, beta=b, alpha=c)  # b S + c S^2
        x = torch.baddbmm(x, poly, x, beta=a)  # a X + (b S + c S^2) X
    return x


def _gram_iterations(
    x: Tensor, schedule: Sequence[Coefficients], restarts: Sequence[int]
) -> Tensor:
    """Gram NS. x: (N, n, m) wide, unit norm, n < m -> (N, n, m).

    Each standard step is X <- P X with P = a I + Z, Z = b R + c R^2, R = X X^T. Keep
    Q = P_t ... P_0 and update R <- P R P (everything is a polynomial in R, so it all
    commutes); apply Q to X only at a restart and at the end.
    """
    r = x @ x.mT  # (N, n, n)
    q: Tensor | None = None  # None stands for the identity
    last = len(schedule) - 1
    for t, (a, b, c) in enumerate(schedule):
        if t in restarts and t > 0 and q is not None:
            x = q @ x
            r = x @ x.mT
            q = None
        z = torch.baddbmm(r, r, r, beta=b, alpha=c)  # b R + c R^2
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)  # a I + Z
        else:
            q = torch.baddbmm(q, q, z, beta=a)  # Q Z + a Q = Q P
        if t < last and (t + 1) not in restarts:
            rp = torch.baddbmm(r, r, z, beta=a)  # R Z + a R = R P
            r = torch.baddbmm(rp, z, rp, beta=a)  # Z R P + a R P = P R P
    return x if q is None else q @ x


def newton_schulz(
    x: Tensor,
    schedule: Sequence[Coefficients],
    *,
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
    gram: bool = False,
    restarts: Sequence[int] = GRAM_RESTARTS,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """Orthogonalize every matrix of a stack with one batched NS iteration.

    Args:
        x: (..., A, B) matrices of one shape (the leading dims are a batch, e.g. layers or
            experts).
        schedule: one (a, b, c) per step, e.g. from :func:`coefficient_schedule`.
        dtype: iteration dtype (bfloat16, float32 or float16).
        eps: lower bound on the Frobenius norm that ``x`` is divided by.
        gram: use Gram NS for non-square matrices (square ones always run standard NS).
        restarts: step indices at which Gram NS rebuilds X and R (ignored when not gram).
        out_dtype: dtype of the result; defaults to ``x.dtype``.

    Returns:
        (..., A, B) tensor in ``out_dtype``.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    xw, tall = _normalized_wide(x, dtype, eps)
    xb, lead = _as_batch(xw)
    n, m = xb.shape[-2:]
    if gram and n < m:
        yb = _gram_iterations(xb, schedule, tuple(restarts))
    else:
        yb = _standard_iterations(xb, schedule)
    y = yb.reshape(*lead, n, m)
    if tall:
        y = y.mT
    return y.to(out_dtype)


def orthogonalize(
    x: Tensor,
    method: str | Sequence[Coefficients] = "jordan",
    *,
    steps: int = 5,
    dtype: str | torch.dtype = "bfloat16",
    eps: float = 1e-7,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """Named-method front end to :func:`newton_schulz`.

    Args:
        x: (..., A, B) stack of same-shape matrices.
        method: ``jordan``, ``you``, ``polar_express`` or ``gram`` (Gram NS with the Polar
            Express schedule), or an explicit per-step list of (a, b, c).
        steps: number of NS iterations.
        dtype: iteration dtype, by name or as a torch dtype.
        eps: lower bound on the Frobenius norm.
        out_dtype: result dtype, default ``x.dtype`` (the optimizer passes the param dtype).

    Returns:
        (..., A, B) approximately semi-orthogonal matrices.
    """
    if isinstance(method, str):
        schedule = coefficient_schedule(method, steps)
        gram = method == "gram"
    else:
        schedule = [tuple(abc) for abc in method]
        gram = False
    return newton_schulz(
        x, schedule, dtype=resolve_dtype(dtype), eps=eps, gram=gram, out_dtype=out_dtype
    )


def ns_flops(a: int, b: int, steps: int = 5, *, gram: bool = False) -> int:
    """FLOP model of one NS on an A x B matrix with dense (non-symmetric) GEMMs.

    Standard: per step 2 n^2 m (X X^T) + 2 n^3 (S^2) + 2 n^2 m (poly X) -> 20 n^2 m + 10 n^3
    for five steps. Gram with one restart: 8 n^2 m (R, Q X and R at the restart, final Q X)
    + 28 n^3 (14 n x n products, the identity products skipped). Square matrices use
    standard NS even when gram is asked for.
    """
    n, m = min(a, b), max(a, b)
    if not gram or n == m:
        return steps * (4 * n * n * m + 2 * n**3)
    if steps != 5:
        raise ValueError("the Gram FLOP model is written for five steps with one restart")
    return 8 * n * n * m + 28 * n**3
