"""The objectives beyond MDLM pretraining: LLaDA SFT, Dream, and BD3LM block diffusion.

Each has the one signature `(model, batch, generator) -> ObjectiveOutput(loss_sum, count)`
(see objectives.py); formulas and sources are in docs/diffusion.md.
"""

import math

import torch
from torch import nn

from unmask.diffusion.config import DiffusionConfig, parse_loss_weight
from unmask.diffusion.cutoffs import (
    document_starts,
    perbatch_cutoff,
    prompt_positions,
    resp_cutoff,
)
from unmask.diffusion.loss import IGNORE_INDEX
from unmask.diffusion.noise import force_one_masked, loss_weight, mask_prob, sample_t
from unmask.diffusion.objectives import (
    MaskedDiffusionObjective,
    ObjectiveOutput,
    maskable_of,
    masked_builder,
    objective_stats,
    scored_positions,
    weighted_token_loss,
)
from unmask.diffusion.registry import ObjectiveSpec, always, register_objective

# -- pure pieces ---------------------------------------------------------------------------


def shift_logits(logits: torch.Tensor) -> torch.Tensor:
    """Dream's shift: logits'[:, 0] = logits[:, 0], logits'[:, i] = logits[:, i - 1]."""
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


def cart_weights(masked: torch.Tensor, geo_p: float, doc_ids: torch.Tensor | None = None):
    """Dream's CART weight per position: 0.5 * sum over clean j != i of p (1 - p)^(|i-j| - 1).

    masked (B, L) bool -> (B, L) float32 (only masked positions are used by the loss). With
    doc_ids, only clean tokens of the same document count.
    """
    length = masked.shape[1]
    idx = torch.arange(length, device=masked.device)
    dist = (idx[:, None] - idx[None, :]).abs().float()
    kernel = geo_p * (1.0 - geo_p) ** (dist - 1.0)
    kernel.fill_diagonal_(0.0)  # (L, L)
    clean = (~masked).float()
    if doc_ids is None:
        return 0.5 * clean @ kernel  # kernel is symmetric
    # only clean tokens of the token's own document: the kernel masked per row, a block of
    # query positions at a time (a (B, L, L) float matrix for long rows otherwise)
    out = torch.empty_like(clean)
    for start in range(0, length, CART_QUERY_BLOCK):
        stop = min(start + CART_QUERY_BLOCK, length)
        same = doc_ids[:, start:stop, None] == doc_ids[:, None, :]  # (B, q, L)
        out[:, start:stop] = torch.bmm(kernel[start:stop] * same, clean[:, :, None])[..., 0]
    return 0.5 * out


#: query positions per block of the document-aware CART weights
CART_QUERY_BLOCK = 512


def bd3lm_attention_mask(length: int, block_size: int, device=None) -> torch.Tensor:
    """(2L, 2L) bool mask for the x_t (first L) + x0 (last L) input; True = may attend.

    x_t block b sees its own x_t block and x0 blocks < b; x0 block b sees x0 blocks <= b.
    Blocks of block_size from position 0 (see `bd3lm_block_mask` for per-row blocks).
    """
    block = torch.arange(length, device=device) // block_size
    return bd3lm_block_mask(block[None])[0]


def bd3lm_block_mask(block: torch.Tensor) -> torch.Tensor:
    """(B, 2L, 2L) the same rule for per-row block indices block (B, L)."""
    same = block[:, :, None] == block[:, None, :]
    before = block[:, :, None] > block[:, None, :]
    upto = block[:, :, None] >= block[:, None, :]
    top = torch.cat([same, before], dim=2)
    bottom = torch.cat([torch.zeros_like(same), upto], dim=2)
    return torch.cat([top, bottom], dim=1)


def dense_ids(ids: torch.Tensor) -> torch.Tensor:
    """(B, L) ids renumbered 0, 1, ... per row in increasing order of id (each row's ids
    then index a tensor of L columns): by a sort, so nothing is read back from the device to
    size anything, where unique() or max() would be."""
    ordered, order = ids.sort(dim=1)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    return torch.empty_like(ids).scatter_(1, order, starts.long().cumsum(1) - 1)


def bd3lm_blocks(
    position_ids: torch.Tensor, maskable: torch.Tensor, doc_ids: torch.Tensor | None,
    block_size: int,
) -> torch.Tensor:  # fmt: skip
    """(B, L) block index of every token: blocks of block_size start where each document's
    maskable part starts (its answer; position 0 for a plain document), and the prompt
    before it is cut into blocks -1, -2, ... from its end: the layout the block-causal
    sampler (`unmask.sampling.generate.canvas_blocks`) decodes with."""
    docs = torch.zeros_like(position_ids) if doc_ids is None else dense_ids(doc_ids.long())
    big = torch.iinfo(torch.long).max
    first = torch.full(docs.shape, big, device=docs.device)
    candidates = torch.where(maskable, position_ids, torch.full_like(position_ids, big))
    first = first.scatter_reduce(1, docs, candidates, reduce="amin")
    first = torch.where(first == big, torch.zeros_like(first), first)  # nothing maskable
    start = first.gather(1, docs)  # (B, L) answer start of each token's document
    return torch.div(position_ids - start, block_size, rounding_mode="floor")


# -- objectives ----------------------------------------------------------------------------


class SFTObjective(MaskedDiffusionObjective):
    """LLaDA SFT: loss = (1/B) sum_b [sum over masked answer i of CE_i w(t_b)] / answer_len_b
    (`loss_normalization: answer_padded`, the default; `answer` and `token` as documented).

    Only `maskable` tokens (the answer, its EOS, and padding when `data.supervise_padding`)
    are ever masked; the prompt stays clean. Returns loss_sum = sum over rows of the row term
    and count = rows with an answer, so the trainer's global division gives the batch mean.
    `prompt_drop_prob` masks a row's whole prompt (no loss on it) for classifier-free guidance.
    `edit_fraction`: the editing stream on the answer's kept tokens (MaskedDiffusionObjective);
    its draws come after the masking's, before the prompt drop's.
    """

    global_noise = False
    default_normalization = "answer_padded"

    def count(self, batch: dict) -> torch.Tensor:
        """Rows with an answer (after the shift's unmaskable document starts); the
        maskable tokens under `token` normalization."""
        maskable = maskable_of(batch)
        if self.cfg.logit_shift:
            maskable = maskable & ~document_starts(batch)
        if self.normalization == "token":
            return maskable.sum().float()
        return (maskable.sum(1) > 0).sum().float()

    def __call__(
        self, model: nn.Module, batch: dict, generator: torch.Generator | None = None
    ) -> ObjectiveOutput:
        cfg = self.cfg
        input_ids = batch["input_ids"]
        maskable = maskable_of(batch)
        if cfg.logit_shift:
            maskable = maskable & ~document_starts(batch)
            batch = {**batch, "maskable": maskable}
        t, noisy, masked = self.noise(batch, generator)
        if cfg.prompt_drop_prob > 0 and "noisy_input_ids" not in batch:
            prompt = prompt_positions(maskable, batch.get("doc_ids"))
            drop = torch.rand(t.shape, generator=generator, device=t.device) < cfg.prompt_drop_prob
            noisy = noisy.masked_fill(prompt & drop[:, None], self.mask_id)
        weight = loss_weight(t, cfg.loss_weight, cfg.schedule).float()
        scored, coef = scored_positions(masked, maskable, weight, cfg.edit_fraction)
        targets = torch.where(scored, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
        coef, count = self._scaled(coef, maskable, input_ids)
        loss_sum = _weighted_loss(model, noisy, batch, targets, coef, cfg, bool(cfg.logit_shift))
        self.last_stats = self.stats(t, masked, maskable, input_ids, noisy)
        return ObjectiveOutput(loss_sum, count)


class DreamObjective(MaskedDiffusionObjective):
    """Dream: logit shift, CART (or scheduler) weights, prompt handling and answer cutoffs.

    loss_sum = sum over masked i of CE_i * w_i, count = maskable tokens (token
    normalization). `mask_prompt_loss: false` makes prompt tokens maskable too. In training
    mode `perbatch_cutoff` / `resp_cutoff_ratio` reshape the batch first.
    """

    global_noise = False

    def __init__(self, cfg: DiffusionConfig, mask_id: int):
        super().__init__(cfg, mask_id)
        self.weight_kind, self.geo_p = parse_loss_weight(cfg.loss_weight)

    def prepare(self, batch: dict, generator: torch.Generator | None, training: bool) -> dict:
        """Cutoffs (training only), prompt policy and the shift's unmaskable doc starts."""
        cfg = self.cfg
        batch = {**batch, "maskable": maskable_of(batch)}
        if training and cfg.perbatch_cutoff:
            batch = perbatch_cutoff(batch, generator)
        if training and cfg.resp_cutoff_ratio > 0:
            batch = resp_cutoff(batch, cfg.resp_cutoff_ratio, generator)
        maskable = batch["maskable"]
        if not cfg.mask_prompt_loss:
            maskable = maskable | prompt_positions(maskable, batch.get("doc_ids"))
        if cfg.logit_shift is not False:
            maskable = maskable & ~document_starts(batch)
        return {**batch, "maskable": maskable}

    def count(self, batch: dict) -> torch.Tensor | None:
        """Maskable tokens after the prompt policy and the shift; None with a cutoff, which
        draws from the call's generator."""
        if self.cfg.perbatch_cutoff or self.cfg.resp_cutoff_ratio > 0:
            return None
        return self.prepare(batch, None, training=False)["maskable"].sum().float()

    def __call__(
        self, model: nn.Module, batch: dict, generator: torch.Generator | None = None
    ) -> ObjectiveOutput:
        cfg = self.cfg
        # cutoffs only when drawing fresh noise (precomputed noise fixes the layout)
        training = model.training and "noisy_input_ids" not in batch
        batch = self.prepare(batch, generator, training=training)
        input_ids, maskable = batch["input_ids"], maskable_of(batch)
        t, noisy, masked = self.noise(batch, generator)
        targets = torch.where(masked, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
        if self.weight_kind == "cart":
            weight = cart_weights(masked, self.geo_p, batch.get("doc_ids"))
        else:
            weight = loss_weight(t, self.weight_kind, cfg.schedule).float()[:, None]
        coef = torch.where(masked, weight, 0.0)
        shift = cfg.logit_shift is not False
        loss_sum = _weighted_loss(model, noisy, batch, targets, coef, cfg, shift)
        self.last_stats = objective_stats(t, masked, maskable)
        return ObjectiveOutput(loss_sum, maskable.sum().float())


class BlockDiffusionObjective(MaskedDiffusionObjective):
    """BD3LM: the model reads x_t + x0 (2L tokens, positions repeated) under the block
    mask (`bd3lm_block_mask`) of `bd3lm_blocks`: blocks of `block_size` from each
    document's answer start (a plain document: its first token), the prompt cut into
    blocks from its end, as the block-causal sampler decodes; t is drawn per block; loss
    on the first L outputs, sum of CE_i w(t_block(i)) over masked i, count = maskable.
    `edit_fraction`: kept tokens of the x_t half replaced (MaskedDiffusionObjective.edit, after
    the masking's draws) and scored with weight 1; the x0 half stays clean.
    """

    global_noise = False

    def __call__(
        self, model: nn.Module, batch: dict, generator: torch.Generator | None = None
    ) -> ObjectiveOutput:
        cfg = self.cfg
        x0 = batch["input_ids"]
        maskable = maskable_of(batch)
        b, length = x0.shape
        position_ids = batch.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(length, device=x0.device).expand(b, length)
        doc_ids = batch.get("doc_ids")
        block = bd3lm_blocks(position_ids, maskable, doc_ids, cfg.block_size)  # (B, L)
        n_blocks = math.ceil(length / cfg.block_size)
        t_blocks = sample_t(b * n_blocks, cfg.t_sampling, cfg.time_eps, generator, x0.device)
        # prompt blocks (< 0) are never masked; the t they read does not matter
        t = t_blocks.view(b, n_blocks).gather(1, block.clamp(0, n_blocks - 1))  # (B, L)
        u = torch.rand(x0.shape, generator=generator, device=x0.device)
        masked = (u < mask_prob(t, cfg.schedule)) & maskable
        if cfg.min_masked > 0:
            masked = force_one_masked(masked, maskable, generator)
        noisy = torch.where(masked, torch.full_like(x0, self.mask_id), x0)
        noisy = self.edit(x0, noisy, masked, maskable, generator)  # x_t only; x0 stays clean
        attn = bd3lm_block_mask(block)[:, None]  # (B, 1, 2L, 2L)
        if doc_ids is not None:
            doc2 = torch.cat([doc_ids, doc_ids], dim=1)
            attn = attn & (doc2[:, :, None] == doc2[:, None, :])[:, None]
        weight = loss_weight(t, cfg.loss_weight, cfg.schedule).float()
        scored, coef = scored_positions(masked, maskable, weight, cfg.edit_fraction)
        targets = torch.where(scored, x0, torch.full_like(x0, IGNORE_INDEX))
        call = {
            "position_ids": torch.cat([position_ids, position_ids], dim=1),
            "targets": torch.cat([targets, torch.full_like(targets, IGNORE_INDEX)], dim=1),
            "vocab_chunk": cfg.vocab_chunk_size,
            "attention_mask": attn,
        }
        if getattr(model, "accepts_target_weights", False):  # the x0 half has no loss
            twice = torch.cat([coef, torch.zeros_like(coef)], dim=1)
            loss_sum = model(torch.cat([noisy, x0], dim=1), **call, target_weights=twice)
        else:
            ce = model(torch.cat([noisy, x0], dim=1), **call)[:, :length]
            loss_sum = torch.where(scored, ce.float() * coef, 0.0).sum()
        self.last_stats = self.stats(t, masked, maskable, x0, noisy)
        return ObjectiveOutput(loss_sum, maskable.sum().float())


def _weighted_loss(
    model: nn.Module, noisy, batch: dict, targets, coef, cfg, shift: bool
) -> torch.Tensor:
    """sum of coef * CE over the targets (0-d); shift: position i is scored by the model's
    output at i - 1 (Dream), so output j gets target j + 1 and its coefficient (the LM head
    still runs only on rows with a target). Position 0 gets no loss (callers make document
    starts unmaskable), so the shift never needs two targets at one output."""
    if shift:
        ahead = torch.full_like(targets, IGNORE_INDEX)
        ahead[:, :-1] = targets[:, 1:]
        coef_ahead = torch.zeros_like(coef)
        coef_ahead[:, :-1] = coef[:, 1:]
        targets, coef = ahead, coef_ahead
    return weighted_token_loss(model, noisy, batch, targets, coef, cfg.vocab_chunk_size)


def _block_causal(cfg: DiffusionConfig) -> dict:
    """A BD3LM model is sampled block by block, with the blocks it was trained on (under a
    block schedule: its last size)."""
    schedule = cfg.block_schedule
    block = schedule.final_block if schedule is not None else cfg.block_size
    return {"block_causal": True, "block_length": block}


def _dream_counts_first(cfg: DiffusionConfig) -> bool:
    """Dream's count is known before the forward unless a cutoff draws the layout."""
    return not (cfg.perbatch_cutoff or cfg.resp_cutoff_ratio > 0)


register_objective(ObjectiveSpec("sft", masked_builder(SFTObjective),
                                 accepts_loss_normalization=True,
                                 accepts_logit_shift=True,
                                 accepts_pipeline_parallel=always,
                                 accepts_adaptation=True,
                                 accepts_edit_fraction=True))  # fmt: skip
register_objective(ObjectiveSpec("dream", masked_builder(DreamObjective),
                                 accepts_logit_shift=True, logit_shift_default=True,
                                 accepts_cart_weights=True,
                                 accepts_pipeline_parallel=_dream_counts_first))  # fmt: skip
register_objective(ObjectiveSpec("bd3lm", masked_builder(BlockDiffusionObjective),
                                 fixed_sampling=_block_causal,
                                 accepts_pipeline_parallel=always,
                                 accepts_block_schedule=True,
                                 accepts_edit_fraction=True))  # fmt: skip
