"""Per-step pieces of the sampler: propose tokens, score positions, choose which to commit.

- proposal: x0 = argmax of Gumbel-perturbed logits (float64) after filtering; this
  samples softmax(l / T) (LLaDA), T = 0 is argmax. Filtering follows Dream: the logits are
  tempered first, then nucleus (top_p), then top_k, so the nucleus is taken on softmax(l / T).
- confidence (`CONFIDENCE_FNS`): `low_confidence` softmax(l)[x0] on the untempered logits
  (LLaDA); `random`; Dream's `maskgit_plus` p(x0), `topk_margin` p1 - p2 and `entropy`
  sum p log p on the tempered, filtered distribution. All float64.
- transfer: top-k per row, sampled positions (`alg_temp`), Fast-dLLM `threshold` and
  `factor`, Dream's `confidence_threshold` (a quota per step, what falls under the
  threshold carried to the next step), or Dream `origin` / MDLM ddpm (each mask revealed
  with probability 1 - s/t).
"""

from collections.abc import Callable

import torch


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


def forbid_token(logits: torch.Tensor, token: int) -> torch.Tensor:
    """Copy of logits (..., V) with column `token` set to -inf (never sampled).

    Used for the mask token: a committed mask would leave a hole the quota counted as
    filled. Out of place, so the untempered logits used for confidence stay intact.
    """
    return logits.index_fill(-1, torch.tensor([token], device=logits.device), float("-inf"))


def filter_top_k_top_p(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Logits (..., V) with everything outside the smallest set whose probability reaches
    top_p, then outside the top_k ids of what is left, set to -inf (the top id always
    stays). Dream's order (nucleus, then top-k); transformers' `generate` applies top-k
    first, which keeps the same set unless both are given. Temper the logits first."""
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_logits.to(torch.float64), dim=-1)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p  # the mass before it reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits


def filtered_logits(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None
) -> torch.Tensor:
    """logits (..., V), untempered, with the ids that temperature-then-filtering removes set
    to -inf: the kept set is that of filter_top_k_top_p(logits / T) (T = 0: untempered),
    as Dream and transformers temper before filtering. The logits stay untempered, so
    without filtering this is `logits` itself (the Gumbel draw and confidences unchanged)."""
    if not (top_p is not None and top_p < 1.0) and not (top_k and top_k < logits.shape[-1]):
        return logits
    tempered = logits.to(torch.float64) / temperature if temperature > 0 else logits
    kept = torch.isfinite(filter_top_k_top_p(tempered, top_k, top_p))
    return logits.masked_fill(~kept, float("-inf"))


def low_confidence(logits, probs, x0, generator=None) -> torch.Tensor:
    """softmax(logits)[x0] on the untempered logits, (B, L) float64 (LLaDA)."""
    raw = torch.softmax(logits.to(torch.float64), dim=-1)
    return raw.gather(-1, x0[..., None]).squeeze(-1)


def random_confidence(logits, probs, x0, generator=None) -> torch.Tensor:
    """Uniform random scores, (B, L) float64: commit positions in random order."""
    return torch.rand(x0.shape, generator=generator, device=x0.device, dtype=torch.float64)


def maskgit_plus(logits, probs, x0, generator=None) -> torch.Tensor:
    """p(x0) under the tempered, filtered distribution (Dream `maskgit_plus`)."""
    return probs.gather(-1, x0[..., None]).squeeze(-1)


def topk_margin(logits, probs, x0, generator=None) -> torch.Tensor:
    """p1 - p2, the gap between the two most likely tokens (Dream `topk_margin`)."""
    top2 = probs.topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def neg_entropy(logits, probs, x0, generator=None) -> torch.Tensor:
    """sum p log p = -entropy: higher is more certain (Dream `entropy`)."""
    return torch.xlogy(probs, probs).sum(-1)


ConfidenceFn = Callable[..., torch.Tensor]
CONFIDENCE_FNS: dict[str, ConfidenceFn] = {
    "low_confidence": low_confidence,
    "random": random_confidence,
    "maskgit_plus": maskgit_plus,
    "topk_margin": topk_margin,
    "entropy": neg_entropy,
    "confidence_threshold": maskgit_plus,
}
REMASKING = (*CONFIDENCE_FNS, "origin")


def propose_tokens(
    logits: torch.Tensor,
    mask_id: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x0 (...,) long, sampled from softmax(l / T) restricted to what temperature-then-
    filtering keeps (`filtered_logits`) by Gumbel-argmax (T = 0: argmax), never the mask
    token; and the filtered, untempered logits (..., V)."""
    filtered = filtered_logits(forbid_token(logits, mask_id), temperature, top_k, top_p)
    return add_gumbel_noise(filtered, temperature, generator).argmax(dim=-1), filtered


def sampling_probs(filtered: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(filtered / T) in float64 (T = 0: untempered): Dream's confidence basis."""
    scale = temperature if temperature > 0 else 1.0
    return torch.softmax(filtered.to(torch.float64) / scale, dim=-1)


def select_top_k(confidence: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Bool (B, L): the k[b] highest-confidence positions of each row b.

    confidence (B, L) with -inf at positions that must not be chosen; k (B,) long.
    """
    selected = torch.zeros(confidence.shape, dtype=torch.bool, device=confidence.device)
    k_max = int(k.max()) if k.numel() else 0
    if k_max == 0:
        return selected
    top = confidence.topk(k_max, dim=-1).indices  # (B, k_max), sorted descending
    keep = torch.arange(k_max, device=k.device)[None, :] < k[:, None]
    return selected.scatter(1, top, keep)


def select_sampled(
    confidence: torch.Tensor,
    k: torch.Tensor,
    alg_temp: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Bool (B, L): k[b] positions drawn without replacement from softmax(conf / alg_temp)
    over the allowed (finite) positions (Dream's `alg_temp`)."""
    selected = torch.zeros(confidence.shape, dtype=torch.bool, device=confidence.device)
    k_max = int(k.max()) if k.numel() else 0
    if k_max == 0:
        return selected
    allowed = torch.isfinite(confidence)
    weights = torch.softmax(torch.where(allowed, confidence / alg_temp, -torch.inf), dim=-1)
    weights = torch.where(allowed.any(-1, keepdim=True), weights.nan_to_num(0.0), 1.0)
    k_max = min(k_max, confidence.shape[1])
    draws = torch.multinomial(weights, k_max, replacement=False, generator=generator)
    keep = torch.arange(k_max, device=k.device)[None, :] < k[:, None]
    return selected.scatter(1, draws, keep)


def select_threshold(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """Bool (B, L): the top position of each row that has one, plus every position with
    confidence >= threshold (Fast-dLLM parallel decoding)."""
    allowed = torch.isfinite(confidence)
    top = select_top_k(confidence, allowed.any(-1).long())
    return top | (allowed & (confidence >= threshold))


def select_carried_threshold(
    confidence: torch.Tensor, quota: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dream's `confidence_threshold`: of the quota[b] highest-confidence positions of row
    b, the top one and every one with confidence >= threshold; the rest of the quota is
    returned, to be added to the next step's. Returns (bool (B, L), carried (B,) long).

    confidence (B, L), -inf where not allowed; quota (B,) long (only positions allowed are
    counted, so a row never carries more than it has left)."""
    allowed = torch.isfinite(confidence)
    quota = torch.minimum(quota, allowed.sum(-1))
    picked = select_top_k(confidence, quota)
    top = select_top_k(confidence, (quota > 0).long())
    commit = top | (picked & (confidence >= threshold))
    return commit, quota - commit.sum(-1)


def select_factor(confidence: torch.Tensor, factor: float) -> torch.Tensor:
    """Bool (B, L): ranks r = 1, 2, ... (by confidence) accepted while
    conf_r >= 1 - factor / (r + 1); rank 1 always (Fast-dLLM factor rule)."""
    ordered, order = confidence.sort(dim=-1, descending=True)
    rank = torch.arange(1, confidence.shape[1] + 1, device=confidence.device)
    ok = (ordered >= 1.0 - factor / (rank + 1.0)) & torch.isfinite(ordered)
    ok[:, 0] = torch.isfinite(ordered[:, 0])
    accepted = ok.long().cumprod(dim=-1).bool()  # a prefix of the ranking
    return torch.zeros_like(accepted).scatter(1, order, accepted)


def select_origin(
    allowed: torch.Tensor, fraction: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Bool (B, L): each allowed (masked, in-block) position with probability `fraction`."""
    u = torch.rand(allowed.shape, generator=generator, device=allowed.device, dtype=torch.float64)
    return allowed & (u < fraction)
