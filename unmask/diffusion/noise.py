"""The masked-diffusion forward process: noise levels, schedules, weights and masking.

Pure functions of tensors and a torch.Generator, so tests can pin every formula.
Notation follows docs/diffusion.md: alpha(t) is the probability a token stays clean,
so a token is masked with probability 1 - alpha(t).
"""

import math

import torch

#: (offset, total): these B rows are rows [offset, offset + B) of a batch of `total` rows.
#: The draws are made for all `total` rows and sliced, so a row's noise is the same whichever
#: process draws it (each rank of a data-parallel run holds only its slice).
RowSlice = tuple[int, int]


#: t of every row under `t_sampling: fixed`
FIXED_T = 0.5


def rand_rows(
    shape: tuple[int, ...],
    rows: RowSlice | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """U[0, 1) float32 of `shape`; with rows = (offset, total), rows [offset, offset +
    shape[0]) of a (total, *shape[1:]) draw."""
    if rows is None:
        return torch.rand(shape, generator=generator, device=device)
    offset, total = rows
    full = torch.rand((total, *shape[1:]), generator=generator, device=device)
    return full[offset : offset + shape[0]]


def sample_t(
    batch_size: int,
    method: str = "uniform",
    eps: float = 1e-3,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    rows: RowSlice | None = None,
) -> torch.Tensor:
    """Noise level per row, (B,) float32 in [eps, 1).

    `uniform`: t = (1 - eps) u + eps with u ~ U[0, 1) i.i.d.
    `antithetic`: one u, then u_i = (u + i / B) mod 1 (stratified; lower variance); B is
    the whole batch's row count when `rows` says this is a slice of it.
    `fixed`: every row at t = FIXED_T (no draw): about half of the maskable tokens masked at
    every step, so a benchmark's steps do comparable work (the LM head's share moves with
    the masked count; with a few rows per step a random t moves it by +-45%).
    """
    if method == "fixed":
        return torch.full((batch_size,), FIXED_T, device=device)
    if method == "uniform":
        u = rand_rows((batch_size,), rows, generator, device)
    elif method == "antithetic":
        u0 = torch.rand(1, generator=generator, device=device)
        offset, total = rows if rows is not None else (0, batch_size)
        offsets = torch.arange(total, device=device, dtype=torch.float32) / total
        u = torch.remainder(u0 + offsets, 1.0)[offset : offset + batch_size]
    else:
        raise ValueError(f"unknown t sampling method {method!r}; expected uniform, antithetic "
                         "or fixed")  # fmt: skip
    return (1.0 - eps) * u + eps


def mask_prob(t: torch.Tensor, schedule: str = "linear") -> torch.Tensor:
    """Probability 1 - alpha(t) that a token is masked at noise level t (same shape as t)."""
    if schedule == "linear":
        return t
    if schedule == "cosine":
        return 1.0 - torch.cos(0.5 * math.pi * t)
    raise ValueError(f"unknown schedule {schedule!r}; expected linear or cosine")


def loss_weight(t: torch.Tensor, kind: str = "inverse_t", schedule: str = "linear") -> torch.Tensor:
    """Weight of a masked token's cross-entropy at noise level t (same shape as t).

    `inverse_t`: 1/t. `scheduler`: -alpha'(t) / (1 - alpha(t)) (1/t for linear;
    (pi/2) sin(pi t/2) / (1 - cos(pi t/2)) for cosine). `uniform`: 1.
    """
    if kind == "inverse_t":
        return 1.0 / t
    if kind == "uniform":
        return torch.ones_like(t)
    if kind == "scheduler":
        if schedule == "linear":
            return 1.0 / t
        if schedule == "cosine":
            half_pi = 0.5 * math.pi
            return half_pi * torch.sin(half_pi * t) / (1.0 - torch.cos(half_pi * t))
        raise ValueError(f"unknown schedule {schedule!r}; expected linear or cosine")
    raise ValueError(f"unknown loss weight {kind!r}; expected inverse_t, scheduler or uniform")


def mask_tokens(
    input_ids: torch.Tensor,
    t: torch.Tensor,
    maskable: torch.Tensor,
    mask_id: int,
    generator: torch.Generator | None = None,
    schedule: str = "linear",
    min_masked: int = 0,
    rows: RowSlice | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask each maskable position independently with probability mask_prob(t_row).

    input_ids (B, L) long, t (B,), maskable (B, L) bool; rows: see `RowSlice`.
    Returns (noisy_ids (B, L) with mask_id at masked positions, masked (B, L) bool).
    With min_masked >= 1, a row with maskable positions but none masked gets one
    maskable position, chosen uniformly, masked.
    """
    p = mask_prob(t, schedule).to(torch.float32)[:, None]  # (B, 1)
    u = rand_rows(tuple(input_ids.shape), rows, generator, input_ids.device)
    masked = (u < p) & maskable
    if min_masked > 0:
        masked = force_one_masked(masked, maskable, generator, rows)
    noisy_ids = torch.where(masked, torch.full_like(input_ids, mask_id), input_ids)
    return noisy_ids, masked


def replace_tokens(
    input_ids: torch.Tensor,
    noisy_ids: torch.Tensor,
    candidates: torch.Tensor,
    fraction: float,
    choices: torch.Tensor,
    generator: torch.Generator | None = None,
    rows: RowSlice | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA2.1's editing-stream corruption (docs/diffusion.md, Token editing): each
    candidate position (B, L) bool (the kept tokens: maskable, not masked) is replaced with
    probability `fraction` by a token drawn uniformly from `choices` (K,) long, ascending
    (the tokenizer's non-special ids), other than input_ids there: a replaced token is
    always wrong.

    Two U[0, 1) draws of the batch's shape, in this order: u (replaced where u < fraction),
    then v (the token: index floor(v * n) of the n choices that differ from the original);
    rows: see `RowSlice`. Returns (noisy_ids with the replacements, replaced (B, L) bool).
    """
    device = input_ids.device
    u = rand_rows(tuple(input_ids.shape), rows, generator, device)
    v = rand_rows(tuple(input_ids.shape), rows, generator, device)
    replaced = candidates & (u < fraction)
    choices = choices.to(device)
    count = choices.numel()
    rank = torch.searchsorted(choices, input_ids).clamp(max=count - 1)
    inside = choices[rank] == input_ids  # the original is one of the choices: skip it
    n = count - inside.long()
    pick = torch.minimum((v * n).long(), n - 1)
    pick = pick + (inside & (pick >= rank)).long()
    new_ids = torch.where(replaced, choices[pick], noisy_ids)
    return new_ids, replaced


def force_one_masked(
    masked: torch.Tensor,
    maskable: torch.Tensor,
    generator: torch.Generator | None,
    rows: RowSlice | None = None,
) -> torch.Tensor:
    """Mask one random maskable position in rows that have maskable positions but no mask."""
    empty = maskable.any(dim=1) & ~masked.any(dim=1)  # (B,)
    # A random score per position; the argmax over maskable positions is a uniform pick.
    scores = rand_rows(tuple(masked.shape), rows, generator, masked.device)
    scores = scores.masked_fill(~maskable, -1.0)
    pick = scores.argmax(dim=1)  # (B,)
    forced = torch.zeros_like(masked)
    forced[torch.arange(masked.shape[0], device=masked.device), pick] = True
    return masked | (forced & empty[:, None])
