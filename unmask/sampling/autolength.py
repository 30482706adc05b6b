"""`gen_length: auto`: a canvas that grows while the model is not ready to end.

DAEDAL (Li et al. 2025, "Beyond Fixed: Variable-Length Denoising for Diffusion LLMs")
observes that a masked-diffusion model's confidence that the answer ends, read at the
tail of an all-mask canvas, tells whether the canvas is long enough. Its first phase
starts from a short canvas and lengthens it until that confidence is high; this module
does that per row, and grows a row again when it fills its canvas without an EOS:

1. length: every row starts with one block of masks (block_length). One forward pass
   reads P(EOS) at the canvas's last position; a row whose P(EOS) is below
   `auto_eos_threshold` gets one more block, up to `gen_length_max`, and is read again.
2. decode: rows that settled on the same length are decoded together by `sample` with
   that fixed gen_length, blocks of block_length, `steps` scaled to the length, and
   per-row EOS stopping as for any fixed canvas.
3. continue: a row that filled its canvas without an EOS, below the cap, decodes one
   more block after it (its answer so far becomes part of the prompt), until it holds
   an EOS or reaches the cap.

Every forward pass counts in `nfe` / `row_forwards`, the length reads included. With a
threshold of 0 no row grows: the tokens are those of a fixed canvas of one block.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from unmask.errors import InputError

if TYPE_CHECKING:  # pragma: no cover
    from unmask.sampling.config import SamplingConfig


def _steps_per_block(config: SamplingConfig) -> int:
    """config.steps spread over the cap's blocks (None: one token per step)."""
    block, cap = config.block_length, config.gen_length_max
    if config.steps is None:
        return block
    return max(1, round(config.steps * block / cap))


def _fixed(config: SamplingConfig, gen_length: int) -> SamplingConfig:
    """The fixed-length config a row of gen_length answer tokens is decoded with."""
    blocks = gen_length // config.block_length
    return config.updated(gen_length=gen_length, steps=blocks * _steps_per_block(config),
                          row_length=None)  # fmt: skip


@torch.no_grad()
def eos_confidence(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_valid: torch.Tensor,
    gen_length: int,
    config: SamplingConfig,
    mask_id: int,
    eos_id: int,
) -> torch.Tensor:
    """(B,) P(EOS) at the last position of an all-mask canvas of gen_length after each
    prompt (one forward pass, the same attention and positions `sample` uses)."""
    batch = prompt_ids.shape[0]
    masks = torch.full((batch, gen_length), mask_id, dtype=prompt_ids.dtype,
                       device=prompt_ids.device)  # fmt: skip
    x = torch.cat([prompt_ids, masks], dim=1)
    ones = torch.ones_like(masks, dtype=torch.bool)
    valid = torch.cat([prompt_valid, ones], dim=1)
    if config.cfg_scale > 0:  # guided: the unconditional rows mask the prompt
        uncond = x.masked_fill(torch.cat([prompt_valid, ~ones], dim=1), mask_id)
        x, valid = torch.cat([x, uncond]), torch.cat([valid, valid])
    kwargs = {}
    if not bool(valid.all()):  # left padding: real tokens see real tokens only
        kwargs["position_ids"] = (valid.long().cumsum(1) - 1).clamp_min(0)
        kwargs["attention_mask"] = (valid[:, :, None] == valid[:, None, :])[:, None]
    last = x.shape[1] - 1 - (1 if config.shift_logits else 0)
    logits = model(x, **kwargs)[:, last].float()  # (B or 2B, V)
    if config.cfg_scale > 0:
        cond, un = logits.chunk(2)
        logits = un + (config.cfg_scale + 1.0) * (cond - un)
    return torch.softmax(logits, dim=-1)[:, eos_id]


def prompt_mask(prompt_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, P) bool, True on real prompt tokens (attention_mask's non-zeros, all of them
    without one); ValueError on an empty prompt. Both decoders (this one and `sample`)
    start from it."""
    if prompt_ids.shape[1] == 0:
        raise ValueError("the prompt is empty; give at least one token")
    if attention_mask is None:
        return torch.ones_like(prompt_ids, dtype=torch.bool)
    return attention_mask.to(device=prompt_ids.device, dtype=torch.bool)


def check_room(model: nn.Module, prompt_len: int, cap: int) -> None:
    """InputError when prompt + gen_length_max does not fit the model's positions."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and prompt_len + cap > limit:
        raise InputError(
            f"gen_length_max={cap} after a prompt of {prompt_len} tokens exceeds the model's "
            f"{limit} positions; lower gen_length_max to at most {limit - prompt_len}"
        )


@torch.no_grad()
def sample_auto(
    decode: Callable,
    model: nn.Module,
    prompt_ids: torch.Tensor,
    config: SamplingConfig,
    *,
    mask_id: int,
    eos_id: int | None = None,
    attention_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    on_step=None,
):
    """`sample` for gen_length auto (see the module doc); decode: the fixed-length `sample`
    (passed in: generate.py calls this module). Returns its GenerationOutput with (B, P + G)
    sequences, G the longest canvas any row grew to; after each row's answer every position
    is EOS. on_step receives each fixed-length group's canvas (its own rows and width)."""
    if eos_id is None:
        raise ValueError("gen_length auto needs the EOS id (eos_id): growth stops at EOS")
    started = time.perf_counter()
    batch, prompt_len = prompt_ids.shape
    valid = prompt_mask(prompt_ids, attention_mask)
    cap = config.gen_length_max
    check_room(model, prompt_len, cap)
    device = prompt_ids.device
    work = {"nfe": 0, "row_forwards": 0, "decoded": 0}
    lengths = _settle_lengths(model, prompt_ids, valid, config, mask_id, eos_id, work)
    answers: list[torch.Tensor | None] = [None] * batch
    out = None
    for gen in sorted(set(lengths.tolist())):
        rows = (lengths == gen).nonzero().squeeze(1)
        part = decode(model, prompt_ids[rows], _fixed(config, gen), mask_id=mask_id,
                      eos_id=eos_id, attention_mask=valid[rows], generator=generator,
                      on_step=on_step)  # fmt: skip
        out = part if out is None else out
        _add_work(work, part)
        for row, answer in zip(rows.tolist(), part.answers):
            answers[row] = answer
    _continue(decode, model, prompt_ids, valid, answers, config, mask_id, eos_id, generator,
              work)  # fmt: skip
    width = max(a.shape[0] for a in answers)
    tail = torch.full((batch, width), eos_id, dtype=prompt_ids.dtype, device=device)
    for row, answer in enumerate(answers):
        tail[row, : answer.shape[0]] = answer
    return dataclasses.replace(
        out, sequences=torch.cat([prompt_ids, tail], dim=1), prompt_length=prompt_len,
        tokens=int((tail != eos_id).sum()), seconds=time.perf_counter() - started, **work,
    )  # fmt: skip


def _settle_lengths(model, prompt_ids, valid, config, mask_id, eos_id, work) -> torch.Tensor:
    """(B,) long: each row's canvas length, grown a block at a time while P(EOS) at its
    tail is below the threshold (phase 1)."""
    block, cap = config.block_length, config.gen_length_max
    lengths = torch.full((prompt_ids.shape[0],), block, dtype=torch.long)
    growing = torch.arange(prompt_ids.shape[0])
    while growing.numel():
        gen = int(lengths[growing[0]])
        conf = eos_confidence(model, prompt_ids[growing], valid[growing], gen, config,
                              mask_id, eos_id).cpu()  # fmt: skip
        work["nfe"] += 1
        work["row_forwards"] += growing.numel()
        short = conf < config.auto_eos_threshold
        if gen + block > cap:
            break
        growing = growing[short]
        lengths[growing] += block
    return lengths


def _continue(decode, model, prompt_ids, valid, answers, config, mask_id, eos_id, generator,
              work):  # fmt: skip
    """Phase 3: rows that filled their canvas without EOS decode one more block after it,
    until they hold an EOS or reach the cap."""
    block, cap = config.block_length, config.gen_length_max
    one_block = _fixed(config, block)
    while True:
        pending = [r for r, a in enumerate(answers)
                   if a.shape[0] + block <= cap and not bool((a == eos_id).any())]  # fmt: skip
        if not pending:
            return
        by_length: dict[int, list[int]] = {}
        for r in pending:
            by_length.setdefault(answers[r].shape[0], []).append(r)
        for rows in by_length.values():
            index = torch.tensor(rows, device=prompt_ids.device)
            so_far = torch.stack([answers[r] for r in rows])
            prompt = torch.cat([prompt_ids[index], so_far], dim=1)
            mask = torch.cat([valid[index], torch.ones_like(so_far, dtype=torch.bool)], dim=1)
            part = decode(model, prompt, one_block, mask_id=mask_id, eos_id=eos_id,
                          attention_mask=mask, generator=generator)  # fmt: skip
            _add_work(work, part)
            for r, more in zip(rows, part.answers):
                answers[r] = torch.cat([answers[r], more])


def _add_work(work: dict, part) -> None:
    for key in work:
        work[key] += getattr(part, key)
