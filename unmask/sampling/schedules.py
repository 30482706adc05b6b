"""Unmasking schedules: how many masked positions a step commits.

Two families (docs/diffusion.md, Sampling):
  - `llada`: per-block quotas fixed when the block starts, k_i = n // S + (i < n % S).
  - `dream`: timesteps linspace(1, eps, S + 1); between t and s commit int(M (1 - s / t))
    of the M positions still masked, everything on the last step.
Pure functions, so the hand-computed vectors in docs/diffusion.md are tests.
"""

import torch

SCHEDULES = ("llada", "dream")


def num_transfer_tokens(mask_count: torch.Tensor, steps: int) -> torch.Tensor:
    """Tokens to commit at each step: k_i = n // S + (1 if i < n % S else 0).

    mask_count (B,) long masks per row, steps S. Returns (B, S) long; rows sum to n.
    Checks: (32, 8) -> [4] * 8; (10, 4) -> [3, 3, 2, 2].
    """
    base = (mask_count // steps)[:, None]  # (B, 1)
    extra = (mask_count % steps)[:, None]
    step_idx = torch.arange(steps, device=mask_count.device)[None, :]  # (1, S)
    return base + (step_idx < extra).to(mask_count.dtype)


def dream_timesteps(steps: int, eps: float = 1e-3) -> torch.Tensor:
    """Dream's noise levels t_0 = 1 > ... > t_S = eps, (S + 1,) float64."""
    return torch.linspace(1.0, eps, steps + 1, dtype=torch.float64)


def unmask_fraction(step: int, steps: int, eps: float = 1e-3) -> float:
    """1 - s / t between step's noise levels t and s: the chance a masked position is
    revealed (Dream `origin`, MDLM ddpm); 1.0 on the last step."""
    if step >= steps - 1:
        return 1.0
    t = dream_timesteps(steps, eps)
    return float(1.0 - t[step + 1] / t[step])


def dream_transfer_count(mask_count: torch.Tensor, step: int, steps: int, eps: float = 1e-3):
    """Dream's k for this step: int(M (1 - s / t)) per row (M masks left), all of M on the
    last step. mask_count (B,) long -> (B,) long."""
    if step >= steps - 1:
        return mask_count.clone()
    t = dream_timesteps(steps, eps)
    ratio = 1.0 - t[step + 1] / t[step]
    return (mask_count.to(torch.float64) * ratio).floor().long()


def dream_schedule(num_masks: int, steps: int, eps: float = 1e-3) -> list[int]:
    """The whole Dream count vector for num_masks masks in `steps` steps (M shrinks as
    positions are committed). Check: 256 masks in 256 steps -> [0, 1, ..., 1, 2]."""
    left, counts = torch.tensor([num_masks]), []
    for step in range(steps):
        k = int(dream_transfer_count(left, step, steps, eps)[0])
        counts.append(k)
        left -= k
    return counts
