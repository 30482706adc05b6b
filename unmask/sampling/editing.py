"""`joint_threshold`: LLaDA2.1's token-editing decoder (M2T + T2T, arXiv 2602.08676).

Written from SGLang's `JointThreshold` dLLM algorithm (sgl-project/sglang,
python/sglang/srt/dllm/algorithm/joint_threshold.py at commit
cabd4543152087d411785114ef0b2d8db7bfd80e; `--dllm-algorithm JointThreshold`, which SGLang
says matches the model's official generate), with the quota of LLaDA2.1's own `generate` (its modeling_llada2_moe.py, as
released with the model: `num_to_transfer`). Each step of a
block, for every row still decoding, one forward and:

1. penalty (`penalty_lambda` > 0): the logit of the token now at position j - 1 of the
   block is lowered by penalty_lambda at position j, j >= 1 (position 0 of the block is not
   penalized, as in SGLang);
2. proposals x0 = the argmax of the (penalized) logits, p = its softmax probability;
3. M2T: every mask of the block with p > threshold is filled with x0, and at least the
   row's quota of the most probable masks (the `llada` quota of this step: one a step by
   default, steps = gen_length, as SGLang's top-1 floor; fewer steps give the official
   generate's num_to_transfer);
4. T2T: every position of the block that is neither a mask now nor was filled before the
   block started (SGLang's "prompt" positions: in unmask a block starts all masks, unless a
   tokens hook filled some) gets x0 where x0 differs from its token and p > edit_threshold
   (0: wherever the argmax differs);
5. a row with no mask left counts a post-edit step; once it has counted more than
   `max_post_edit_steps` it is done (that step's forward is taken, as SGLang takes it), and
   a row whose step changes nothing is done. The block ends when every row is done.

By default (`edit_scope` block) edits touch only the current block: finished blocks and
the prompt are never edited, as in SGLang and the official generate. So a block takes
M + E + 1 forwards: M steps with masks, E steps of edits alone (at most
max_post_edit_steps), and the step that finds nothing to change or the budget spent. The
official generate checks the budget before its forward, so a block that spends the whole
budget costs it one forward less; tokens are the same.

`edit_scope` all is the report's multi-block editing (MBE: after a new block brings more
context, earlier blocks may be revised; the report gives no window, so every earlier
block): step 4 also runs over the answer positions of the finished blocks (not the prompt,
not a mask), with the same rule, x0 differs and p > edit_threshold, the penalty of step 1
applied within each block as within the current one. Every step's logits then cover the
answer so far, from the start of the first block holding an answer column (with
block_origin request that block starts with the prompt's tail) to the block end: the one
forward of a step reads them (forwards are counted as before: one a step, M + E + 1 a
block); a step that changes nothing anywhere ends the row. With a K/V cache the cached K/V
of an edited earlier block would be stale, so a step's forward feeds everything from that
block's start (prefix: to the canvas end, dual: to the block end) and only the K/V before
it (and dual's later masks) come from the cache; each block's first forward refreshes the
whole cache, as before. A logits hook then sees those (B, stop - that start, V) logits. A tokens hook is
refused with it (the tokens it set in an earlier block could not be told from generated
ones). The first block is decoded as with block.

Differences from SGLang, all inert for a trained model: the mask token is never proposed
(SGLang's argmax could pick it; every unmask decoder forbids it), so p is over the other
tokens; probabilities are float64 (SGLang: the logits' dtype); a block that starts with no
mask takes no forward (SGLang runs one to fill its K/V cache). Options it shares with the
other decoders: temperature / top_p / top_k (x0 drawn as `masked` draws it and p its
probability under the tempered, filtered distribution, the official generate's
`_sample_with_temperature_topk_topp`), eos_penalty and logits_eos_inf, guidance, caches,
hooks. A row's tokens never depend on the other rows of the batch: its quota, post-edit
count and end are its own (the server batches rows of different requests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field

from unmask.sampling.decoders import BlockDecoder, DecoderOptions, register_decoder
from unmask.sampling.generate import GenerationOutput, eos_adjusted
from unmask.sampling.hooks import call_logits_hook, call_tokens_hook
from unmask.sampling.schedules import num_transfer_tokens
from unmask.sampling.transfer import propose_tokens, select_top_k

if TYPE_CHECKING:  # pragma: no cover
    from unmask.sampling.config import SamplingConfig

# LLaDA2.1's decoding modes, the report's S and Q modes (arXiv 2602.08676; the model cards
# of inclusionAI/LLaDA2.1-mini and -flash), and SGLang's JointThreshold defaults (= speedy)
# for what neither a preset nor an option sets.
JOINT_PRESETS = {
    "speedy": {"threshold": 0.5, "edit_threshold": 0.0, "max_post_edit_steps": 16,
               "penalty_lambda": 0.0},
    "quality": {"threshold": 0.7, "edit_threshold": 0.5, "max_post_edit_steps": 16,
                "penalty_lambda": 0.0},
}  # fmt: skip
JOINT_DEFAULT_PRESET = "speedy"
# where its T2T edits reach: the current block (SGLang, the official generate), or every
# block so far (the report's multi-block editing)
EDIT_SCOPES = ("block", "all")
_REFUSED_WHY = ("it fills masks whose proposal's probability clears threshold, at least the "
                "llada quota, and edits filled tokens")  # fmt: skip
#: the masked decoders' options it refuses when given
JOINT_REFUSED = {name: _REFUSED_WHY for name in (
    "remasking", "schedule", "alg_temp", "factor", "sub_block_length", "confidence_eos_eot_inf",
    "ddpm_cache", "blocks_from_start")}  # fmt: skip


class JointThresholdOptions(DecoderOptions):
    """The options only decoder joint_threshold reads, SamplingConfig fields."""

    edit_threshold: float | None = Field(None, ge=0.0, le=1.0)
    """Decoder joint_threshold (LLaDA2.1's T2T edits): a filled answer token of the current
    block is replaced by the model's argmax where that differs and its probability is above
    this (0 = wherever the argmax differs). None = the preset's (speedy 0, quality 0.5)."""
    max_post_edit_steps: int | None = Field(None, ge=0)
    """Decoder joint_threshold: steps of edits alone once a block has no mask left (a block
    also ends at the first step that changes nothing). None = the preset's (16)."""
    penalty_lambda: float | None = Field(None, ge=0.0)
    """Decoder joint_threshold: repetition penalty, subtracted from the logit of the token
    just before each position of the block (SGLang's 2-gram penalty; 0 = off, 3 curbs most
    repetition). None = the preset's (0)."""
    joint_preset: str | None = None
    """Decoder joint_threshold: LLaDA2.1's mode, speedy (threshold 0.5, edit_threshold 0)
    or quality (threshold 0.7, edit_threshold 0.5), both max_post_edit_steps 16; options
    given win over it. None = speedy (SGLang's defaults)."""
    edit_scope: str | None = None
    """Decoder joint_threshold: where T2T edits reach, block (the current block's filled
    tokens, as SGLang and LLaDA2.1's own generate) or all (also every answer token of the
    earlier blocks, under the same edit_threshold rule, while the current block decodes:
    the report's multi-block editing; each step's forward then reads the whole answer so
    far, and a K/V cache keeps only the prompt's). None = block."""


def joint_threshold_settings(config: SamplingConfig) -> dict[str, Any]:
    """threshold, edit_threshold, max_post_edit_steps and penalty_lambda of decoder
    joint_threshold: each option given, else its value in the preset (joint_preset, else
    speedy: SGLang JointThreshold's defaults)."""
    preset = JOINT_PRESETS[config.joint_preset or JOINT_DEFAULT_PRESET]
    return {name: preset[name] if getattr(config, name) is None else getattr(config, name)
            for name in preset}  # fmt: skip


class JointThreshold(BlockDecoder):
    """`joint_threshold`: LLaDA2.1's joint threshold decoding, M2T fills and T2T edits of
    the current block, or with edit_scope all of the whole answer so far (the module doc);
    options threshold, edit_threshold, max_post_edit_steps, penalty_lambda, joint_preset
    (`joint_threshold_settings`) and edit_scope."""

    edits_tokens = True
    options = tuple(JointThresholdOptions.model_fields)
    choices = {"joint_preset": tuple(JOINT_PRESETS), "edit_scope": EDIT_SCOPES}
    refuses = JOINT_REFUSED

    @classmethod
    def check(cls, config: SamplingConfig) -> None:
        """LLaDA2.1's joint-threshold decoder scores a proposal by its own probability,
        fills by threshold above the llada quota and edits: the options of the masked
        decoder's other rules do not apply, and the threshold is a probability."""
        if config.threshold is not None and not 0.0 <= config.threshold <= 1.0:
            raise ValueError(f"decoder joint_threshold: threshold is a probability, from 0 to "
                             f"1 (got {config.threshold})")  # fmt: skip
        defaults = type(config).model_fields
        for name, why in JOINT_REFUSED.items():
            value = getattr(config, name)
            off = name == "alg_temp" and not value  # alg_temp 0 = None: the top ones
            if value != defaults[name].get_default() and not off:
                raise ValueError(f"decoder joint_threshold takes no {name} ({why}); leave "
                                 f"{name} at its default")  # fmt: skip
        if config.edit_scope == "all" and config.tokens_hook is not None:
            raise ValueError("decoder joint_threshold: edit_scope all takes no tokens_hook (the "
                             "tokens a hook set in an earlier block could not be told from "
                             "generated ones, which edits may replace)")  # fmt: skip

    @classmethod
    def edits(cls, config: SamplingConfig) -> bool:
        """edit_threshold 1 turns edits off (p > 1 never holds)."""
        return joint_threshold_settings(config)["edit_threshold"] < 1

    def __init__(self, config, model, canvas, start, stop, steps_per_block, mask_id, special):
        super().__init__(config, model, canvas, start, stop, steps_per_block, mask_id, special)
        settings = joint_threshold_settings(config)
        self.threshold = float(settings["threshold"])
        self.edit_threshold = float(settings["edit_threshold"])
        self.max_post_edit_steps = int(settings["max_post_edit_steps"])
        self.penalty_lambda = float(settings["penalty_lambda"])
        block = canvas.x[:, start:stop]
        #: positions filled before the block started: never edited (SGLang's prompt mask)
        self.fixed = block != mask_id
        self.quota = num_transfer_tokens((~self.fixed).sum(1), steps_per_block)  # (B, S)
        rows = block.shape[0]
        self.post_edit_steps = torch.zeros(rows, dtype=torch.long, device=block.device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=block.device)
        # at most one fill a step, then the post-edit budget, then the step that ends it
        self.max_steps = (stop - start) + self.max_post_edit_steps + 1
        #: the first column a step reads: the block's start, or with edit_scope all the
        #: start of the first block that holds an answer column of any row (answer: real,
        #: not prompt; with block_origin request that block starts with the prompt's tail,
        #: whose K/V then follow the edits there too)
        self.lo = start
        if config.edit_scope == "all":
            answer = canvas.valid[:, :start] & ~canvas.prompt_valid[:, :start]
            columns = answer.any(0).nonzero()
            if columns.numel():
                size = stop - start
                self.lo = start - -(-(start - int(columns[0])) // size) * size
        #: (B, start - lo) the earlier blocks' positions edits may reach
        self.earlier = (canvas.valid[:, self.lo : start]
                        & ~canvas.prompt_valid[:, self.lo : start])  # fmt: skip

    def step(self, step: int, generator, out: GenerationOutput) -> bool:
        """One forward, then each unfinished row's fills and edits; False when no row
        changed (every row is done)."""
        lo, start, stop = self.lo, self.start, self.stop
        x_seen = self.canvas.x[:, lo:stop]  # (B, Ls): earlier blocks (edit_scope all), block
        x_block = x_seen[:, start - lo :]
        is_mask = x_block == self.mask_id  # (B, Lb), before this step
        if self.done.all() or (step == 0 and not is_mask.any()):
            return False
        cfg = self.config
        logits = self.forward(step, lo)
        out.nfe += 1
        out.row_forwards += x_block.shape[0]
        if cfg.logits_hook is not None:
            logits = call_logits_hook(cfg.logits_hook, out.steps, self.canvas.x, logits)
        logits = eos_adjusted(logits, self.special, cfg.eos_penalty)
        if self.penalty_lambda > 0:  # the token before each position, within its block
            penalty = logits.new_full((*x_seen[:, :-1].shape, 1), -self.penalty_lambda)
            first = torch.arange(lo + 1, stop, device=penalty.device) - start
            penalty[:, first % (stop - start) == 0] = 0.0  # a block's first position
            logits = logits.clone()
            logits[:, 1:].scatter_add_(-1, x_seen[:, :-1, None], penalty)
        x0_seen, filtered = propose_tokens(logits, self.mask_id, cfg.temperature, cfg.top_k,
                                           cfg.top_p, generator)  # fmt: skip
        p_seen = self._probability(filtered, x0_seen)  # (B, Ls) float64
        x0, p = x0_seen[:, start - lo :], p_seen[:, start - lo :]
        if self.trace:
            self.proposed, self.proposal_p = x0.clone(), p.masked_fill(~is_mask, float("nan"))

        active = ~self.done
        has_mask = is_mask.any(1)
        post = active & ~has_mask  # rows editing alone count the step
        self.post_edit_steps += post.long()
        spent = post & (self.post_edit_steps > self.max_post_edit_steps)
        working = (active & ~spent)[:, None]
        # M2T: above threshold, and at least the quota of the most probable masks
        confidence = p.masked_fill(~is_mask, float("-inf"))
        index = min(step, self.quota.shape[1] - 1)
        floor = select_top_k(confidence, torch.minimum(self.quota[:, index], is_mask.sum(1)))
        fill = working & is_mask & ((p > self.threshold) | floor)
        # T2T: filled in this block (with edit_scope all: or an earlier block's answer token),
        # a different argmax, probable enough
        editable = torch.cat([self.earlier & (x_seen[:, : start - lo] != self.mask_id),
                              ~is_mask & ~self.fixed], dim=1)  # fmt: skip
        edit = working & editable & (x0_seen != x_seen) & (p_seen > self.edit_threshold)
        fill_seen = torch.cat([torch.zeros_like(edit[:, : start - lo]), fill], dim=1)
        change = fill_seen | edit
        changed = change.any(1)
        self.done |= spent | (working[:, 0] & ~changed)
        if not changed.any():
            return False
        self.canvas.x[:, lo:stop] = torch.where(change, x0_seen, x_seen)
        out.decoded += int(fill.sum())
        out.edits += int(edit.sum())
        if cfg.tokens_hook is not None:
            self.canvas.x = call_tokens_hook(cfg.tokens_hook, out.steps, self.canvas.x, logits)
        out.steps += 1
        return True

    def _probability(self, filtered: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        """p(x0) (B, Lb) float64: softmax of the (filtered) logits, tempered at T > 0."""
        scale = self.config.temperature if self.config.temperature > 0 else 1.0
        logp = torch.log_softmax(filtered.to(torch.float64) / scale, dim=-1)
        return logp.gather(-1, x0[..., None]).squeeze(-1).exp()


register_decoder("joint_threshold", JointThreshold)

__all__ = ["JointThreshold"]
