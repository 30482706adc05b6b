"""Log-likelihood estimators of a completion under a masked-diffusion LM.

A DLM gives no exact log pi(o | q). Each estimator runs K masked copies ("passes") of the
prompt + completion row through the model and returns, for every pass k and position i,
log p_k(o_i) (the model's log-probability of the true token where that pass masked it) and
a weight w_k,i, so that the per-token estimate is sum_k w_k,i log p_k(o_i) and the sequence
estimate is its sum over the completion's tokens (docs/diffusion.md, Post-training):

- `one_step` (d1, arXiv 2504.12216): K = 1. The whole completion is masked and each prompt
  token is masked with probability p (prompt_mask_prob); w = 1 on every completion token.
- `coupled` (DiffuCoder's coupled-GRPO, arXiv 2506.20639): K = 3. A full-mask pass, then a
  mask M at ratio t ~ U(0.2, 0.8) and its complement, so every token is masked in exactly
  one of the two; w = 1/2 on the full pass and 1/(2t) on M, 1/(2(1-t)) on the complement
  (the average of the full-mask term and the importance-weighted partial term).
- `mc` (K-sample ELBO, as in LLaDA 1.5's VRPO, arXiv 2505.19223): K = mc_samples passes at
  noise levels t_k (antithetic pairs t, 1 - t; or stratified, one per stratum; or
  independent), each completion token masked with probability t_k; w = 1 / (K t_k) on the
  tokens a pass masked. The sum over tokens is the MDLM ELBO averaged over K draws.

Randomness comes from `rand(shape) -> (R, *shape)` uniforms, which the objective draws per
prompt group from that group's own seed, so estimates do not depend on how rows are
batched or split over ranks.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from unmask.diffusion.loss import IGNORE_INDEX

RowRandom = Callable[[tuple[int, ...]], torch.Tensor]
COUPLED_T_RANGE = (0.2, 0.8)  # DiffuCoder's mask-ratio range


class Passes(NamedTuple):
    """What an estimator measured: log p of the true token and its weight per pass."""

    logps: torch.Tensor
    """(K, R, L) float32 log-probabilities (with grad when the model has it); 0 where the pass
    did not mask a scored token."""
    weights: torch.Tensor
    """(K, R, L) float32 weights; 0 where the pass did not mask a scored token."""

    @property
    def forwards(self) -> int:
        """Model forward passes per row."""
        return self.logps.shape[0]

    def token_estimates(self) -> torch.Tensor:
        """(R, L): the per-token log-likelihood estimate sum_k w_k log p_k."""
        return (self.weights * self.logps).sum(0)


class Rows(NamedTuple):
    """Prompt + completion rows to score."""

    ids: torch.Tensor
    """(R, L) long: prompt, completion, and EOS fill when rows differ in length."""
    prompt: torch.Tensor
    """(R, L) bool: prompt positions."""
    canvas: torch.Tensor
    """(R, L) bool: completion positions (the sampler's canvas: maskable)."""
    scored: torch.Tensor
    """(R, L) bool: completion tokens scored: up to and including the first EOS."""
    doc_ids: torch.Tensor | None = None
    """(R, L) long: 1 on fill past a row's end (hidden from attention), else 0; None when
    every row is full."""


def masked_logps(model: nn.Module, rows: Rows, noisy: torch.Tensor, targets: torch.Tensor,
                 vocab_chunk: int) -> torch.Tensor:  # fmt: skip
    """(B, L) float32 log p(true token) where targets is not -100, else 0; B = R * passes
    (rows repeated)."""
    repeat = noisy.shape[0] // rows.ids.shape[0]
    doc_ids = None if rows.doc_ids is None else rows.doc_ids.repeat(repeat, 1)
    ce = model(noisy, doc_ids=doc_ids, position_ids=None, targets=targets, vocab_chunk=vocab_chunk)
    return -ce.float()


def _run(model, rows: Rows, masks: torch.Tensor, weights: torch.Tensor, mask_id: int,
         vocab_chunk: int, extra_masked: torch.Tensor | None = None) -> Passes:  # fmt: skip
    """Passes for masks (K, R, L) bool over the canvas and weights (K, R, L); extra_masked
    (K, R, L): positions also masked but not scored (d1's prompt masking)."""
    k, r, length = masks.shape
    ids = rows.ids.expand(k, r, length)
    hidden = masks if extra_masked is None else masks | extra_masked
    noisy = torch.where(hidden, torch.full_like(ids, mask_id), ids).reshape(k * r, length)
    scored = masks & rows.scored
    targets = torch.where(scored, ids, torch.full_like(ids, IGNORE_INDEX)).reshape(k * r, length)
    logps = masked_logps(model, rows, noisy, targets, vocab_chunk).reshape(k, r, length)
    weights = torch.where(scored, weights, torch.zeros_like(weights)).float()
    return Passes(torch.where(scored, logps, torch.zeros_like(logps)), weights)


def one_step(model, rows: Rows, rand: RowRandom, mask_id: int, vocab_chunk: int,
             prompt_mask_prob: float) -> Passes:  # fmt: skip
    """d1: the completion fully masked, prompt tokens masked with prompt_mask_prob."""
    r, length = rows.ids.shape
    prompt_masked = rows.prompt & (rand((length,)) < prompt_mask_prob)
    masks = rows.canvas[None]
    weights = torch.ones((1, r, length), device=rows.ids.device)
    return _run(model, rows, masks, weights, mask_id, vocab_chunk, prompt_masked[None])


def coupled(model, rows: Rows, rand: RowRandom, mask_id: int, vocab_chunk: int) -> Passes:
    """DiffuCoder: full mask, then M at ratio t and its complement (each token in one)."""
    lo, hi = COUPLED_T_RANGE
    t = lo + (hi - lo) * rand(())  # (R,)
    u = rand((rows.ids.shape[1],))  # (R, L)
    first = rows.canvas & (u < t[:, None])
    second = rows.canvas & ~(u < t[:, None])
    masks = torch.stack([rows.canvas, first, second])
    half = torch.full_like(t, 0.5)
    weights = torch.stack([half, 0.5 / t, 0.5 / (1.0 - t)])[:, :, None].expand_as(masks)
    return _run(model, rows, masks, weights.contiguous(), mask_id, vocab_chunk)


def mc_times(rand: RowRandom, samples: int, how: str, time_eps: float) -> torch.Tensor:
    """(K, R) noise levels in [time_eps, 1]: `antithetic` pairs (u, 1 - u) (an odd K's
    last one independent), `stratified` t_k in [k/K, (k+1)/K), `uniform` independent."""
    u = rand((samples,)).T  # (K, R)
    if how == "antithetic":
        t = u.clone()
        t[1::2] = 1.0 - u[0 : samples - samples % 2 : 2]
    elif how == "stratified":
        t = (torch.arange(samples, device=u.device)[:, None] + u) / samples
    elif how == "uniform":
        t = u
    else:
        raise ValueError(f"unknown mc_time {how!r}")
    return time_eps + (1.0 - time_eps) * t


def mc_elbo(model, rows: Rows, rand: RowRandom, mask_id: int, vocab_chunk: int, samples: int,
            how: str, time_eps: float) -> Passes:  # fmt: skip
    """K-sample ELBO: pass k masks each completion token with probability t_k, weight
    1 / (K t_k)."""
    t = mc_times(rand, samples, how, time_eps)  # (K, R)
    u = rand((samples, rows.ids.shape[1])).permute(1, 0, 2)  # (K, R, L)
    masks = rows.canvas[None] & (u < t[:, :, None])
    weights = (1.0 / (samples * t))[:, :, None].expand_as(masks).contiguous()
    return _run(model, rows, masks, weights, mask_id, vocab_chunk)


def estimate(name: str, model, rows: Rows, rand: RowRandom, mask_id: int, vocab_chunk: int,
             *, prompt_mask_prob: float = 0.3, samples: int = 2, how: str = "antithetic",
             time_eps: float = 1e-3) -> Passes:  # fmt: skip
    """The passes of estimator `name` (one_step | coupled | mc)."""
    if name == "one_step":
        return one_step(model, rows, rand, mask_id, vocab_chunk, prompt_mask_prob)
    if name == "coupled":
        return coupled(model, rows, rand, mask_id, vocab_chunk)
    if name == "mc":
        return mc_elbo(model, rows, rand, mask_id, vocab_chunk, samples, how, time_eps)
    raise ValueError(f"unknown estimator {name!r}")


def upper_bound_tokens(passes: Passes, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SPG's per-token EUBO term (1/beta) log sum_k w_k p_k^beta, (R, L), and where it is
    defined (R, L) bool (some pass masked the token)."""
    defined = (passes.weights > 0).any(0)
    log_w = torch.where(passes.weights > 0, passes.weights.clamp_min(1e-30).log(),
                        torch.full_like(passes.weights, float("-inf")))  # fmt: skip
    terms = torch.logsumexp(beta * passes.logps + log_w, dim=0) / beta
    return torch.where(defined, terms, torch.zeros_like(terms)), defined
