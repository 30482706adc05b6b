"""Training objectives: one call signature for all of them.

`objective(model, batch, generator) -> ObjectiveOutput(loss_sum, count)`. The trainer
sums both over micro-batches and ranks before dividing, so gradient accumulation gives
the same gradient as one big batch however many tokens each micro-batch masks.
`objective.count(batch)` gives that count before the forward when the batch alone fixes it,
so the trainer can scale each micro-batch's loss instead of every gradient afterwards.
"""

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch
from torch import nn

from unmask.diffusion.config import DiffusionConfig
from unmask.diffusion.loss import IGNORE_INDEX
from unmask.diffusion.noise import RowSlice, loss_weight, mask_tokens, replace_tokens, sample_t
from unmask.diffusion.registry import (
    ObjectiveContext,
    ObjectiveSpec,
    always,
    register_objective,
)

_NOISE_KEYS = ("t", "noisy_input_ids", "masked")


class ObjectiveOutput(NamedTuple):
    """What every objective returns; unpacks as `loss_sum, count = objective(...)`."""

    loss_sum: torch.Tensor
    """0-d float32 with grad: sum of weighted per-token losses."""
    count: torch.Tensor
    """0-d float32: the normalizer this objective wants (summed before dividing)."""


class Objective:
    """Every hook the trainer calls on an objective, with the default a plain per-row
    objective wants; an objective subclasses this and overrides what it has.

    `objective(model, batch, generator) -> ObjectiveOutput(loss_sum, count)` is the one
    required method. The others:

    - `global_noise` True: each row's noise is drawn on its own, so each rank of a
      multi-process run draws the randomness of the whole global batch and keeps its rows'
      (`with_noise(batch, generator, rows=(offset, total))`): losses then do not depend on
      the world size. False: each rank draws for its own rows from its own generator and
      `with_noise` is not called (but in evaluation, see there).
    - `count(batch)`: the `count` a call on this batch returns, from the batch alone (0-d
      float32), or None when it depends on what the call draws; then the trainer scales
      the gradients after the backward instead of each micro-batch's loss before it.
    - `begin_step(step)`: called with the trainer's step before its micro-batches (grpo:
      inner iterations reuse the rollouts of their cycle).
    - `last_stats`: after each call, detached 0-d tensors (no device sync); the trainer
      reads `num_masked` for the LM head's FLOPs (absent: every token).
    - `step_sums`: after each call, detached sums over the call's rows that the trainer adds
      over micro-batches and ranks and logs divided by the step's count (preference: the
      reward margin and accuracy).
    - `take_log()`: metrics gathered since the last call, logged at logging steps (grpo:
      rewards, lengths, samples).
    - `eval_objective`: what eval_loss measures instead of this objective (grpo: the
      masked-diffusion loss of the held-out answers); None: this objective.
    - `rank_state()` / `load_rank_state(state)`: state carried from one step to the next
      that is this rank's own (grpo's rollouts reused by inner iterations): tensors, ints,
      lists, dicts, {} when there is none; saved per rank in every checkpoint. Loading
      returns None, or why the state does not fit this run (the trainer says so and goes on
      without it); {} forgets any.
    - `close()`: when train() ends, also by an error (grpo: the rewards' worker processes).
    """

    global_noise: bool = False
    last_stats: Mapping[str, torch.Tensor] = MappingProxyType({})
    step_sums: Mapping[str, torch.Tensor] = MappingProxyType({})
    eval_objective: "Objective | None" = None

    def __call__(
        self, model: nn.Module, batch: dict, generator: torch.Generator | None = None
    ) -> ObjectiveOutput:
        raise NotImplementedError(f"{type(self).__name__} does not define __call__")

    def with_noise(
        self, batch: dict, generator: torch.Generator | None = None, rows: RowSlice | None = None
    ) -> dict:
        """The batch with the noise this objective would draw for it (`global_noise`);
        rows: the batch is that slice of a larger one (`RowSlice`). Default: unchanged."""
        return batch

    def count(self, batch: dict) -> torch.Tensor | None:
        return None

    def begin_step(self, step: int) -> None:
        return None

    def take_log(self) -> dict:
        return {}

    def rank_state(self) -> dict:
        return {}

    def load_rank_state(self, state: dict) -> str | None:
        return None

    def close(self) -> None:
        return None


def mdlm_loss_terms(
    ce: torch.Tensor, masked: torch.Tensor, weight: torch.Tensor, maskable: torch.Tensor
) -> ObjectiveOutput:
    """MDLM/LLaDA ELBO terms from per-token cross-entropy.

    ce (B, L) float, masked (B, L) bool, weight (B,) per-row w(t), maskable (B, L) bool.
    loss_sum = sum over masked i of ce_i * w(t_row); count = number of maskable tokens
    (LLaDA divides by B * L when everything is maskable; dividing by the number of
    *masked* tokens instead is not the ELBO).
    """
    terms = ce.float() * weight.float()[:, None]
    loss_sum = torch.where(masked, terms, torch.zeros_like(terms)).sum()
    count = maskable.sum().to(torch.float32)
    return ObjectiveOutput(loss_sum, count)


def answer_lengths(input_ids: torch.Tensor, maskable: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B,) float: each row's maskable tokens up to and including its first maskable EOS
    (the answer and the EOS that ends it; supervised EOS padding after it not counted).
    A row whose maskable tokens hold no EOS counts them all."""
    is_eos = (input_ids == eos_id) & maskable
    before = is_eos.long().cumsum(1) - is_eos.long()  # EOS strictly before each position
    return (maskable & (before == 0)).sum(1).float()


def row_scales(
    maskable: torch.Tensor,
    mode: str,
    input_ids: torch.Tensor | None = None,
    eos_id: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(per-row factor (B,) or None, count) of a loss normalization (docs/diffusion.md):
    `token` sums everything over one global count of maskable tokens (no factor);
    `answer_padded` / `answer` divide each row by its maskable tokens / its answer length
    and count rows with an answer, so the global division is the mean over rows."""
    if mode == "token":
        return None, maskable.sum().to(torch.float32)
    if mode == "answer_padded":
        lengths = maskable.sum(1).float()
    elif mode == "answer":
        if eos_id is None or input_ids is None:
            raise ValueError("loss_normalization 'answer' needs the EOS id")
        lengths = answer_lengths(input_ids, maskable, eos_id)
    else:
        raise ValueError(f"unknown loss normalization {mode!r}")
    has_answer = lengths > 0
    return has_answer.float() / lengths.clamp(min=1), has_answer.sum().float()


def normalized_terms(
    terms: torch.Tensor,
    maskable: torch.Tensor,
    mode: str,
    input_ids: torch.Tensor | None = None,
    eos_id: int | None = None,
) -> ObjectiveOutput:
    """(loss_sum, count) of masked per-token terms (B, L) (0 where not masked) under a
    loss normalization (`row_scales`)."""
    scale, count = row_scales(maskable, mode, input_ids, eos_id)
    if scale is None:
        return ObjectiveOutput(terms.sum(), count)
    return ObjectiveOutput((terms.sum(1) * scale).sum(), count)


class MaskedDiffusionObjective(Objective):
    """MDLM / LLaDA pretraining: weighted cross-entropy on masked tokens.

    Batch keys: `input_ids` (B, L) long; optional `doc_ids`, `position_ids` (passed to
    the model), `maskable` (B, L) bool (default all True). If the batch carries
    precomputed noise (`t` (B,), `noisy_input_ids` (B, L), `masked` (B, L) bool) it is
    used as is; otherwise it is sampled with `generator`. The model is called as
    `model(noisy_ids, doc_ids=, position_ids=, targets=, vocab_chunk=)` and returns the
    per-token cross-entropy (B, L) float32 (0 where targets == -100).
    After each call `last_stats` holds detached 0-d tensors (no device sync):
    mean_t, num_masked, num_maskable (and num_edited with the editing stream on).

    `diffusion.edit_fraction` > 0 (LLaDA2.1's editing stream, docs/diffusion.md): after
    masking, that share of the kept tokens is replaced by random tokens from `edit_ids`
    (`edit`), and every kept token joins the loss with weight 1.
    """

    #: Each row's noise is drawn on its own, so a multi-process run can draw the noise of
    #: the whole global batch first (`with_noise`) and give each rank its rows: losses then
    #: do not depend on the world size. Objectives that draw more per batch (cutoffs,
    #: prompt drops, per-block t) set False and draw on their own rows.
    global_noise = True

    #: the loss normalization `loss_normalization: auto` means for this objective
    default_normalization = "token"

    def __init__(self, cfg: DiffusionConfig, mask_id: int, eos_id: int | None = None):
        self.cfg = cfg
        self.mask_id = mask_id
        self.eos_id = eos_id  # `answer` normalization finds each answer's end by its EOS
        self.last_stats: dict[str, torch.Tensor] = {}
        #: (K,) long ascending: the tokens an edited position may take (`edit_fraction`);
        #: the registry's builder sets them from the tokenizer (`replacement_ids`)
        self.edit_ids: torch.Tensor | None = None

    @property
    def normalization(self) -> str:
        mode = self.cfg.loss_normalization
        return self.default_normalization if mode == "auto" else mode

    def _normalized(self, terms, maskable, input_ids) -> ObjectiveOutput:
        return normalized_terms(terms, maskable, self.normalization, input_ids, self.eos_id)

    def _scaled(self, coef, maskable, input_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """(coef with each row scaled by the normalization, count)."""
        scale, count = row_scales(maskable, self.normalization, input_ids, self.eos_id)
        return (coef if scale is None else coef * scale[:, None]), count

    def noise(
        self, batch: dict, generator: torch.Generator | None = None, rows: RowSlice | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(t (B,), noisy_input_ids (B, L), masked (B, L)) from the batch or freshly drawn;
        rows: the batch is that slice of a larger one (`RowSlice`)."""
        present = [k for k in _NOISE_KEYS if k in batch]
        if present:
            if len(present) != len(_NOISE_KEYS):
                missing = sorted(set(_NOISE_KEYS) - set(present))
                raise ValueError(f"precomputed noise needs {_NOISE_KEYS}; missing {missing}")
            return batch["t"], batch["noisy_input_ids"], batch["masked"]
        input_ids = batch["input_ids"]
        cfg = self.cfg
        t = sample_t(input_ids.shape[0], cfg.t_sampling, cfg.time_eps, generator,
                     input_ids.device, rows)  # fmt: skip
        noisy, masked = mask_tokens(
            input_ids,
            t,
            maskable_of(batch),
            self.mask_id,
            generator,
            schedule=cfg.schedule,
            min_masked=cfg.min_masked,
            rows=rows,
        )
        noisy = self.edit(input_ids, noisy, masked, maskable_of(batch), generator, rows)
        return t, noisy, masked

    def edit(
        self,
        input_ids: torch.Tensor,
        noisy: torch.Tensor,
        masked: torch.Tensor,
        maskable: torch.Tensor,
        generator: torch.Generator | None = None,
        rows: RowSlice | None = None,
    ) -> torch.Tensor:
        """noisy with `edit_fraction` of the kept tokens (maskable, not masked) replaced
        by other tokens of `edit_ids` (`replace_tokens`: two more draws of the batch's
        shape from `generator`); unchanged, drawing nothing, when edit_fraction is 0."""
        fraction = self.cfg.edit_fraction
        if fraction <= 0:
            return noisy
        if self.edit_ids is None or self.edit_ids.numel() < 2:
            raise ValueError(
                "diffusion.edit_fraction needs the tokens a kept one may be replaced by: "
                "build_objective(cfg, mask_id, tokenizer=...) or set objective.edit_ids"
            )
        if self.edit_ids.device != input_ids.device:  # moved once, not at every call
            self.edit_ids = self.edit_ids.to(input_ids.device)
        kept = maskable & ~masked
        noisy, _ = replace_tokens(input_ids, noisy, kept, fraction, self.edit_ids, generator,
                                  rows)  # fmt: skip
        return noisy

    def count(self, batch: dict) -> torch.Tensor | None:
        """The normalizer `__call__` returns for this batch (its maskable tokens), from the
        batch alone: the trainer scales each micro-batch's loss by 1 / (the step's total)
        before backward instead of every gradient after it. Equal to the call's count for
        every objective (tests/unit/test_trainer_step.py); None in a subclass whose count
        depends on what the call draws."""
        maskable = maskable_of(batch)
        if self.normalization == "token":
            return maskable.sum().to(torch.float32)
        zeros = torch.zeros(maskable.shape, dtype=torch.float32, device=maskable.device)
        return self._normalized(zeros, maskable, batch["input_ids"]).count

    def with_noise(
        self, batch: dict, generator: torch.Generator | None = None, rows: RowSlice | None = None
    ) -> dict:
        """The batch with its noise drawn (`t`, `noisy_input_ids`, `masked`); rows: the batch
        is that slice of a larger one, whose noise is drawn whole (`RowSlice`)."""
        t, noisy, masked = self.noise(batch, generator, rows)
        return {**batch, "t": t, "noisy_input_ids": noisy, "masked": masked}

    def __call__(
        self, model: nn.Module, batch: dict, generator: torch.Generator | None = None
    ) -> ObjectiveOutput:
        input_ids = batch["input_ids"]
        maskable = maskable_of(batch)
        t, noisy, masked = self.noise(batch, generator)
        weight = loss_weight(t, self.cfg.loss_weight, self.cfg.schedule).float()
        scored, coef = scored_positions(masked, maskable, weight, self.cfg.edit_fraction)
        targets = torch.where(scored, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
        coef, count = self._scaled(coef, maskable, input_ids)
        loss_sum = weighted_token_loss(
            model, noisy, batch, targets, coef, self.cfg.vocab_chunk_size
        )
        self.last_stats = self.stats(t, masked, maskable, input_ids, noisy)
        return ObjectiveOutput(loss_sum, count)

    def stats(self, t, masked, maskable, input_ids, noisy) -> dict:
        """`last_stats` of a call (`objective_stats`), num_edited with the editing stream."""
        if self.cfg.edit_fraction > 0:
            return objective_stats(t, masked, maskable, input_ids, noisy)
        return objective_stats(t, masked, maskable)


def scored_positions(
    masked: torch.Tensor, maskable: torch.Tensor, weight: torch.Tensor, edit_fraction: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scored (B, L) bool, coef (B, L) float32): the positions a masked objective's loss
    covers and their weights: the masked ones with `weight` ((B,) per row or (B, L) per
    position); with the editing stream on (edit_fraction > 0) also every kept one
    (maskable, not masked: replaced or not) with weight 1 (docs/diffusion.md, Token
    editing)."""
    if weight.dim() == 1:
        weight = weight[:, None]
    coef = torch.where(masked, weight, 0.0)
    if edit_fraction <= 0:
        return masked, coef
    kept = maskable & ~masked
    return masked | kept, torch.where(kept, 1.0, coef)


def replacement_ids(tokenizer, mask_id: int) -> torch.Tensor:
    """(K,) long ascending: the ids an edited position may take: every id of the tokenizer
    (`len(tokenizer)`: its added tokens too) but its special tokens (padding, EOS, ...) and
    the mask."""
    special = set(tokenizer.all_special_ids) | {mask_id}
    return torch.tensor([i for i in range(len(tokenizer)) if i not in special], dtype=torch.long)


def maskable_of(batch: dict) -> torch.Tensor:
    """(B, L) bool: the batch's `maskable`, or every position when it has none."""
    maskable = batch.get("maskable")
    if maskable is None:
        return torch.ones_like(batch["input_ids"], dtype=torch.bool)
    return maskable.bool()


def token_losses(
    model: nn.Module,
    noisy: torch.Tensor,
    batch: dict,
    targets: torch.Tensor,
    vocab_chunk: int,
    **extra,
) -> torch.Tensor:
    """Per-token cross-entropy (B, L) float32 of the model on noisy ids (0 where targets is
    -100; the LM head runs only on target rows); `extra` goes to the model's forward."""
    return model(
        noisy,
        doc_ids=batch.get("doc_ids"),
        position_ids=batch.get("position_ids"),
        targets=targets,
        vocab_chunk=vocab_chunk,
        **extra,
    )


def weighted_token_loss(
    model: nn.Module,
    noisy: torch.Tensor,
    batch: dict,
    targets: torch.Tensor,
    coef: torch.Tensor,
    vocab_chunk: int,
) -> torch.Tensor:
    """sum over positions with a target of coef * CE, 0-d float32: the number
    `(coef * token_losses(...)).sum()` gives, from a model that computes it with the LM
    head's gradients in its forward pass when it offers that (`accepts_target_weights`:
    the native transformer; one pass over the head fewer, diffusion/loss.py)."""
    if getattr(model, "accepts_target_weights", False):
        return token_losses(model, noisy, batch, targets, vocab_chunk, target_weights=coef)
    ce = token_losses(model, noisy, batch, targets, vocab_chunk)
    return torch.where(targets != IGNORE_INDEX, ce.float() * coef, 0.0).sum()


def objective_stats(
    t: torch.Tensor,
    masked: torch.Tensor,
    maskable: torch.Tensor,
    input_ids: torch.Tensor | None = None,
    noisy: torch.Tensor | None = None,
) -> dict:
    """An objective's `last_stats`: mean t, masked and maskable token counts (detached);
    given the clean and the noisy ids (the editing stream), the replaced kept tokens too."""
    stats = {
        "mean_t": t.detach().float().mean(),
        "num_masked": masked.sum().detach().float(),
        "num_maskable": maskable.sum().detach().float(),
    }
    if input_ids is not None and noisy is not None:
        replaced = (noisy != input_ids) & maskable & ~masked
        stats["num_edited"] = replaced.sum().detach().float()
    return stats


def masked_builder(cls: type[MaskedDiffusionObjective]):
    """The registry builder of a masked-diffusion objective class: (cfg, mask_id), and the
    EOS id where answers end."""

    def build(context: ObjectiveContext) -> MaskedDiffusionObjective:
        objective = cls(context.diffusion, context.mask_id)
        objective.eos_id = context.eos_id
        if context.diffusion.edit_fraction > 0 and context.tokenizer is not None:
            objective.edit_ids = replacement_ids(context.tokenizer, context.mask_id)
        return objective

    return build


for _name in ("mdlm", "llada", "bert"):  # bert: the mdlm loss on a transformers encoder
    register_objective(ObjectiveSpec(
        _name, masked_builder(MaskedDiffusionObjective), accepts_loss_normalization=True,
        accepts_context_parallel=True, accepts_pipeline_parallel=always,
        accepts_adaptation=_name != "bert", accepts_edit_fraction=True,
    ))  # fmt: skip
