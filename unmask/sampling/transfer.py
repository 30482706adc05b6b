"""Per-step pieces of the sampler: propose tokens, score positions, choose which to commit.

- proposal: x0 = argmax of Gumbel-perturbed logits (float64) after filtering; this
  samples softmax(l / T) (LLaDA), T = 0 is argmax. Filtering follows Dream: the logits are
  tempered first, then nucleus (top_p), then top_k, so the nucleus is taken on softmax(l / T).
- confidence (`CONFIDENCE_FNS`): `low_confidence` softmax(l)[x0] on the untempered logits
  (LLaDA); `random`; Dream's `maskgit_plus` p(x0), `topk_margin` p1 - p2 and `entropy`
  sum p log p on the tempered, filtered distribution. All float64. More are added with
  `register_confidence` (from outside the package too).
- transfer: top-k per row, sampled positions (`alg_temp`), Fast-dLLM `threshold` and
  `factor`, Dream's `confidence_threshold` (a quota per step, what falls under the
  threshold carried to the next step), or Dream `origin` / MDLM ddpm (each mask revealed
  with probability 1 - s/t). Equal confidences are decided as the references decide them:
  by their torch.topk over the whole canvas row (`ranked`), or v2's argmax.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F


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
#: remasking rules that use no confidence score (each mask revealed at random)
REVEAL_RULES = ("origin",)


def remasking_choices() -> tuple[str, ...]:
    """Every `remasking` value, read when asked (not at import), so a score registered later
    (`register_confidence`) is a valid option, `--remasking` value and model_arg."""
    return (*CONFIDENCE_FNS, *REVEAL_RULES)


def register_confidence(name: str, fn: ConfidenceFn) -> None:
    """Add a confidence score under `name`, from inside unmask or outside it: it becomes a
    `remasking` choice of SamplingConfig (and so of `unmask generate --remasking`,
    generation_config.json and the lm-eval model_args) once registered, before the config
    or the command line is read.

    fn(logits, probs, x0, generator) -> (B, L) float64, higher = committed first: logits
    (B, L, V) untempered (EOS / EoT at -inf under confidence_eos_eot_inf), probs (B, L, V)
    the tempered, filtered distribution (None for `low_confidence` and `random`, which do
    not need it), x0 (B, L) long the proposals, generator the sampler's. The positions to
    commit are its top ones (the quota of the step, or threshold / factor when given)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a confidence name is a Python identifier (got {name!r})")
    if name in CONFIDENCE_FNS or name in REVEAL_RULES:
        raise ValueError(f"remasking {name!r} is already registered; choose another name")
    if not callable(fn):
        raise ValueError(f"confidence {name!r} must be callable (got {type(fn).__name__})")
    CONFIDENCE_FNS[name] = fn


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


def multinomial_tokens(
    logits: torch.Tensor,
    mask_id: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `propose_tokens`, but x0 drawn row by row with torch.multinomial from
    softmax(filtered / T) in the logits' dtype (T = 0: untempered, not the argmax), as
    LLaDA2's generate draws its block's proposals (`fill_rule: llada2`,
    `multinomial_draws`)."""
    filtered = filtered_logits(forbid_token(logits, mask_id), temperature, top_k, top_p)
    scaled = filtered / temperature if temperature not in (0.0, 1.0) else filtered
    probs = torch.softmax(scaled, dim=-1)  # (B, Lb, V)
    x0 = torch.stack([torch.multinomial(row, 1, generator=generator).squeeze(-1)
                      for row in probs])  # fmt: skip
    return x0, filtered


def sampling_probs(filtered: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(filtered / T) in float64 (T = 0: untempered): Dream's confidence basis."""
    scale = temperature if temperature > 0 else 1.0
    return torch.softmax(filtered.to(torch.float64) / scale, dim=-1)


def canvas_topk(
    confidence: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, offset: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference samplers' own ranking of rows `rows` (R,) long: for each row b,
    torch.topk(canvas_b, k[b]), canvas_b being the whole canvas row (width,) with
    confidence[b] (Lb,) at [offset, offset + Lb) and -inf elsewhere. LLaDA and Fast-dLLM
    call exactly this per row, Dream on the (B, width) canvas with one k; torch orders
    equal values by its partial-sort / nth_element pass, which depends on the row's length,
    contents and k, so only this call reproduces their tie order. Rows that share k are
    ranked in one call: torch's CPU topk ranks each row of a batch as it ranks that row
    alone (tested). Returns (values, indices) (R, max k[rows]), best first, indices into the
    block; past k[b], and where the pick is a -inf position outside the block, -inf."""
    n = confidence.shape[1]
    ks = k[rows]
    canvas = confidence.new_full((len(ks), width), float("-inf"))
    canvas[:, offset : offset + n] = confidence[rows]
    values = confidence.new_full((len(ks), int(ks.max())), float("-inf"))
    indices = torch.zeros(values.shape, dtype=torch.long, device=confidence.device)
    for kr in ks.unique().tolist():
        same = (ks == kr).nonzero().squeeze(1)
        v, i = canvas[same].topk(kr, dim=-1)
        inside = (i >= offset) & (i < offset + n)
        values[same, :kr] = v.masked_fill(~inside, float("-inf"))
        indices[same, :kr] = (i - offset).clamp(0, n - 1)
    return values, indices


def ranked(
    confidence: torch.Tensor,
    k: torch.Tensor,
    *,
    offset: int = 0,
    width: int | None = None,
    first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k[b] highest-confidence positions, best first, as the reference's
    torch.topk over the whole canvas row returns them (`canvas_topk`).

    confidence (B, Lb), -inf where not allowed: the block, at [offset, offset + Lb) of a
    canvas row of `width` positions (None: the block is the row); k (B,) long. A batched
    topk over the block gives the same set whenever the k-th and (k+1)-th values differ;
    with `first` (rules that treat rank 0 apart) also the same rank 0 whenever the top two
    differ. Only rows where they tie are ranked again by the reference's own call. Returns
    (values, indices) (B, max k), indices into the block; past k[b] the value is -inf (use
    only entries with a finite value).
    """
    batch, n = confidence.shape
    k = k.clamp(0, n)
    k_max = int(k.max()) if k.numel() else 0
    if k_max == 0:
        return confidence.new_empty((batch, 0)), k.new_empty((batch, 0))
    values, indices = confidence.topk(min(k_max + 1, n), dim=-1)  # (B, k_max [+ 1])
    # ranks k - 1 and k (columns k and k + 1; NaN where a row has no such rank)
    edge = F.pad(values, (1, 1), value=float("nan")).gather(1, torch.stack([k, k + 1], 1))
    tied = (edge[:, 0] == edge[:, 1]) & (edge[:, 1] > float("-inf"))
    if first and values.shape[1] > 1:  # ranks 0 and 1
        tied |= (values[:, 0] == values[:, 1]) & (values[:, 1] > float("-inf")) & (k > 1)
    past = torch.arange(k_max, device=k.device) >= k[:, None]
    values, indices = values[:, :k_max].masked_fill(past, float("-inf")), indices[:, :k_max]
    rows = tied.nonzero().squeeze(1)
    if rows.numel():
        v, i = canvas_topk(confidence, k, rows, offset, n if width is None else width)
        values[rows, : v.shape[1]], indices[rows, : i.shape[1]] = v, i  # beyond: past k[b]
    return values, indices


def _positions(indices: torch.Tensor, keep: torch.Tensor, n: int) -> torch.Tensor:
    """Bool (B, n): True at indices[b, r] where keep[b, r]."""
    index = torch.where(keep, indices, n)  # column n: a bin for what is not kept
    marked = torch.zeros((indices.shape[0], n + 1), dtype=torch.bool, device=indices.device)
    return marked.scatter(1, index, True)[:, :n]


def select_top_k(
    confidence: torch.Tensor, k: torch.Tensor, *, offset: int = 0, width: int | None = None
) -> torch.Tensor:
    """Bool (B, Lb): the k[b] highest-confidence positions of each row b, equal confidences
    decided as LLaDA's torch.topk over the canvas row decides them (`ranked`).

    confidence (B, Lb) with -inf at positions that must not be chosen (never chosen, even
    when k[b] exceeds what is allowed); k (B,) long; offset / width: the block's place in
    the canvas row.
    """
    values, indices = ranked(confidence, k, offset=offset, width=width)
    return _positions(indices, values > float("-inf"), confidence.shape[1])


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


def select_threshold(
    confidence: torch.Tensor,
    threshold: float,
    *,
    offset: int = 0,
    width: int | None = None,
    first_max: bool = False,
) -> torch.Tensor:
    """Bool (B, Lb): the top position of each row that has one, plus every position with
    confidence >= threshold (Fast-dLLM parallel decoding).

    Among equal top confidences below the threshold the one committed is Fast-dLLM's: rank 0
    of torch.topk over the canvas row with k = the allowed count (v1), or with `first_max`
    the first of them, as v2's argmax over its sub-block picks.
    """
    allowed = torch.isfinite(confidence)
    has = allowed.any(-1)
    if first_max:
        top = confidence.argmax(-1)  # the first of equal maxima
    else:
        values, order = confidence.topk(min(2, confidence.shape[1]), dim=-1)
        top = order[:, 0]
        if values.shape[1] > 1:
            tied = torch.isfinite(values[:, 1]) & (values[:, 0] == values[:, 1])
            rows = (tied & (values[:, 0] < threshold)).nonzero().squeeze(1)
            if rows.numel():
                width = confidence.shape[1] if width is None else width
                top[rows] = canvas_topk(confidence, allowed.sum(-1), rows, offset, width)[1][:, 0]
    first = torch.zeros_like(allowed).scatter(1, top[:, None], has[:, None])
    return first | (allowed & (confidence >= threshold))


def select_carried_threshold(
    confidence: torch.Tensor,
    quota: torch.Tensor,
    threshold: float,
    *,
    offset: int = 0,
    width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dream's `confidence_threshold`: of the quota[b] highest-confidence positions of row
    b, the top one and every one with confidence >= threshold; the rest of the quota is
    returned, to be added to the next step's. Returns (bool (B, L), carried (B,) long).

    confidence (B, L), -inf where not allowed; quota (B,) long (only positions allowed are
    counted, so a row never carries more than it has left). Ranked as Dream's topk over the
    canvas row ranks them (`ranked`)."""
    allowed = torch.isfinite(confidence)
    quota = torch.minimum(quota, allowed.sum(-1))
    values, indices = ranked(confidence, quota, offset=offset, width=width, first=True)
    rank = torch.arange(values.shape[1], device=confidence.device)
    keep = (values > float("-inf")) & ((rank[None, :] == 0) | (values >= threshold))
    commit = _positions(indices, keep, confidence.shape[1])
    return commit, quota - commit.sum(-1)


def select_factor(
    confidence: torch.Tensor, factor: float, *, offset: int = 0, width: int | None = None
) -> torch.Tensor:
    """Bool (B, Lb): ranks r = 1, 2, ... (by confidence) accepted while
    conf_r >= 1 - factor / (r + 1); rank 1 always (Fast-dLLM factor rule). As in Fast-dLLM,
    the count comes from the sorted values and the positions from topk over the canvas row
    with that count (`select_top_k`)."""
    ordered = confidence.sort(dim=-1, descending=True).values
    rank = torch.arange(1, confidence.shape[1] + 1, device=confidence.device)
    ok = (ordered >= 1.0 - factor / (rank + 1.0)) & torch.isfinite(ordered)
    ok[:, 0] = torch.isfinite(ordered[:, 0])
    count = ok.long().cumprod(dim=-1).sum(-1)  # the accepted prefix of the ranking
    return select_top_k(confidence, count, offset=offset, width=width)


def select_origin(
    allowed: torch.Tensor, fraction: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Bool (B, L): each allowed (masked, in-block) position with probability `fraction`."""
    u = torch.rand(allowed.shape, generator=generator, device=allowed.device, dtype=torch.float64)
    return allowed & (u < fraction)
