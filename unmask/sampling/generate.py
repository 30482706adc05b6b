"""One sampler for masked-diffusion LMs: fill a masked canvas block by block.

Swappable parts (design/DIFFUSION.md, Sampling):
  - schedule (`schedules.py`): LLaDA per-block quotas or Dream timesteps;
  - confidence and transfer (`transfer.py`): which positions to commit: top-k, sampled
    with `alg_temp`, Fast-dLLM `threshold` / `factor`, Dream `origin` / MDLM ddpm;
  - cache: `none` (a full forward per step), `prefix` (K/V of everything before the
    current block reused within the block), `dual` (prefix and suffix reused, only the
    block fed); both refreshed by a full forward at each block start (or every
    `cache_refresh` steps). Cached K/V are approximate for a bidirectional model with
    more than one layer (as in Fast-dLLM); `cache_refresh=1` is exact;
  - attention: bidirectional over the canvas, or `block_causal` (block diffusion, BD3LM:
    a position sees its own block and the blocks before it; the prompt is cut into blocks
    of block_length from its end). Block-causal K/V of finished blocks never change, so
    both caches are exact there;
  - the model call: classifier-free guidance, Dream's logit shift.
Batches of prompts of different lengths are left-padded (attention mask + position ids);
with `eos_id` a row stops once a finished block holds EOS, and everything after its
first EOS is EOS. `sample` returns the tokens with NFE and throughput.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from unmask.sampling.schedules import (
    SCHEDULES,
    dream_transfer_count,
    num_transfer_tokens,
    unmask_fraction,
)
from unmask.sampling.transfer import (
    CONFIDENCE_FNS,
    REMASKING,
    add_gumbel_noise,
    forbid_token,
    propose_tokens,
    sampling_probs,
    select_factor,
    select_origin,
    select_sampled,
    select_threshold,
    select_top_k,
)

CACHES = ("none", "prefix", "dual")


@dataclass
class GenerationOutput:
    """Generated canvases and how much work they took.

    sequences: (B, P + G) long: the (left-padded) prompt, then the answer; after a row's
    first EOS (when eos_id is set) every position is EOS. nfe: model forward calls (a
    guided call on 2B rows counts once). tokens: answer tokens before each row's first
    EOS, summed over rows. decoded: positions committed by the model (the EOS fill of
    stopped rows excluded). row_forwards: forward calls times rows in them.
    """

    sequences: torch.Tensor
    prompt_length: int
    nfe: int = 0
    tokens: int = 0
    decoded: int = 0
    row_forwards: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Positions committed per row per forward pass (1.0 = one token a step)."""
        return self.decoded / max(1, self.row_forwards)

    @property
    def tokens_per_second(self) -> float:
        """Answer tokens before EOS, all rows, per second of wall time."""
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def answers(self) -> torch.Tensor:
        """(B, G) the generated part."""
        return self.sequences[:, self.prompt_length :]


def cfg_combine(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance: un + (scale + 1) * (cond - un)."""
    return uncond + (scale + 1.0) * (cond - uncond)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids (B, P) left-padded with pad_id, attention_mask (B, P) bool)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, p in enumerate(prompts):
        if p:
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = True
    return ids, mask


def _check_lengths(steps: int, gen_length: int, block_length: int) -> int:
    """Number of blocks; raises ValueError for lengths the block schedule cannot split."""
    if gen_length <= 0 or block_length <= 0 or steps <= 0:
        raise ValueError(
            f"steps, gen_length and block_length must be positive; got steps={steps}, "
            f"gen_length={gen_length}, block_length={block_length}"
        )
    if gen_length % block_length != 0:
        raise ValueError(
            f"gen_length ({gen_length}) must be a multiple of block_length ({block_length})"
        )
    num_blocks = gen_length // block_length
    if steps % num_blocks != 0:
        raise ValueError(
            f"steps ({steps}) must be a multiple of the number of blocks "
            f"gen_length / block_length = {num_blocks}"
        )
    return num_blocks


def _check_options(remasking, schedule, cache, threshold, factor, ddpm_cache) -> None:
    if remasking not in REMASKING:
        raise ValueError(f"unknown remasking {remasking!r}; expected one of {list(REMASKING)}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {list(SCHEDULES)}")
    if cache not in CACHES:
        raise ValueError(f"unknown cache {cache!r}; expected one of {list(CACHES)}")
    if threshold is not None and factor is not None:
        raise ValueError("give threshold or factor, not both")
    if remasking == "origin" and (threshold is not None or factor is not None):
        raise ValueError("remasking='origin' reveals masks at random; it takes no threshold")
    if ddpm_cache and (remasking != "origin" or cache != "none"):
        raise ValueError("ddpm_cache needs remasking='origin' and cache='none'")


def canvas_blocks(prompt_len: int, gen_length: int, block_length: int, device=None):
    """Block index of every canvas position (P + G,): answer blocks 0, 1, ... and the
    prompt cut from its end into blocks -1, -2, ... of block_length."""
    offset = torch.arange(prompt_len + gen_length, device=device) - prompt_len
    return torch.div(offset, block_length, rounding_mode="floor")


class _Canvas:
    """The rows still being decoded: tokens, positions, attention mask and K/V cache."""

    def __init__(self, x, valid, prompt_valid, mask_id, cfg_scale, cache, blocks=None):
        self.x = x  # (B, L)
        self.padded = not bool(valid.all())
        self.valid = valid  # (B, L) bool, False = left padding
        self.prompt_valid = prompt_valid  # (B, L) bool, True on real prompt tokens
        self.blocks = blocks  # (L,) block index per position for block-causal attention
        self.mask_id, self.cfg_scale = mask_id, cfg_scale
        self.cache = None
        if cache != "none":
            from unmask.models.attention import KVCache

            self.cache = KVCache()

    def select(self, rows: torch.Tensor) -> None:
        """Keep only rows `rows` (indices into the current rows)."""
        current = self.x.shape[0]
        self.x, self.valid = self.x[rows], self.valid[rows]
        self.prompt_valid = self.prompt_valid[rows]
        if self.cache is not None and self.cache.keys:  # guided caches hold 2B rows
            self.cache.select_rows(torch.cat([rows, rows + current]) if self.cfg_scale else rows)

    def forward(
        self, model: nn.Module, lo: int, hi: int, store: bool, visible: int
    ) -> torch.Tensor:
        """Logits (B, hi - lo, V) for canvas positions [lo, hi); keys are [0, visible)."""
        x, valid = self.x[:, :visible], self.valid[:, :visible]
        if self.cfg_scale > 0:
            uncond = x.masked_fill(self.prompt_valid[:, :visible], self.mask_id)
            x = torch.cat([x, uncond], dim=0)
            valid = torch.cat([valid, valid], dim=0)
        kwargs = {}
        if self.padded or self.cache is not None:
            kwargs["position_ids"] = ((valid.long().cumsum(1) - 1).clamp_min(0))[:, lo:hi]
        allowed = None
        if self.padded:  # real tokens see real tokens, padding sees padding
            allowed = valid[:, lo:hi, None] == valid[:, None, :]  # (B, hi - lo, L)
        if self.blocks is not None:  # a query sees its own block and earlier ones
            blocks = self.blocks[:visible]
            causal = (blocks[None, :] <= blocks[lo:hi, None])[None]  # (1, hi - lo, L)
            allowed = causal if allowed is None else allowed & causal
        if allowed is not None:
            kwargs["attention_mask"] = allowed[:, None]  # (B or 1, 1, hi - lo, L)
        if self.cache is not None:
            self.cache.store, self.cache.start = store, lo
            kwargs["kv_cache"] = self.cache
        logits = model(x[:, lo:hi], **kwargs)
        if self.cfg_scale > 0:
            cond, uncond = logits.chunk(2, dim=0)
            logits = cfg_combine(cond, uncond, self.cfg_scale)
        return logits


def _first_eos_fill(answers: torch.Tensor, eos_id: int) -> torch.Tensor:
    """answers (B, G) with every position after the first EOS set to EOS."""
    after = (answers == eos_id).long().cumsum(1) > 0
    return answers.masked_fill(after, eos_id)


@torch.no_grad()
def sample(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    *,
    mask_id: int,
    steps: int = 128,
    gen_length: int = 128,
    block_length: int | None = None,
    temperature: float = 0.0,
    remasking: str = "low_confidence",
    cfg_scale: float = 0.0,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
    schedule: str = "llada",
    eps: float = 1e-3,
    top_k: int | None = None,
    top_p: float | None = None,
    alg_temp: float | None = None,
    threshold: float | None = None,
    factor: float | None = None,
    cache: str = "none",
    cache_refresh: int = 0,
    shift_logits: bool = False,
    ddpm_cache: bool = False,
    growing_canvas: bool = False,
    block_causal: bool = False,
    eos_id: int | None = None,
    on_step: Callable[[torch.Tensor], None] | None = None,
) -> GenerationOutput:
    """Decode gen_length masked positions after each prompt; see the module docstring.

    prompt_ids (B, P) long; attention_mask (B, P) bool/int, 0 = left padding (None: no
    padding). Blocks of block_length (None = gen_length) are decoded left to right with
    steps / num_blocks steps each (`threshold` / `factor`: as many steps as the block
    needs). `model(ids, position_ids=, attention_mask=, kv_cache=)` returns (B, L, V)
    logits; the keywords are passed only when padding or a cache needs them.
    growing_canvas: the model sees only the prompt, finished blocks and the current block
    (masks of later blocks are not yet on the canvas), so a long gen_length with EOS
    stopping costs no more than the blocks a row needs and keeps the canvas close to the
    lengths the model was trained on (Dual cache then equals prefix cache).
    block_causal: block-diffusion attention (see `canvas_blocks`), for models trained with
    the `bd3lm` objective; block_length should be their block_size. on_step receives the
    full (B, P + G) canvas after every step.
    """
    block_length = block_length or gen_length
    _check_options(remasking, schedule, cache, threshold, factor, ddpm_cache)
    num_blocks = _check_lengths(steps, gen_length, block_length)
    steps_per_block = steps // num_blocks
    started = time.perf_counter()
    batch, prompt_len = prompt_ids.shape
    if prompt_len == 0:
        raise ValueError("the prompt is empty; give at least one token")
    device = prompt_ids.device
    prompt_valid = (
        torch.ones_like(prompt_ids, dtype=torch.bool)
        if attention_mask is None
        else attention_mask.to(device=device, dtype=torch.bool)
    )
    masks = torch.full((batch, gen_length), mask_id, dtype=prompt_ids.dtype, device=device)
    x_all = torch.cat([prompt_ids, masks], dim=1)  # (B, P + G)
    valid = torch.cat([prompt_valid, torch.ones_like(masks, dtype=torch.bool)], dim=1)
    in_prompt = torch.cat([prompt_valid, torch.zeros_like(masks, dtype=torch.bool)], dim=1)
    blocks = None
    if block_causal:
        if shift_logits:
            raise ValueError(
                "block_causal attention cannot use the logit shift (the first position of "
                "a block would be predicted from the block before, which cannot see it)"
            )
        blocks = canvas_blocks(prompt_len, gen_length, block_length, device)
    canvas = _Canvas(x_all.clone(), valid, in_prompt, mask_id, cfg_scale, cache, blocks)
    rows = torch.arange(batch, device=device)  # rows of x_all still being decoded
    out = GenerationOutput(x_all, prompt_len)
    length = x_all.shape[1]
    shift = 1 if shift_logits else 0

    for block in range(num_blocks):
        start, stop = prompt_len + block * block_length, prompt_len + (block + 1) * block_length
        quota = num_transfer_tokens((canvas.x[:, start:stop] == mask_id).sum(1), steps_per_block)
        parallel = threshold is not None or factor is not None
        max_steps = block_length if parallel else steps_per_block
        visible = stop if growing_canvas else length
        logits, last_x = None, None
        for step in range(max_steps):
            x_block = canvas.x[:, start:stop]
            is_mask = x_block == mask_id  # (B, Lb)
            if not is_mask.any():
                break
            reuse = ddpm_cache and last_x is not None and torch.equal(last_x, canvas.x)
            if not reuse:
                refresh = step == 0 or (cache_refresh > 0 and step % cache_refresh == 0)
                if cache == "none" or refresh:
                    lo, hi, store = 0, visible, cache != "none"
                else:
                    lo, hi, store = start - shift, (visible if cache == "prefix" else stop), False
                full = canvas.forward(model, lo, hi, store, visible)  # (B, hi - lo, V)
                # Dream shift: position i is predicted from hidden state i - 1 (start >= 1)
                logits = full[:, start - shift - lo : stop - shift - lo]  # (B, Lb, V)
                last_x = canvas.x.clone()
                out.nfe += 1
                out.row_forwards += canvas.x.shape[0]
            x0, filtered = propose_tokens(logits, mask_id, temperature, top_k, top_p, generator)
            x0 = torch.where(is_mask, x0, x_block)
            if remasking == "origin":
                fraction = unmask_fraction(step, steps_per_block, eps)
                commit = select_origin(is_mask, fraction, generator)
            else:
                probs = None
                if remasking not in ("low_confidence", "random"):
                    probs = sampling_probs(filtered, temperature)
                conf = CONFIDENCE_FNS[remasking](logits, probs, x0, generator)
                conf = conf.masked_fill(~is_mask, float("-inf"))
                if threshold is not None:
                    commit = select_threshold(conf, threshold)
                elif factor is not None:
                    commit = select_factor(conf, factor)
                else:
                    if schedule == "llada":
                        k = quota[:, step]
                    else:
                        k = dream_transfer_count(is_mask.sum(1), step, steps_per_block, eps)
                    if alg_temp:
                        commit = select_sampled(conf, k, alg_temp, generator)
                    else:
                        commit = select_top_k(conf, k)
            out.decoded += int(commit.sum())
            canvas.x[:, start:stop] = torch.where(commit, x0, x_block)
            if on_step is not None:
                x_all[rows] = canvas.x
                on_step(x_all.clone())
        x_all[rows] = canvas.x
        if eos_id is not None and block < num_blocks - 1:
            done = (canvas.x[:, prompt_len:stop] == eos_id).any(1)
            if done.any():
                keep = (~done).nonzero().squeeze(1)
                canvas.select(keep)
                rows = rows[keep]
                if rows.numel() == 0:
                    break
    if eos_id is not None:
        answers = x_all[:, prompt_len:]
        # rows that stopped early still hold masks after their EOS: fill them
        answers = answers.masked_fill(answers == mask_id, eos_id)
        answers = _first_eos_fill(answers, eos_id)
        x_all[:, prompt_len:] = answers
        out.tokens = int((answers != eos_id).sum())
    else:
        out.tokens = batch * gen_length
    out.sequences = x_all
    out.seconds = time.perf_counter() - started
    return out


def generate(model: nn.Module, prompt_ids: torch.Tensor, *, mask_id: int, **kwargs) -> torch.Tensor:
    """`sample(...)` returning only the tokens (B, P + G): prompt unchanged, no masks left.

    The LLaDA defaults (steps = gen_length = block_length = 128, T = 0, low_confidence)
    reproduce LLaDA's `generate`; see `sample` for every option.
    """
    return sample(model, prompt_ids, mask_id=mask_id, **kwargs).sequences


__all__ = [
    "CACHES",
    "GenerationOutput",
    "add_gumbel_noise",
    "canvas_blocks",
    "cfg_combine",
    "forbid_token",
    "generate",
    "left_pad",
    "num_transfer_tokens",
    "sample",
    "select_top_k",
]
