"""`masked`: the masked-diffusion block decoder, the default one. Each step of a block a
forward (or a cache / ddpm reuse), proposals, and commits chosen by remasking and schedule,
threshold, factor or sub_block_length: LLaDA's, Dream's, Fast-dLLM v1's and v2's
sub-blocks, MDLM's origin, and LLaDA2's fill rule. `sample` (generate.py) lays the canvas
out and runs it block by block; the server's engine runs it per block call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from unmask.sampling.decoders import BlockDecoder, DecoderOptions, register_decoder
from unmask.sampling.generate import GenerationOutput, eos_adjusted
from unmask.sampling.hooks import call_logits_hook, call_tokens_hook
from unmask.sampling.schedules import dream_transfer_count, num_transfer_tokens, unmask_fraction
from unmask.sampling.transfer import (
    CONFIDENCE_FNS,
    multinomial_tokens,
    propose_tokens,
    sampling_probs,
    select_carried_threshold,
    select_factor,
    select_origin,
    select_sampled,
    select_threshold,
    select_top_k,
)

if TYPE_CHECKING:  # pragma: no cover
    from unmask.sampling.config import SamplingConfig


class MaskedOptions(DecoderOptions):
    """The options only the masked decoder reads (LLaDA2's fill rule), SamplingConfig
    fields."""

    fill_rule: str | None = None
    """The masked decoder's threshold rule: `fast_dllm` (each step the most confident mask
    and every mask with confidence >= threshold) or `llada2` (every mask whose proposal's
    probability is > threshold when at least the step's quota of them are, else the
    quota's most confident; quotas split block_length over block_steps, LLaDA2's
    generate). None = fast_dllm."""
    multinomial_draws: bool = False
    """fill_rule llada2: draw each proposal with torch.multinomial from the tempered,
    filtered softmax of the block, as LLaDA2's generate draws (a row alone draws the same
    tokens from the same seed); at temperature 0 this draws from the untempered softmax,
    as the first LLaDA2.0 hub file does (inclusionAI/LLaDA2.X issue 6), not the argmax."""
    eos_early_stop: bool = False
    """LLaDA2's eos_early_stop: a row stops within a block at the step that commits an EOS
    with no mask left before its first EOS (every row stops after a block that holds
    EOS already, when the tokenizer has one)."""


class MaskedBlockDecoder(BlockDecoder):
    """`masked`: the masked-diffusion block decoder. Each step a forward (or a cache / ddpm
    reuse), proposals, and commits chosen by remasking and schedule, threshold, factor or
    sub_block_length (LLaDA, Dream, Fast-dLLM v1 and v2's sub-blocks, MDLM's origin)."""

    options = tuple(MaskedOptions.model_fields)
    #: its threshold rules: fast_dllm (the top one and every confidence >= threshold),
    #: llada2 (every confidence > threshold when at least the step's quota do, else the
    #: quota's most confident: LLaDA2's generate)
    choices = {"fill_rule": ("fast_dllm", "llada2")}

    @classmethod
    def check(cls, config: SamplingConfig) -> None:
        """multinomial_draws with fill_rule llada2 only; fill_rule llada2 fills by threshold
        with the default scores over the whole block."""
        if config.multinomial_draws and config.fill_rule != "llada2":
            raise ValueError("multinomial_draws draws as LLaDA2's generate does: it needs "
                             "fill_rule llada2")  # fmt: skip
        if config.fill_rule == "llada2":
            if config.threshold is None:
                raise ValueError("fill_rule llada2 fills by threshold above the step's quota; "
                                 "give threshold (LLaDA2: 0.95)")  # fmt: skip
            if config.sub_block_length is not None or config.remasking != "low_confidence":
                raise ValueError("fill_rule llada2 scores a proposal by its probability over "
                                 "the whole block: leave remasking and sub_block_length at "
                                 "their defaults")  # fmt: skip

    def __init__(self, config, model, canvas, start, stop, steps_per_block, mask_id, special):
        super().__init__(config, model, canvas, start, stop, steps_per_block, mask_id, special)
        parallel = config.threshold is not None or config.factor is not None
        self.max_steps = (stop - start) if parallel else steps_per_block
        if config.remasking == "confidence_threshold":  # the quota, then what was carried
            self.max_steps = steps_per_block + (stop - start)
        masked = (canvas.x[:, start:stop] == mask_id).sum(1)
        if config.fill_rule == "llada2":  # LLaDA2: block_length split over the steps
            self.max_steps = steps_per_block
            masked = torch.full_like(masked, stop - start)
        self.quota = num_transfer_tokens(masked, steps_per_block)  # (B, steps_per_block)
        #: rows stopped inside the block by eos_early_stop (`stop_at_eos`)
        self.done = torch.zeros_like(masked, dtype=torch.bool)
        self.eos_id: int | None = None
        self.answer: torch.Tensor | None = None
        self.carried = torch.zeros_like(masked)  # confidence_threshold: quota left over
        self.logits: torch.Tensor | None = None
        self.last_x: torch.Tensor | None = None

    def stop_at_eos(self, eos_id: int, answer: torch.Tensor) -> None:
        """eos_early_stop (LLaDA2): a row stops at the step that commits an EOS when no
        mask is left before its first answer EOS. answer (B, L) bool: its answer columns."""
        self.eos_id, self.answer = eos_id, answer

    def step(self, step: int, generator, out: GenerationOutput) -> bool:
        """Commit this step's tokens; False when the block has no mask left (in the rows
        still decoding)."""
        x_block = self.canvas.x[:, self.start : self.stop]
        is_mask = (x_block == self.mask_id) & ~self.done[:, None]  # (B, Lb)
        if not is_mask.any():
            return False
        reuse = (
            self.config.ddpm_cache
            and self.last_x is not None
            and torch.equal(self.last_x, self.canvas.x)
        )
        cfg = self.config
        if not reuse:
            logits = self.forward(step)
            if cfg.logits_hook is not None:  # the model's logits, as in Dream
                logits = call_logits_hook(cfg.logits_hook, out.steps, self.canvas.x, logits)
            self.logits = self._adjusted(logits)
            self.last_x = self.canvas.x.clone()
            out.nfe += 1
            out.row_forwards += self.canvas.x.shape[0]
        draw = multinomial_tokens if cfg.multinomial_draws else propose_tokens  # LLaDA2's
        x0, filtered = draw(self.logits, self.mask_id, cfg.temperature, cfg.top_k, cfg.top_p,
                            generator)  # fmt: skip
        if self.trace:  # LLaDA's confidence of each proposal (read only: nothing changes)
            p = CONFIDENCE_FNS["low_confidence"](self.logits, None, x0)
            self.proposed, self.proposal_p = x0.clone(), p.masked_fill(~is_mask, float("nan"))
        x0 = torch.where(is_mask, x0, x_block)
        region = is_mask if cfg.sub_block_length is None else self._sub_block(is_mask)
        commit = self._commits(step, region, x0, filtered, generator)
        out.decoded += int(commit.sum())
        self.canvas.x[:, self.start : self.stop] = torch.where(commit, x0, x_block)
        if self.eos_id is not None:
            self._early_stop(commit & (x0 == self.eos_id))
        if cfg.tokens_hook is not None:
            self.canvas.x = call_tokens_hook(cfg.tokens_hook, out.steps, self.canvas.x,
                                             self.logits)  # fmt: skip
        out.steps += 1
        return True

    def _early_stop(self, committed_eos: torch.Tensor) -> None:
        """Rows that committed an EOS this step and have no mask before their first EOS
        are done (LLaDA2's eos_early_stop)."""
        rows = committed_eos.any(1)
        if not rows.any():
            return
        x, answer = self.canvas.x[:, : self.stop], self.answer[:, : self.stop]
        eos = (x == self.eos_id) & answer
        first = eos.long().argmax(1)  # each row's first answer EOS (one exists: rows)
        before = answer & (torch.arange(self.stop, device=x.device)[None, :] < first[:, None])
        self.done |= rows & ~((x == self.mask_id) & before).any(1)

    def _adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        return eos_adjusted(logits, self.special, self.config.eos_penalty)

    def _sub_block(self, is_mask: torch.Tensor) -> torch.Tensor:
        """Bool (B, Lb): the masks of each row's first sub-block that still has one
        (Fast-dLLM v2: sub-blocks of a block are decoded left to right)."""
        sub = torch.arange(is_mask.shape[1], device=is_mask.device) // self.config.sub_block_length
        first = is_mask.long().argmax(1)  # the first masked position of each row
        return is_mask & (sub[None, :] == sub[first][:, None])

    def _commits(self, step, is_mask, x0, filtered, generator) -> torch.Tensor:
        """Bool (B, Lb): the masked positions this step fills."""
        cfg = self.config
        if cfg.remasking == "origin":
            fraction = unmask_fraction(step, self.steps_per_block, cfg.eps)
            return select_origin(is_mask, fraction, generator)
        if cfg.fill_rule == "llada2":
            return self._llada2_fill(step, is_mask, x0, filtered)
        logits, unconfident = self.logits, self.special["unconfident"]
        if unconfident:  # LLaDA: EOS and EoT proposals get confidence 0
            ids = torch.tensor(unconfident, device=logits.device)
            logits = logits.index_fill(-1, ids, float("-inf"))
            filtered = filtered.index_fill(-1, ids, float("-inf"))
        probs = None
        if cfg.remasking not in ("low_confidence", "random"):
            probs = sampling_probs(filtered, cfg.temperature)
            if unconfident:  # a position whose filter kept only EOS / EoT: all 0, not NaN
                probs = probs.nan_to_num(0.0)
        conf = CONFIDENCE_FNS[cfg.remasking](logits, probs, x0, generator)
        conf = conf.masked_fill(~is_mask, float("-inf"))
        # equal confidences are ranked as the references' torch.topk over the whole canvas
        # row ranks them (LLaDA, Dream, Fast-dLLM): the block's place in that row
        row = dict(offset=self.start, width=self.canvas.x.shape[1])
        if cfg.remasking == "confidence_threshold":
            nominal = step < self.steps_per_block
            quota = self.quota[:, step] if nominal else torch.zeros_like(self.carried)
            commit, self.carried = select_carried_threshold(conf, quota + self.carried,
                                                            cfg.threshold, **row)  # fmt: skip
            return commit
        if cfg.threshold is not None:  # v2 sub-blocks: v2's argmax, the first of equal tops
            v2 = cfg.sub_block_length is not None
            return select_threshold(conf, cfg.threshold, first_max=v2, **row)
        if cfg.factor is not None:
            return select_factor(conf, cfg.factor, **row)
        if cfg.schedule == "llada":
            k = self.quota[:, step]
        else:
            k = dream_transfer_count(is_mask.sum(1), step, self.steps_per_block, cfg.eps)
        if cfg.alg_temp:
            return select_sampled(conf, k, cfg.alg_temp, generator)
        return select_top_k(conf, k, **row)

    def _llada2_fill(self, step, is_mask, x0, filtered) -> torch.Tensor:
        """fill_rule llada2: every mask whose proposal's probability (under the tempered,
        filtered distribution) is > threshold when at least the step's quota are, else the
        quota's most probable (ranked within the block, as LLaDA2's topk over it)."""
        probs = sampling_probs(filtered, self.config.temperature)
        conf = probs.gather(-1, x0[..., None]).squeeze(-1).masked_fill(~is_mask, float("-inf"))
        quota = self.quota[:, step]
        high = conf > self.config.threshold
        top = select_top_k(conf, torch.minimum(quota, is_mask.sum(1)))
        return torch.where((high.sum(1) >= quota)[:, None], high, top)


register_decoder("masked", MaskedBlockDecoder)
