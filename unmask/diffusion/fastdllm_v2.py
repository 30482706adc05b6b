"""Fast-dLLM v2's model form as a training objective (`diffusion.objective: fastdllm_v2`):
block diffusion with the logit shift, blocks counted from each document's first position,
and complementary masks.

The model reads x_t + x0 (2L tokens, positions repeated) under BD3LM's block mask
(`bd3lm_block_mask`) with block index = position // block_size, so the first answer block
holds the prompt's tail, as the sampler (unmask/sampling/blocks_from_start.py) decodes:

- a masked token i inside a block is scored by the x_t half's output at i - 1 (the shift),
  weighted w(t) of its block;
- a block's first token is never masked: the sampler takes it from the finished block's
  last position, so it is scored by the clean (x0) half's output at i - 1 with weight 1
  (a next-token term; a document's very first token has none);
- every row is used twice, with mask m and its complement (maskable and not m) at noise
  level 1 - t, so each maskable token is learned in one of the two (complementary masks).

loss_sum = the sum over both views of those terms; count = 2 x the maskable tokens.
"""

import math

import torch
from torch import nn

from unmask.diffusion.loss import IGNORE_INDEX
from unmask.diffusion.noise import loss_weight, mask_prob, sample_t
from unmask.diffusion.objectives import (
    MaskedDiffusionObjective,
    ObjectiveOutput,
    maskable_of,
    masked_builder,
    objective_stats,
)
from unmask.diffusion.recipes import bd3lm_block_mask
from unmask.diffusion.registry import ObjectiveSpec, register_objective


def v2_views(
    x0: torch.Tensor, maskable: torch.Tensor, starts: torch.Tensor, t: torch.Tensor,
    mask_id: int, schedule: str, generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(noisy (2B, L), masked (2B, L), t (2B, L)): rows with mask m drawn at each block's
    t, then the same rows with the complement (maskable, not a block start, not m) at
    1 - t. starts: (B, L) bool, the block starts (never masked)."""
    candidates = maskable & ~starts
    u = torch.rand(x0.shape, generator=generator, device=x0.device)
    first = (u < mask_prob(t, schedule)) & candidates
    second = candidates & ~first
    masked = torch.cat([first, second])
    noisy = torch.where(masked, torch.full_like(masked, mask_id, dtype=x0.dtype),
                        torch.cat([x0, x0]))  # fmt: skip
    return noisy, masked, torch.cat([t, 1.0 - t]).clamp(min=1e-3)


class FastDLLMv2Objective(MaskedDiffusionObjective):
    """Fast-dLLM v2's training form (see the module doc)."""

    global_noise = False

    def count(self, batch: dict) -> torch.Tensor:
        return 2.0 * maskable_of(batch).sum().float()

    def __call__(
        self, model: nn.Module, batch: dict, generator: torch.Generator | None = None
    ) -> ObjectiveOutput:
        cfg = self.cfg
        x0, maskable = batch["input_ids"], maskable_of(batch)
        b, length = x0.shape
        position_ids = batch.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(length, device=x0.device).expand(b, length)
        block = torch.div(position_ids, cfg.block_size, rounding_mode="floor")  # from 0
        starts = position_ids % cfg.block_size == 0
        n_blocks = math.ceil(length / cfg.block_size) + 1  # a packed row's blocks restart
        t_blocks = sample_t(b * n_blocks, cfg.t_sampling, cfg.time_eps, generator, x0.device)
        t = t_blocks.view(b, n_blocks).gather(1, block.clamp(0, n_blocks - 1))  # (B, L)
        noisy, masked, t2 = v2_views(x0, maskable, starts, t, self.mask_id, cfg.schedule,
                                     generator)  # fmt: skip
        # targets of the 2L outputs: x_t column i - 1 for masked i, x0 column i - 1 for a
        # block start i that is maskable and not a document start
        ahead_masked = torch.zeros_like(masked)
        ahead_masked[:, :-1] = masked[:, 1:]
        x0_2 = torch.cat([x0, x0])
        next_ids = torch.full_like(x0_2, IGNORE_INDEX)
        next_ids[:, :-1] = x0_2[:, 1:]
        weight = loss_weight(t2, cfg.loss_weight, cfg.schedule).float()
        weight_ahead = torch.zeros_like(weight)
        weight_ahead[:, :-1] = weight[:, 1:]
        start_target = torch.zeros_like(masked)
        start_target[:, :-1] = torch.cat([starts & maskable & (position_ids > 0)] * 2)[:, 1:]
        noisy_targets = torch.where(ahead_masked, next_ids, IGNORE_INDEX)
        clean_targets = torch.where(start_target, next_ids, IGNORE_INDEX)
        targets = torch.cat([noisy_targets, clean_targets], dim=1)  # (2B, 2L)
        coef = torch.cat([torch.where(ahead_masked, weight_ahead, 0.0),
                          start_target.float()], dim=1)  # fmt: skip
        blocks2 = torch.cat([block, block])
        attn = bd3lm_block_mask(blocks2)[:, None]  # (2B, 1, 2L, 2L)
        doc_ids = batch.get("doc_ids")
        if doc_ids is not None:
            doc2 = torch.cat([doc_ids, doc_ids], dim=1).repeat(2, 1)
            attn = attn & (doc2[:, :, None] == doc2[:, None, :])[:, None]
        pos2 = torch.cat([position_ids, position_ids], dim=1).repeat(2, 1)
        call = {"position_ids": pos2, "targets": targets, "vocab_chunk": cfg.vocab_chunk_size,
                "attention_mask": attn}  # fmt: skip
        inputs = torch.cat([noisy, x0_2], dim=1)
        if getattr(model, "accepts_target_weights", False):
            loss_sum = model(inputs, **call, target_weights=coef)
        else:
            ce = model(inputs, **call)
            loss_sum = torch.where(targets != IGNORE_INDEX, ce.float() * coef, 0.0).sum()
        self.last_stats = objective_stats(t2[:, 0], masked, torch.cat([maskable, maskable]))
        return ObjectiveOutput(loss_sum, self.count(batch))


def _v2_sampling(cfg) -> dict:
    """A v2-form model samples as v2 does: block-causal, shifted, blocks from the start,
    threshold decoding (0.9, v2's default; --threshold changes it)."""
    return {"block_causal": True, "shift_logits": True, "blocks_from_start": True,
            "block_length": cfg.block_size, "threshold": 0.9}  # fmt: skip


register_objective(ObjectiveSpec("fastdllm_v2", masked_builder(FastDLLMv2Objective),
                                 fixed_sampling=_v2_sampling))  # fmt: skip
