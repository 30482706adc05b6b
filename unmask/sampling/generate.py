"""LLaDA-style sampling: fill a masked canvas block by block, most confident first.

One loop with swappable parts, so Dream schedules, threshold decoding and KV caching
can slot in without a second loop:
  - the unmasking schedule: how many positions to commit per step (`num_transfer_tokens`),
  - the confidence: which positions to commit (`CONFIDENCE_FNS`),
  - the transfer rule: commit the top-k per row (`select_top_k`),
  - the model call: plain or classifier-free guided (`guided_logits`).
"""

from collections.abc import Callable

import torch
from torch import nn


def num_transfer_tokens(mask_count: torch.Tensor, steps: int) -> torch.Tensor:
    """Tokens to commit at each step: k_i = n // S + (1 if i < n % S else 0).

    mask_count (B,) long masks per row, steps S. Returns (B, S) long; rows sum to n.
    Checks: (32, 8) -> [4] * 8; (10, 4) -> [3, 3, 2, 2].
    """
    base = (mask_count // steps)[:, None]  # (B, 1)
    extra = (mask_count % steps)[:, None]
    step_idx = torch.arange(steps, device=mask_count.device)[None, :]  # (1, S)
    return base + (step_idx < extra).to(mask_count.dtype)


def add_gumbel_noise(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Perturbed logits whose argmax is a sample from softmax(logits / T), float64.

    Returns logits - T * log(-log u), u ~ U(0, 1): the log of LLaDA's
    exp(l) / (-log u)^T (same argmax, without overflowing exp). T = 0 returns logits
    unchanged (argmax decoding).
    """
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    u = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float64)
    u = u.clamp_min(torch.finfo(torch.float64).tiny)
    return logits - temperature * torch.log(-torch.log(u))


def low_confidence(
    logits: torch.Tensor, x0: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """softmax(logits)[x0] on the untempered logits, (B, L) float64."""
    probs = torch.softmax(logits.to(torch.float64), dim=-1)
    return probs.gather(-1, x0[..., None]).squeeze(-1)


def random_confidence(
    logits: torch.Tensor, x0: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Uniform random scores, (B, L) float64: commit positions in random order."""
    return torch.rand(x0.shape, generator=generator, device=x0.device, dtype=torch.float64)


ConfidenceFn = Callable[[torch.Tensor, torch.Tensor, torch.Generator | None], torch.Tensor]
CONFIDENCE_FNS: dict[str, ConfidenceFn] = {
    "low_confidence": low_confidence,
    "random": random_confidence,
}


def select_top_k(confidence: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Bool (B, L): the k[b] highest-confidence positions of each row b.

    confidence (B, L) with -inf at positions that must not be chosen; k (B,) long.
    """
    selected = torch.zeros(confidence.shape, dtype=torch.bool, device=confidence.device)
    k_max = int(k.max())
    if k_max == 0:
        return selected
    top = confidence.topk(k_max, dim=-1).indices  # (B, k_max), sorted descending
    keep = torch.arange(k_max, device=k.device)[None, :] < k[:, None]
    return selected.scatter(1, top, keep)


def forbid_token(logits: torch.Tensor, token: int) -> torch.Tensor:
    """Copy of logits (..., V) with column `token` set to -inf (never sampled).

    Used for the mask token: a committed mask would leave a hole the quota counted as
    filled. Out of place, so the untempered logits used for confidence stay intact.
    """
    return logits.index_fill(-1, torch.tensor([token], device=logits.device), float("-inf"))


def cfg_combine(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance: un + (scale + 1) * (cond - un)."""
    return uncond + (scale + 1.0) * (cond - uncond)


def guided_logits(
    model: nn.Module, x: torch.Tensor, prompt_len: int, mask_id: int, cfg_scale: float
) -> torch.Tensor:
    """Model logits (B, L, V) for canvas x; with cfg_scale > 0 guided against x with the
    prompt masked (both in one forward pass of 2B rows)."""
    if cfg_scale <= 0:
        return model(x)
    uncond_x = x.clone()
    uncond_x[:, :prompt_len] = mask_id
    both = model(torch.cat([x, uncond_x], dim=0))
    cond, uncond = both.chunk(2, dim=0)
    return cfg_combine(cond, uncond, cfg_scale)


def _check_lengths(steps: int, gen_length: int, block_length: int) -> int:
    """Number of blocks; raises ValueError for lengths the block schedule cannot split."""
    if gen_length <= 0 or block_length <= 0 or steps <= 0:
        raise ValueError(
            f"steps, gen_length and block_length must be positive; got steps={steps}, "
            f"gen_length={gen_length}, block_length={block_length}"
        )
    if gen_length % block_length != 0:
        raise ValueError(
            f"gen_length ({gen_length}) must be a multiple of block_length ({block_length})"
        )
    num_blocks = gen_length // block_length
    if steps % num_blocks != 0:
        raise ValueError(
            f"steps ({steps}) must be a multiple of the number of blocks "
            f"gen_length / block_length = {num_blocks}"
        )
    return num_blocks


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    *,
    mask_id: int,
    steps: int = 128,
    gen_length: int = 128,
    block_length: int = 128,
    temperature: float = 0.0,
    remasking: str = "low_confidence",
    cfg_scale: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """LLaDA generation: returns (B, P + gen_length) long, prompt unchanged, no masks left.

    prompt_ids (B, P) long. The answer is decoded in gen_length / block_length blocks
    left to right, steps / num_blocks steps per block. Each step commits, per row, the
    quota of masked positions in the current block with the highest confidence
    (`low_confidence`: softmax(logits)[x0]; `random`). x0 is the argmax of Gumbel-
    perturbed logits at `temperature` (0 = greedy), never the mask token itself. `model(x)` must return (B, L, V)
    logits; putting it in eval mode is the caller's job.
    """
    if remasking not in CONFIDENCE_FNS:
        raise ValueError(f"unknown remasking {remasking!r}; expected one of {list(CONFIDENCE_FNS)}")
    confidence_fn = CONFIDENCE_FNS[remasking]
    num_blocks = _check_lengths(steps, gen_length, block_length)
    steps_per_block = steps // num_blocks
    batch, prompt_len = prompt_ids.shape
    masks = torch.full(
        (batch, gen_length), mask_id, dtype=prompt_ids.dtype, device=prompt_ids.device
    )
    x = torch.cat([prompt_ids, masks], dim=1)  # (B, P + G)
    position = torch.arange(x.shape[1], device=x.device)

    for block in range(num_blocks):
        start = prompt_len + block * block_length
        in_block = (position >= start) & (position < start + block_length)  # (L,)
        quota = num_transfer_tokens((x[:, in_block] == mask_id).sum(dim=1), steps_per_block)
        for step in range(steps_per_block):
            is_mask = x == mask_id  # (B, L)
            logits = guided_logits(model, x, prompt_len, mask_id, cfg_scale)  # (B, L, V)
            noisy = add_gumbel_noise(logits, temperature, generator)
            x0 = forbid_token(noisy, mask_id).argmax(dim=-1)
            x0 = torch.where(is_mask, x0, x)
            confidence = confidence_fn(logits, x0, generator)
            confidence = confidence.masked_fill(~(is_mask & in_block), float("-inf"))
            commit = select_top_k(confidence, quota[:, step])
            x = torch.where(commit, x0, x)
    return x
