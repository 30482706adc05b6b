"""Monte Carlo log-likelihood (an ELBO) of an answer given a prompt, and a perplexity bound.

LLaDA's estimator (docs/diffusion.md, Likelihood): per mini-batch of b rows draw
k ~ U{1..L}; row j masks exactly m_j = ((round(linspace(k, k + (b - 1) L / b, b)) - 1)
mod L) + 1 of the L answer tokens (the prompt is never masked); its loss is the masked
cross-entropy sum / (m_j / L). The log-likelihood bound is minus the mean over rows and
batches. For a one-token answer it is exact (the single token is always masked).

The mini-batch is the independent draw (its rows share k and are stratified around it), so
the standard error is the sample standard deviation of the per-batch means over
sqrt(batches), and unknown (None) with a single batch.

`answer_log_likelihood` is the text-level entry point shared by lm-eval's `loglikelihood`
(unmask.eval.harness) and `unmask eval --pairs`.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from unmask.sampling.generate import cfg_combine
from unmask.sampling.texts import SamplingModel

#: what follows an answer on the canvas and is scored with it (`eos_tail`)
ANSWER_ENDS = ("none", "eos", "pad")


@dataclass
class Estimate:
    """A Monte Carlo estimate of a log-likelihood bound, in nats.

    stderr: standard error of the mean over `draws` independent mini-batches; None where it
    cannot be estimated (one draw), 0.0 where the value is exact (a one-token answer)."""

    value: float
    stderr: float | None
    samples: int  # rows scored (mc_num rounded up to whole mini-batches)
    draws: int = 1  # independent mini-batches


def standard_error(values: Sequence[float]) -> float | None:
    """Standard error of the mean of independent draws: sample std (n - 1) / sqrt(n);
    None for fewer than two draws (a single draw says nothing about the spread)."""
    if len(values) < 2:
        return None
    return float(torch.tensor(values, dtype=torch.float64).std() / math.sqrt(len(values)))


def combined_stderr(stderrs: Sequence[float | None]) -> float | None:
    """Standard error of a sum of independent estimates: sqrt(sum of squares); None if any
    term's is unknown."""
    if any(s is None for s in stderrs):
        return None
    return math.sqrt(sum(s * s for s in stderrs))


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
    multiple of batch_size); each forward pass is one independent draw, so the stderr
    needs mc_num > batch_size. One-token answers need mc_num = batch_size = 1 (exact).
    shift_logits: Dream models predict position i from the output at i - 1 (the prompt
    must then hold at least one token).
    """
    if answer.numel() == 0:
        raise ValueError("the answer is empty")
    shift = 1 if shift_logits else 0
    if shift and prompt.numel() == 0:
        raise ValueError("a logit-shift (Dream) model needs a prompt token before the answer")
    exact = answer.numel() == 1
    if exact:  # every row masks the single token: one row is exact
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
    stderr = 0.0 if exact else standard_error(per_batch)
    value = math.fsum(per_batch) / len(per_batch)
    return Estimate(value, stderr, len(per_batch) * batch_size, len(per_batch))


@dataclass
class PerplexityBound:
    """exp(NELBO / tokens): an upper bound on the model's perplexity over a text.

    stderr_per_token: the standard error of nll_per_token (None if a chunk's is unknown)."""

    nll_per_token: float
    perplexity: float
    tokens: int
    chunks: int
    stderr_per_token: float | None

    @property
    def nelbo(self) -> float:
        """The text's NELBO in nats (minus the log-likelihood bound)."""
        return self.nll_per_token * self.tokens

    @property
    def stderr(self) -> float | None:
        """Standard error of `nelbo`."""
        return None if self.stderr_per_token is None else self.stderr_per_token * self.tokens


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
    total, stderrs, scored = 0.0, [], 0
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    width = max(1, context - shift)
    for start in range(shift, len(token_ids), width):
        chunk = ids[start : start + width]
        est = log_likelihood(model, ids[start - shift : start], chunk, mask_id=mask_id,
                             mc_num=mc_num, batch_size=batch_size, generator=generator,
                             shift_logits=shift_logits)  # fmt: skip
        total -= est.value
        stderrs.append(est.stderr)
        scored += chunk.numel()
    per_token = total / scored
    stderr = combined_stderr(stderrs)  # chunks draw independent masks
    return PerplexityBound(per_token, math.exp(per_token), scored, len(stderrs),
                           None if stderr is None else stderr / scored)  # fmt: skip


def eos_tail(end: str, eos_id: int | None, used: int, row_length: int | None = None) -> list[int]:
    """The EOS ids scored after an answer, `used` = prompt + answer tokens (ANSWER_ENDS):

    - `none`: nothing; the answer may go on (lm-eval, LLaDA's get_log_likelihood).
    - `eos`: one EOS, the answer ends there (packed training ends every document with one).
    - `pad`: EOS up to `row_length` tokens in all, the way padded training rows are filled
      (data.packing: false, supervise_padding: true, the quickstart); nothing when prompt and
      answer already fill the row (training truncated such rows).
    """
    if end not in ANSWER_ENDS:
        raise ValueError(f"unknown answer end {end!r}; expected one of {list(ANSWER_ENDS)}")
    if end == "none":
        return []
    if eos_id is None:
        raise ValueError(f"answer end {end!r} needs an EOS token; the tokenizer has none")
    if end == "eos":
        return [eos_id]
    if row_length is None:
        raise ValueError("answer end 'pad' needs the row length")
    return [eos_id] * max(0, row_length - used)


def continuation_ids(
    tokenizer, context: str, continuation: str, max_length: int | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of context and continuation, split where the whole text tokenizes (lm-eval's
    rule); the context is cut from the left so both fit in max_length tokens."""

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    whole, ctx = encode(context + continuation), encode(context)
    cont = whole[len(ctx) :] if whole[: len(ctx)] == ctx else encode(continuation)
    if not cont:
        cont = encode(continuation)
    if max_length is not None and ctx:
        ctx = ctx[-max(1, max_length - len(cont)) :]
    return ctx, cont


def item_generator(seed: int, index: int) -> torch.Generator:
    """The masks' generator of item `index` of a scored list, seeded seed + index: an item's
    draws depend on its place, not on what was scored before it, and two lists scored with
    one seed share masks item by item where the scored lengths agree (common random numbers
    when comparing answers)."""
    return torch.Generator().manual_seed(seed + index)


def with_start_token(sm: SamplingModel, context: list[int], shift_logits: bool) -> list[int]:
    """The context, or BOS (else EOS) for an empty one under the logit shift (Dream): the
    first answer token is read from the output before it."""
    if context or not shift_logits:
        return context
    tok = sm.tokenizer
    return [tok.bos_token_id if tok.bos_token_id is not None else sm.eos_id]


def answer_log_likelihood(
    sm: SamplingModel,
    context: list[int],
    answer: list[int],
    *,
    mc_num: int,
    batch_size: int,
    cfg_scale: float = 0.0,
    shift_logits: bool = False,
    generator: torch.Generator | None = None,
) -> Estimate:
    """ELBO estimate of log p(answer | context) from token ids: lm-eval's `loglikelihood`
    and `unmask eval --pairs`. Only `answer` is masked and scored (append any EOS to score
    with it, `eos_tail`); an empty context under the logit shift: `with_start_token`."""
    context = with_start_token(sm, context, shift_logits)
    return log_likelihood(
        sm.model, torch.tensor(context, dtype=torch.long, device=sm.device),
        torch.tensor(answer, dtype=torch.long, device=sm.device), mask_id=sm.mask_id,
        mc_num=mc_num, batch_size=batch_size, cfg_scale=cfg_scale, generator=generator,
        shift_logits=shift_logits,
    )  # fmt: skip
