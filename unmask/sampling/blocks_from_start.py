"""Fast-dLLM v2's sampler (`blocks_from_start`): block diffusion with the logit shift,
blocks counted from position 0 of the sequence, sub-block threshold decoding and the first
token of each later block read from the finished block's last position.

The canvas is cut into blocks of block_length from its first position, so the first
answer block holds the prompt's tail. Attention is block-causal (a position sees its own
block and the blocks before it); the K/V of finished blocks never change, so the cache is
exact. For each answer block:

1. while a sub-block (sub_block_length, left to right) has masks: one forward of the block
   over the cached keys before it; the logits are shifted within the block (position i
   reads output i - 1; the block's first position its own output); every masked position
   of the sub-block whose greedy / drawn token has probability > threshold is committed,
   and always the first of the most confident ones;
2. when the block is full: one forward of the finished block stores its K/V and its last
   output gives the next block's first token (as autoregression would).

Before the first answer block the prompt's whole blocks are read in one forward; when the
prompt ends on a block boundary that forward's last output gives the first answer token.
This is NVlabs/Fast-dLLM v2's `batch_sample` (without its optional block cache): the same
tokens and forward calls, except that it also runs step 2 after the last block (one more
forward, one token past the canvas) where this sampler stops
(tests/unit/test_blocks_from_start.py mirrors its loop).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from unmask.models.attention import KVCache
from unmask.sampling.autoregressive import grow_cache
from unmask.sampling.decoders import WholeDecoder, register_decoder
from unmask.sampling.generate import GenerationOutput, finish_output
from unmask.sampling.transfer import propose_tokens, sampling_probs

if TYPE_CHECKING:  # pragma: no cover
    from unmask.sampling.config import SamplingConfig


@dataclass
class BlocksFromStartResult:
    """What a decode produced: sequences (B, T) with T = the canvas (prompt + answer blocks,
    ending on a block boundary), forwards (model calls), decoded (positions committed by
    the model) and row_forwards (calls times rows in them)."""

    sequences: torch.Tensor
    forwards: int = 0
    decoded: int = 0
    row_forwards: int = 0


def _shifted(logits: torch.Tensor) -> torch.Tensor:
    """Position i reads output i - 1 within the fed block; the first its own (v2)."""
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


class _Model:
    """The model over a canvas with a KV cache sized for it and block-causal masks."""

    def __init__(self, model: nn.Module, length: int, block: int, rows: int, device):
        self.model, self.length, self.block = model, length, block
        self.cache = KVCache(store=True)
        self.keys = torch.arange(length, device=device)
        self.rows = rows
        self.calls = 0
        self.row_calls = 0

    def prefix(self, x: torch.Tensor, stop: int) -> torch.Tensor:
        """Logits of [0, stop) (whole blocks), stored; the cache then grows to the canvas."""
        positions = self.keys[:stop].expand(x.shape[0], stop)
        blocks = self.keys[:stop] // self.block
        mask = (blocks[None, :] <= blocks[:, None])[None, None]
        logits = self.model(x[:, :stop], position_ids=positions, attention_mask=mask,
                            kv_cache=self.cache)  # fmt: skip
        grow_cache(self.cache, self.length - stop)
        self._count(x)
        return logits

    def block_logits(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Logits (B, block, V) of the block at [start, start + block) over the cached keys
        before it (the block's own K/V are written in place: the last call's stay)."""
        if not self.cache.keys:  # nothing before the first block: start the cache here
            self.cache.store = True
            logits = self.model(x[:, : self.block], position_ids=self.keys[: self.block].expand(
                x.shape[0], self.block), kv_cache=self.cache)  # fmt: skip
            grow_cache(self.cache, self.length - self.block)
            self._count(x)
            return logits
        stop = start + self.block
        self.cache.store, self.cache.start = False, start
        mask = (self.keys < stop)[None, None, None].expand(1, 1, self.block, self.length)
        positions = self.keys[start:stop].expand(x.shape[0], self.block)
        logits = self.model(x[:, start:stop], position_ids=positions, attention_mask=mask,
                            kv_cache=self.cache)  # fmt: skip
        self._count(x)
        return logits

    def _count(self, x: torch.Tensor) -> None:
        self.calls += 1
        self.row_calls += x.shape[0]


@torch.no_grad()
def decode_blocks_from_start(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    gen_length: int,
    *,
    block_length: int,
    sub_block_length: int,
    threshold: float,
    mask_id: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> BlocksFromStartResult:
    """Fill the blocks after prompts of one length (prompt_ids (B, P), no padding): the
    canvas ends at the first block boundary at or after P + gen_length. With eos_id a row
    stops after the block in which it commits EOS (the loop ends when every row has)."""
    batch, prompt_len = prompt_ids.shape
    device = prompt_ids.device
    end = -(-(prompt_len + gen_length) // block_length) * block_length
    x = torch.full((batch, end), mask_id, dtype=prompt_ids.dtype, device=device)
    x[:, :prompt_len] = prompt_ids
    runner = _Model(model, end, block_length, batch, device)
    out = BlocksFromStartResult(x)
    rows = torch.arange(batch, device=device)  # rows of x still decoding
    first_block = prompt_len // block_length
    if first_block > 0:
        logits = runner.prefix(x, first_block * block_length)
        if prompt_len % block_length == 0:  # the first answer token, autoregressively
            x[:, prompt_len] = logits[:, -1].argmax(-1)
            out.decoded += batch
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    for start in range(first_block * block_length, end, block_length):
        stop = start + block_length
        view = x[rows]
        for sub in range(start, stop, sub_block_length):
            while bool((view[:, sub : sub + sub_block_length] == mask_id).any()):
                logits = _shifted(runner.block_logits(view, start))
                window = logits[:, sub - start : sub - start + sub_block_length]
                proposal, filtered = propose_tokens(window, mask_id, temperature, top_k, top_p,
                                                    generator)  # fmt: skip
                probs = sampling_probs(filtered, temperature)
                conf = probs.gather(-1, proposal[..., None]).squeeze(-1)
                is_mask = view[:, sub : sub + sub_block_length] == mask_id
                conf = conf.masked_fill(~is_mask, float("-inf"))
                commit = conf > threshold
                first = conf.argmax(-1)  # v2: the first of the most confident
                has = is_mask.any(-1)
                commit[torch.arange(len(first), device=device), first] |= has
                commit &= is_mask
                out.decoded += int(commit.sum())
                region = view[:, sub : sub + sub_block_length]
                view[:, sub : sub + sub_block_length] = torch.where(commit, proposal, region)
                if eos_id is not None:
                    done[rows] |= ((proposal == eos_id) & commit).any(-1)
        x[rows] = view
        if stop >= end or bool(done[rows].all()):
            break
        logits = runner.block_logits(view, start)  # the finished block: K/V stored
        nxt = logits[:, -1].argmax(-1)
        view[:, stop] = nxt
        x[rows] = view
        out.decoded += int((~done[rows]).sum())
        keep = ~done[rows]
        if not bool(keep.all()):
            runner.cache.select_rows(keep.nonzero().squeeze(1))
            rows = rows[keep]
    out.forwards, out.row_forwards = runner.calls, runner.row_calls
    return out


class BlocksFromStart(WholeDecoder):
    """`blocks_from_start`: Fast-dLLM v2's form (`decode_blocks_from_start`): rows of one prompt
    length decode together (blocks are counted from each row's first real token); each
    row's first gen_length answer tokens fill its place in the (B, P + G) output."""

    shifted_blocks = True

    @classmethod
    def check(cls, config: SamplingConfig) -> None:
        """Fast-dLLM v2's sampler: block-causal, shifted, threshold decoding, no guidance."""
        if not (config.block_causal and config.shift_logits):
            raise ValueError("blocks_from_start is Fast-dLLM v2's form: it needs block_causal "
                             "and shift_logits")  # fmt: skip
        if config.threshold is None:
            raise ValueError("blocks_from_start decodes sub-blocks by threshold; give threshold")
        if config.gen_length == "auto" or config.cfg_scale > 0 or config.block_length is None:
            raise ValueError("blocks_from_start needs block_length, a gen_length N and "
                             "cfg_scale 0")  # fmt: skip

    def decode(self, model, prompt_ids, prompt_valid, config, *, mask_id, eos_id, pad_id,
               eot_id, generator, on_step) -> GenerationOutput:  # fmt: skip
        started = time.perf_counter()
        batch, width = prompt_ids.shape
        gen = config.gen_length
        sequences = torch.full((batch, width + gen), mask_id, dtype=prompt_ids.dtype,
                               device=prompt_ids.device)  # fmt: skip
        sequences[:, :width] = prompt_ids
        out = GenerationOutput(sequences, width)
        lengths = prompt_valid.sum(1)
        for length in lengths.unique().tolist():
            rows = (lengths == length).nonzero().squeeze(1)
            done = decode_blocks_from_start(
                model, prompt_ids[rows, width - length :], gen, block_length=config.block_length,
                sub_block_length=config.sub_block_length or config.block_length,
                threshold=config.threshold, mask_id=mask_id, temperature=config.temperature,
                top_k=config.top_k, top_p=config.top_p, eos_id=eos_id, generator=generator,
            )  # fmt: skip
            sequences[rows, width:] = done.sequences[:, length : length + gen]
            out.nfe += done.forwards
            out.steps += done.forwards
            out.decoded += done.decoded
            out.row_forwards += done.row_forwards
        finish_output(out, sequences, mask_id, eos_id)
        out.seconds = time.perf_counter() - started
        return out


register_decoder("blocks_from_start", BlocksFromStart)
