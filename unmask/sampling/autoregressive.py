"""Left-to-right sampling of an autoregressive (`diffusion.objective: ar`) model with a KV
cache: one forward over the prompt, then one forward per new token.

The model is the native decoder run under a causal mask (the forward's `attention_mask`);
the prompt's keys and values are kept in a `KVCache` sized for prompt + answer, and each
step feeds the one token just chosen at its canvas position, attending over the cached
keys at or before it. Tokens are chosen as transformers' `generate` chooses them:
argmax at temperature 0, else a draw from softmax(logits / T) after top-k / top-p (the
same filters as the diffusion sampler, `transfer.filtered_logits`). Greedy output equals
transformers' greedy `generate` on the exported folder (tests/unit/test_autoregressive.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from unmask.models.attention import KVCache
from unmask.sampling.decoders import WholeDecoder, register_decoder
from unmask.sampling.generate import GenerationOutput, finish_output
from unmask.sampling.transfer import add_gumbel_noise, filtered_logits

if TYPE_CHECKING:  # pragma: no cover
    from unmask.sampling.config import SamplingConfig


@dataclass
class LeftToRightResult:
    """What a left-to-right decode produced: sequences (B, P + G) (after a row's first EOS,
    with eos_id, every position is EOS), forwards (model calls), decoded (tokens chosen by
    the model, rows that had stopped excluded), row_forwards (calls times rows in them)."""

    sequences: torch.Tensor
    forwards: int
    decoded: int
    row_forwards: int


def next_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """(B,) the chosen ids from last-position logits (B, V): argmax at temperature 0, else
    a Gumbel-argmax draw from softmax(logits / T) over what top-k / top-p keep."""
    kept = filtered_logits(logits, temperature, top_k, top_p)
    return add_gumbel_noise(kept, temperature, generator).argmax(dim=-1)


def _step_mask(valid: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """(B, 1, hi - lo, L) bool: query at canvas position q (lo <= q < hi) sees keys k <= q
    that are real tokens; a padding query sees padding (so no row of the mask is empty)."""
    length = valid.shape[1]
    keys = torch.arange(length, device=valid.device)
    queries = torch.arange(lo, hi, device=valid.device)
    causal = keys[None, :] <= queries[:, None]  # (Lq, L)
    same_kind = valid[:, lo:hi, None] == valid[:, None, :]  # (B, Lq, L)
    return (causal[None] & same_kind)[:, None]


@torch.no_grad()
def decode_left_to_right(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_valid: torch.Tensor,
    gen_length: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    fill_id: int = 0,
    generator: torch.Generator | None = None,
    on_step=None,
) -> LeftToRightResult:
    """Append gen_length tokens to each (left-padded) prompt, one forward per token.

    prompt_ids (B, P) long, prompt_valid (B, P) bool (False = left padding). The model is
    called as `model(ids, position_ids=, attention_mask=, kv_cache=)` (the native decoder's
    signature). With eos_id, a row that has chosen EOS keeps EOS and the loop stops once
    every row has (the remaining positions are EOS); fill_id is what unfilled positions
    hold meanwhile. on_step receives the (B, P + G) canvas after every token.
    """
    batch, prompt_len = prompt_ids.shape
    device = prompt_ids.device
    length = prompt_len + gen_length
    x = torch.full((batch, length), fill_id, dtype=prompt_ids.dtype, device=device)
    x[:, :prompt_len] = prompt_ids
    valid = torch.ones((batch, length), dtype=torch.bool, device=device)
    valid[:, :prompt_len] = prompt_valid
    positions = (valid.long().cumsum(1) - 1).clamp_min(0)
    cache = KVCache(store=True)
    logits = model(x[:, :prompt_len], position_ids=positions[:, :prompt_len],
                   attention_mask=_step_mask(valid[:, :prompt_len], 0, prompt_len),
                   kv_cache=cache)[:, -1]  # fmt: skip
    grow_cache(cache, gen_length)
    out = LeftToRightResult(x, forwards=1, decoded=0, row_forwards=batch)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    for step in range(gen_length):
        pos = prompt_len + step
        chosen = next_token(logits.float(), temperature, top_k, top_p, generator)
        if eos_id is not None:
            chosen = torch.where(done, torch.full_like(chosen, eos_id), chosen)
        out.decoded += int((~done).sum())
        x[:, pos] = chosen
        if on_step is not None:
            on_step(x.clone())
        if eos_id is not None:
            done = done | (chosen == eos_id)
            if bool(done.all()):
                x[:, pos + 1 :] = eos_id
                break
        if step == gen_length - 1:
            break
        cache.store, cache.start = False, pos
        logits = model(x[:, pos : pos + 1], position_ids=positions[:, pos : pos + 1],
                       attention_mask=_step_mask(valid, pos, pos + 1), kv_cache=cache)[:, -1]  # fmt: skip
        out.forwards += 1
        out.row_forwards += batch
    return out


def grow_cache(cache: KVCache, extra: int) -> None:
    """Room for `extra` more positions in every layer's cached keys and values (zeros,
    never attended to before they are written)."""
    for layer, (k, v) in enumerate(zip(cache.keys, cache.values)):
        cache.keys[layer] = torch.cat([k, k.new_zeros(*k.shape[:2], extra, k.shape[3])], dim=2)
        cache.values[layer] = torch.cat([v, v.new_zeros(*v.shape[:2], extra, v.shape[3])], 2)


class LeftToRight(WholeDecoder):
    """`left_to_right`: an autoregressive model (`config.autoregressive`), one token per
    forward with a KV cache (`decode_left_to_right`)."""

    autoregressive = True

    @classmethod
    def check(cls, config: SamplingConfig) -> None:
        """Left-to-right sampling takes no options of masked decoding that change its
        result."""
        if config.gen_length == "auto":
            raise ValueError("autoregressive sampling stops at EOS by itself; give gen_length N")
        for name in ("block_causal", "shift_logits", "growing_canvas"):
            if getattr(config, name):
                raise ValueError(f"autoregressive sampling is causal already; {name} does not "
                                 f"apply")  # fmt: skip
        if config.cfg_scale > 0:
            raise ValueError("autoregressive sampling has no mask to guide with; use cfg_scale 0")

    def decode(self, model, prompt_ids, prompt_valid, config, *, mask_id, eos_id, pad_id,
               eot_id, generator, on_step) -> GenerationOutput:  # fmt: skip
        started = time.perf_counter()
        history = [] if config.history else None

        def step(canvas: torch.Tensor) -> None:
            if history is not None:
                history.append(canvas)
            if on_step is not None:
                on_step(canvas)

        fill = eos_id if eos_id is not None else (pad_id if pad_id is not None else 0)
        done = decode_left_to_right(
            model, prompt_ids, prompt_valid, config.gen_length, temperature=config.temperature,
            top_k=config.top_k, top_p=config.top_p, eos_id=eos_id, fill_id=fill,
            generator=generator, on_step=step if (history is not None or on_step) else None,
        )  # fmt: skip
        out = GenerationOutput(done.sequences, prompt_ids.shape[1], nfe=done.forwards,
                               steps=done.forwards, decoded=done.decoded,
                               row_forwards=done.row_forwards, history=history)  # fmt: skip
        finish_output(out, done.sequences, -1, eos_id)
        out.seconds = time.perf_counter() - started
        return out


register_decoder("left_to_right", LeftToRight)
