"""Monte Carlo log-likelihood (an ELBO) of an answer given a prompt, and a perplexity bound.

LLaDA's estimator (docs/diffusion.md, Likelihood): per mini-batch of b rows draw
k ~ U{1..L}; row j masks exactly m_j = ((round(linspace(k, k + (b - 1) L / b, b)) - 1)
mod L) + 1 of the L answer tokens (the prompt is never masked); its loss is the masked
cross-entropy sum / (m_j / L). The log-likelihood bound is minus the mean over rows and
batches. For a one-token answer it is exact (the single token is always masked).
"""

import math
from dataclasses import dataclass

import torch
from torch import nn

from unmask.sampling.generate import cfg_combine


@dataclass
class Estimate:
    """A Monte Carlo estimate: mean (nats) and its standard error over mini-batches."""

    value: float
    stderr: float
    samples: int


def mask_counts(k: int, length: int, rows: int) -> torch.Tensor:
    """(rows,) long masked-token counts in 1..length, stratified around k (LLaDA)."""
    grid = torch.linspace(float(k), k + (rows - 1) * (length / rows), rows, dtype=torch.float64)
    return ((grid.round().long() - 1) % length) + 1


def _answer_logits(model, x, prompt_len, mask_id, cfg_scale):
    """Logits (B, L, V) for canvases x; guided against the prompt masked when cfg_scale > 0."""
    if cfg_scale <= 0:
        return model(x)
    uncond = x.clone()
    uncond[:, :prompt_len] = mask_id
    cond, un = model(torch.cat([x, uncond])).chunk(2)
    return cfg_combine(cond, un, cfg_scale)


@torch.no_grad()
def log_likelihood(
    model: nn.Module,
    prompt: torch.Tensor,
    answer: torch.Tensor,
    *,
    mask_id: int,
    mc_num: int = 128,
    batch_size: int = 16,
    cfg_scale: float = 0.0,
    generator: torch.Generator | None = None,
    shift_logits: bool = False,
) -> Estimate:
    """ELBO estimate of log p(answer | prompt) in nats; prompt (P,), answer (A,) long.

    mc_num rows in total, batch_size per forward pass (mc_num is rounded up to a
    multiple of batch_size). One-token answers need mc_num = batch_size = 1 (exact).
    shift_logits: Dream models predict position i from the output at i - 1 (the prompt
    must then hold at least one token).
    """
    if answer.numel() == 0:
        raise ValueError("the answer is empty")
    shift = 1 if shift_logits else 0
    if shift and prompt.numel() == 0:
        raise ValueError("a logit-shift (Dream) model needs a prompt token before the answer")
    if answer.numel() == 1:  # every row masks the single token: one row is exact
        mc_num = batch_size = 1
    batch_size = max(1, min(batch_size, mc_num))
    device = answer.device
    prompt_len, length = prompt.numel(), answer.numel()
    seq = torch.cat([prompt, answer]).to(device)[None]  # (1, P + A)
    per_batch = []
    for _ in range(math.ceil(mc_num / batch_size)):
        k = int(torch.randint(1, length + 1, (), generator=generator))
        counts = mask_counts(k, length, batch_size).to(device)  # (b,)
        order = torch.rand(batch_size, length, generator=generator).argsort(1).to(device)
        masked = order < counts[:, None]  # exactly counts[j] random positions, (b, A)
        x = seq.repeat(batch_size, 1)
        x[:, prompt_len:] = torch.where(masked, mask_id, x[:, prompt_len:])
        logits = _answer_logits(model, x, prompt_len, mask_id, cfg_scale)
        logits = logits[:, prompt_len - shift : prompt_len - shift + length]
        ce = torch.nn.functional.cross_entropy(
            logits.float().transpose(1, 2), seq[:, prompt_len:].expand(batch_size, -1),
            reduction="none",
        )  # (b, A)  # fmt: skip
        loss = (ce * masked).sum(1) / (counts.double() / length)  # (b,)
        per_batch.append(-float(loss.mean()))
    values = torch.tensor(per_batch, dtype=torch.float64)
    stderr = float(values.std() / math.sqrt(len(per_batch))) if len(per_batch) > 1 else 0.0
    return Estimate(float(values.mean()), stderr, len(per_batch) * batch_size)


@dataclass
class PerplexityBound:
    """exp(NELBO / tokens): an upper bound on the model's perplexity over a text."""

    nll_per_token: float
    perplexity: float
    tokens: int
    chunks: int
    stderr_per_token: float


@torch.no_grad()
def perplexity_bound(
    model: nn.Module,
    token_ids: list[int],
    *,
    mask_id: int,
    context: int = 512,
    mc_num: int = 32,
    batch_size: int = 16,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    shift_logits: bool = False,
) -> PerplexityBound:
    """Split token_ids into chunks of `context` tokens and sum each chunk's NELBO (no
    prompt, every token maskable): PPL <= exp(sum NELBO / tokens).

    shift_logits (Dream): each token is scored from the output before it, so a chunk's
    context is the one token before it and the text's first token is not scored (`tokens`
    counts the scored ones); a chunk is then context - 1 tokens plus that one."""
    shift = 1 if shift_logits else 0
    if len(token_ids) <= shift:
        raise ValueError("no tokens to score")
    total, variance, chunks, scored = 0.0, 0.0, 0, 0
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    width = max(1, context - shift)
    for start in range(shift, len(token_ids), width):
        chunk = ids[start : start + width]
        est = log_likelihood(model, ids[start - shift : start], chunk, mask_id=mask_id,
                             mc_num=mc_num, batch_size=batch_size, generator=generator,
                             shift_logits=shift_logits)  # fmt: skip
        total -= est.value
        variance += est.stderr**2
        chunks += 1
        scored += chunk.numel()
    per_token = total / scored
    return PerplexityBound(
        per_token, math.exp(per_token), scored, chunks, math.sqrt(variance) / scored
    )
