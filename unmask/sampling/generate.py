"""One sampler for masked-diffusion LMs: fill a masked canvas block by block.

Swappable parts (docs/diffusion.md, Sampling):
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
    of block_length from its end, or with block_origin request from its first token).
    Block-causal K/V of finished blocks never change, so both caches are exact there;
  - the block grid (`block_origin`, layout.py): blocks of the answer alone, or counted
    from each request's first token (LLaDA2's generate, SGLang), rows of different prompt
    lengths each on their own grid;
  - the model call: classifier-free guidance, Dream's logit shift;
  - the decoder (`decoders.py`), each in its own module: `masked` (masked.py, the block
    decoder above), `left_to_right` (autoregressive.py, an autoregressive model),
    `blocks_from_start` (Fast-dLLM v2's form), `joint_threshold` (editing.py),
    `entropy_bound`, or one registered with `register_decoder` and named by `decoder`.
Batches of prompts of different lengths are left-padded (attention mask + position ids);
with `eos_id` a row stops once a finished block holds EOS (with eos_early_stop, at the
step that commits an EOS with no mask before it), and everything after its first EOS is
EOS. `sample` returns the tokens with NFE and throughput.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from pydantic import ValidationError
from torch import nn

from unmask.errors import InputError, describe_validation_error
from unmask.models.attention import KVCache
from unmask.models.diffusion_gemma_vision import Images
from unmask.sampling.autolength import prompt_mask, sample_auto
from unmask.sampling.decoders import (
    WholeDecoder,
    decoder_class,
    uniform_canvas_model,
)
from unmask.sampling.hooks import call_tokens_hook
from unmask.sampling.layout import canvas_blocks, filler_token, lay_out

if TYPE_CHECKING:  # pragma: no cover
    # config.py imports the decoders' modules (their options models), which build on this one
    from unmask.sampling.config import SamplingConfig


@dataclass
class GenerationOutput:
    """Generated canvases and how much work they took.

    sequences: (B, P + G) long: the (left-padded) prompt, then the answer; after a row's
    first EOS (when eos_id is set) every position is EOS. nfe: model forward calls (a
    guided call on 2B rows counts once). steps: denoising steps taken over all blocks
    (the `step` hooks see). tokens: answer tokens before each row's first
    EOS, summed over rows. decoded: positions committed by the model (the EOS fill of
    stopped rows excluded). edits: committed tokens the decoder replaced by others
    (joint_threshold's T2T edits; 0 for decoders that never edit). row_forwards: forward
    calls times rows in them. history: with
    config.history, the (B, P + G) canvas after every step (what `--show` draws), else None.
    """

    sequences: torch.Tensor
    prompt_length: int
    nfe: int = 0
    steps: int = 0
    tokens: int = 0
    decoded: int = 0
    edits: int = 0
    row_forwards: int = 0
    seconds: float = 0.0
    history: list[torch.Tensor] | None = None

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


class Canvas:
    """The rows still being decoded: tokens, positions, attention mask and K/V cache."""

    def __init__(self, x, valid, prompt_valid, mask_id, cfg_scale, cache, blocks=None):
        self.x = x  # (B, L)
        self.padded = not bool(valid.all())
        self.valid = valid  # (B, L) bool, False = left padding
        self.prompt_valid = prompt_valid  # (B, L) bool, True on real prompt tokens
        self.blocks = blocks  # (L,) block index per position for block-causal attention
        self.mask_id, self.cfg_scale = mask_id, cfg_scale
        self.cache = KVCache() if cache != "none" else None

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
    config: SamplingConfig,
    *,
    mask_id: int,
    eos_id: int | None = None,
    attention_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    on_step: Callable[[torch.Tensor], None] | None = None,
    pad_id: int | None = None,
    eot_id: int | None = None,
    images: Images | None = None,
) -> GenerationOutput:
    """Decode config.gen_length masked positions after each prompt (see the module doc);
    with config.row_length, row_length - P of them (`SamplingConfig.fitted`).

    prompt_ids (B, P) long; attention_mask (B, P) bool/int, 0 = left padding (None: no
    padding). Blocks of config.block_length are decoded left to right, steps / num_blocks
    steps each (`threshold` / `factor`: as many steps as the block needs).
    `model(ids, position_ids=, attention_mask=, kv_cache=)` returns (B, L, V) logits; the
    keywords are passed only when padding or a cache needs them (a uniform-canvas model,
    DiffusionGemma, is decoded by entropy_bound: sampling/entropy_bound.py). With eos_id a
    row leaves the batch once a finished block holds EOS. on_step receives the full
    (B, P + G) canvas after every step. pad_id (with eos_id, for `eos_penalty`) and eot_id (the end-of-turn
    token, for `confidence_eos_eot_inf`) are the tokenizer's. images: the prompts' pictures
    (models/diffusion_gemma_vision.py `Images`, in the order of their image tokens), for a
    DiffusionGemma folder with a vision tower (decoder entropy_bound). ValueError when the lengths
    do not split into blocks; InputError when an option needs an id that is not given or a
    hook raises.
    """
    if not config.uniform_canvas and uniform_canvas_model(model):  # DiffusionGemma: no [MASK]
        config = with_uniform_canvas(config)
    if images is not None and not uniform_canvas_model(model):
        raise InputError("images need a diffusion_gemma model with a vision tower; this model "
                         "takes text only: drop the images")  # fmt: skip
    if images is not None and config.gen_length == "auto":
        raise InputError("gen_length auto does not take images yet; give a gen_length")
    if config.gen_length == "auto":  # grow the canvas while the model is not ready to end
        return sample_auto(sample, model, prompt_ids, config, mask_id=mask_id, eos_id=eos_id,
                           attention_mask=attention_mask, generator=generator,
                           on_step=on_step)  # fmt: skip
    batch, prompt_len = prompt_ids.shape
    prompt_valid = prompt_mask(prompt_ids, attention_mask)  # ValueError on an empty prompt
    config = config.fitted(prompt_len)  # row_length: the canvas that fills a training row
    decoder_cls = decoder_class(config)  # decoders.py: the named strategy
    if issubclass(decoder_cls, WholeDecoder):  # left_to_right, blocks_from_start, ...
        extra = {} if images is None else {"images": images}  # entropy_bound's
        return decoder_cls().decode(model, prompt_ids, prompt_valid, config, mask_id=mask_id,
                                    eos_id=eos_id, pad_id=pad_id, eot_id=eot_id,
                                    generator=generator, on_step=on_step, **extra)  # fmt: skip
    if images is not None:
        raise InputError(f"decoder {config.decoder} takes no images; use decoder entropy_bound")
    config.check_lengths()
    special = special_ids(config, eos_id, pad_id, eot_id)
    started = time.perf_counter()
    device = prompt_ids.device
    block_length = config.resolved_block_length
    layout = lay_out(prompt_ids, prompt_valid, config.gen_length, block_length,
                     config.block_origin, mask_id, filler_token(mask_id, eos_id))  # fmt: skip
    x_all = layout.x  # (B, L): the canvas, every row (sampling/layout.py)
    blocks = layout.blocks if config.block_causal else None
    canvas = Canvas(x_all.clone(), layout.valid, layout.in_prompt, mask_id, config.cfg_scale,
                    config.cache, blocks)  # fmt: skip
    rows = torch.arange(batch, device=device)  # rows of x_all still being decoded
    answer = layout.answer_columns()  # (B, L) each row's answer positions
    out = GenerationOutput(x_all, prompt_len, history=[] if config.history else None)
    steps_per_block = config.steps_per_block()
    if config.tokens_hook is not None:  # Dream: once before the first step, (None, x, None)
        canvas.x = call_tokens_hook(config.tokens_hook, None, canvas.x, None)
    last = len(layout.starts) - 1
    for block, start in enumerate(layout.starts):
        stop = start + block_length
        decoder = decoder_cls(config, model, canvas, start, stop, steps_per_block, mask_id,
                              special)  # fmt: skip
        if config.eos_early_stop and eos_id is not None:
            decoder.stop_at_eos(eos_id, answer[rows])
        for step in range(decoder.max_steps):
            if not decoder.step(step, generator, out):
                break
            if on_step is not None or out.history is not None:
                x_all[rows] = canvas.x
                if out.history is not None:
                    out.history.append(layout.output(x_all).clone())
                if on_step is not None:
                    on_step(layout.output(x_all).clone())
        x_all[rows] = canvas.x
        if block < last:  # rows that end here: EOS in a finished block, or no block left
            done = layout.row_blocks[rows] <= block + 1
            if eos_id is not None:
                done |= ((canvas.x[:, :stop] == eos_id) & answer[rows, :stop]).any(1)
            if done.any():
                keep = (~done).nonzero().squeeze(1)
                canvas.select(keep)
                rows = rows[keep]
                if rows.numel() == 0:
                    break
    finish_output(out, layout.output(x_all), mask_id, eos_id)
    out.seconds = time.perf_counter() - started
    return out


def with_uniform_canvas(config: SamplingConfig) -> SamplingConfig:
    """config for a uniform-canvas model (DiffusionGemma) that its folder did not mark:
    uniform_canvas on, so the implied decoder is entropy_bound; one-line InputError when
    its options are a masked decoder's."""
    try:
        return config.updated(uniform_canvas=True)
    except ValidationError as err:
        raise InputError(describe_validation_error(err, "sampling option")) from None


def special_ids(config: SamplingConfig, eos_id, pad_id, eot_id) -> dict[str, list[int]]:
    """The token ids the EOS options act on: `penalized` (eos_penalty: EOS and PAD),
    `forbidden` (logits_eos_inf: EOS), `unconfident` (confidence_eos_eot_inf: EOS and the
    end-of-turn token). InputError naming the option when the tokenizer lacks an id."""

    def need(option: str, ids: dict[str, int | None]) -> list[int]:
        missing = [name for name, value in ids.items() if value is None]
        if missing:
            raise InputError(
                f"sampling option {option} needs the tokenizer's {' and '.join(missing)} "
                f"token id, which it does not have; add the token to the tokenizer (a chat "
                f"model's end of turn is {' or '.join(END_OF_TURN_TOKENS)}) or turn it off"
            )
        return sorted({value for value in ids.values()})

    special = {"penalized": [], "forbidden": [], "unconfident": []}
    if config.eos_penalty > 0:  # PAD too where the tokenizer has one
        special["penalized"] = sorted({*need("eos_penalty", {"EOS": eos_id}), pad_id} - {None})
    if config.logits_eos_inf:
        special["forbidden"] = need("logits_eos_inf", {"EOS": eos_id})
    if config.confidence_eos_eot_inf:
        special["unconfident"] = need("confidence_eos_eot_inf",
                                      {"EOS": eos_id, "end-of-turn": eot_id})  # fmt: skip
    return special


END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>")


def end_of_turn_id(tokenizer) -> int | None:
    """The id of the tokenizer's end-of-turn token (LLaDA's <|eot_id|>, or <|im_end|> of
    Qwen-style chat templates as in Dream), None when it has neither."""
    vocab = tokenizer.get_vocab()
    return next((vocab[t] for t in END_OF_TURN_TOKENS if t in vocab), None)


def eos_adjusted(logits: torch.Tensor, special: dict[str, list[int]],
                 eos_penalty: float) -> torch.Tensor:  # fmt: skip
    """The model's logits with eos_penalty subtracted from EOS and PAD and, with
    logits_eos_inf, EOS at -inf (LLaDA): both proposals and confidences see them. special:
    `special_ids`. Out of place."""
    penalized, forbidden = special["penalized"], special["forbidden"]
    if penalized:
        ids = torch.tensor(penalized, device=logits.device)
        logits = logits.index_add(-1, ids, torch.full(
            (*logits.shape[:-1], len(penalized)), -eos_penalty,
            dtype=logits.dtype, device=logits.device))  # fmt: skip
    if forbidden:
        logits = logits.index_fill(-1, torch.tensor(forbidden, device=logits.device),
                                   float("-inf"))  # fmt: skip
    return logits


def finish_output(out: GenerationOutput, x_all: torch.Tensor, mask_id: int, eos_id: int | None):
    """Final canvases and answer-token count: with eos_id, masks left in rows that stopped
    early and everything after a row's first EOS become EOS."""
    prompt_len = out.prompt_length
    if eos_id is not None:
        answers = x_all[:, prompt_len:]
        answers = answers.masked_fill(answers == mask_id, eos_id)
        answers = _first_eos_fill(answers, eos_id)
        x_all[:, prompt_len:] = answers
        out.tokens = int((answers != eos_id).sum())
    else:
        out.tokens = x_all.shape[0] * (x_all.shape[1] - prompt_len)
    out.sequences = x_all


# The decoders register themselves in their own modules, which build on this one:
# masked.py, autoregressive.py (left_to_right), blocks_from_start.py, editing.py
# (joint_threshold) and entropy_bound.py; the package imports them (sampling/__init__.py).

__all__ = [
    "Canvas",
    "GenerationOutput",
    "canvas_blocks",
    "cfg_combine",
    "left_pad",
    "sample",
]
