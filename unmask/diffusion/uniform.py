"""`uniform`: DiffusionGemma's training objective (model_type diffusion_gemma): canvas
supervision under uniform-random token corruption, with two-pass self-conditioning.

Per row (docs/diffusion.md, Uniform corruption, gives the sources):

- the answer: from the row's first maskable column to its first maskable EOS, included
  (the EOS padding after it is not part of it; an answer cut by the row's end, without
  EOS, runs to its last maskable column); the prompt: the columns before it;
- the answer cut into canvases of C = `model.diffusion_gemma.canvas_length` tokens; the
  last canvas filled with EOS after the answer's EOS (scored, as NeMo AutoModel's and
  Google's canvas chunking does; a cut answer's canvas scores its columns inside the row
  only); one canvas k of the row's n drawn uniformly, k = min(floor(u n), n - 1);
- the encoder reads the prompt and the k canvases before it, clean (what transformers'
  generate has appended when it decodes canvas k), left-padded to the row's length L
  (`prompt_mask` False on the padding; positions from 0 at the first real token, the
  canvas right after it);
- t = (1 - time_eps) u + time_eps (`diffusion.t_sampling`); each canvas position replaced
  with probability t by a token drawn uniformly from the model's vocabulary [0, V)
  (transformers' canvas initialization and NeMo AutoModel's corruption draw from the whole
  vocabulary; a draw may equal the clean token);
- self-conditioning: with probability `diffusion.self_conditioning_prob` (0.5) per row, the
  decoder's second pass gets the first pass's logits (no gradients, no signal) as its
  signal; the first pass runs on every row (DiffusionGemma.forward, `self_condition`);
- loss: the cross-entropy of the clean token at every scored canvas position (replaced or
  not), unweighted (no 1/t); count: the scored positions, so the trainer divides the step's
  sum by the step's scored tokens (per token over the step, as every unmask objective).

Randomness: five draws from the generator, in this order, each for the whole batch: u_t
(B,), u_canvas (B,), u_self (B,), u_replace (B, L) and u_token (B, L) (the canvas uses their
first C columns; the token is min(floor(u V), V - 1)). `global_noise`: a multi-process run
draws them for the global batch and keeps its rows (`with_noise`), so 1 and N processes
agree and a resumed run (the trainer's generator is checkpointed) draws the same noise.
"""

from __future__ import annotations

import torch
from torch import nn

from unmask.diffusion.config import DiffusionConfig
from unmask.diffusion.noise import RowSlice, rand_rows, sample_t
from unmask.diffusion.objectives import Objective, ObjectiveOutput, maskable_of
from unmask.diffusion.registry import ObjectiveContext, ObjectiveSpec, register_objective

#: the batch keys `with_noise` adds (the draws of the module docstring, in draw order)
NOISE_KEYS = ("uniform_t", "uniform_canvas", "uniform_self", "uniform_replace", "uniform_token")


def answer_spans(input_ids: torch.Tensor, maskable: torch.Tensor,
                 eos_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(start, end, ended) (B,) of each row's answer: its first maskable column (L when none),
    its last column included (the first maskable EOS, else the last maskable column) and
    whether it ends with that EOS."""
    length = input_ids.shape[1]
    has = maskable.any(1)
    start = torch.where(has, maskable.int().argmax(1), length)
    is_eos = maskable & (input_ids == eos_id)
    ended = is_eos.any(1)
    last = length - 1 - maskable.flip(1).int().argmax(1)
    end = torch.where(ended, is_eos.int().argmax(1), last)
    return start, torch.where(has, end, start - 1), ended


def canvas_rows(input_ids: torch.Tensor, maskable: torch.Tensor, eos_id: int, canvas: int,
                u_canvas: torch.Tensor) -> dict[str, torch.Tensor]:  # fmt: skip
    """The chosen canvas of every row (module docstring), clean:

    - `encoder_ids`, `prompt_mask`, `position_ids` (B, L): the prompt and the canvases
      before the chosen one, left-padded (padding: EOS ids, prompt_mask False, position 0);
    - `canvas_ids`, `scored` (B, C): the canvas's clean tokens (EOS after the answer) and
      the positions the loss scores; `canvas_positions` (B, C): their RoPE positions;
    - `index`, `count` (B,): the chosen canvas and the row's canvases (0: no answer).
    """
    rows, length = input_ids.shape
    device = input_ids.device
    start, end, ended = answer_spans(input_ids, maskable, eos_id)
    answer = (end - start + 1).clamp(min=0)
    count = torch.div(answer + canvas - 1, canvas, rounding_mode="floor")
    index = torch.minimum((u_canvas * count).long(), (count - 1).clamp(min=0))
    encoded = torch.where(count > 0, start + index * canvas, length - 1)  # no answer: unscored
    cols = torch.arange(length, device=device).expand(rows, length)
    source = cols - (length - encoded)[:, None]  # the row's column at each encoder column
    real = source >= 0
    encoder_ids = torch.where(real, input_ids.gather(1, source.clamp(min=0)), eos_id)
    positions = encoded[:, None] + torch.arange(canvas, device=device)  # the canvas's columns
    inside = positions <= end[:, None]
    canvas_ids = torch.where(inside, input_ids.gather(1, positions.clamp(max=length - 1)), eos_id)
    scored = (count > 0)[:, None] & (inside | ended[:, None])
    return {"encoder_ids": encoder_ids, "prompt_mask": real, "position_ids": source.clamp(min=0),
            "canvas_ids": canvas_ids, "scored": scored, "canvas_positions": positions,
            "index": index, "count": count}  # fmt: skip


def corrupt_canvas(canvas_ids: torch.Tensor, t: torch.Tensor, u_replace: torch.Tensor,
                   u_token: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(noisy canvas, replaced) (B, C): each position replaced where u_replace < t (per row)
    by token min(floor(u_token V), V - 1) of the vocabulary [0, V)."""
    width = canvas_ids.shape[1]
    replaced = u_replace[:, :width] < t[:, None]
    tokens = (u_token[:, :width] * vocab_size).long().clamp(max=vocab_size - 1)
    return torch.where(replaced, tokens, canvas_ids), replaced


def _base(model: nn.Module) -> nn.Module:
    """The model under a LoRA wrapper (its canvas length and vocabulary)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class UniformObjective(Objective):
    """DiffusionGemma's canvas objective (module docstring). The model is called once per
    micro-batch: `model(encoder_ids, noisy_canvas, prompt_mask=, position_ids=,
    canvas_position_ids=, self_condition=, targets=, target_weights=, images=)` returns the
    weighted cross-entropy sum (models/diffusion_gemma.py; `images`: the batch's pictures,
    models/diffusion_gemma_vision.py `Images`, in the encoder with the frozen tower).
    `last_stats`: mean_t, num_replaced (scored positions replaced), num_scored."""

    global_noise = True

    def __init__(self, cfg: DiffusionConfig, eos_id: int) -> None:
        self.cfg, self.eos_id = cfg, eos_id
        self.last_stats: dict[str, torch.Tensor] = {}

    def with_noise(self, batch: dict, generator: torch.Generator | None = None,
                   rows: RowSlice | None = None) -> dict:  # fmt: skip
        """The batch with this objective's five draws (module docstring) for its rows."""
        input_ids = batch["input_ids"]
        shape, device = tuple(input_ids.shape), input_ids.device
        t = sample_t(shape[0], self.cfg.t_sampling, self.cfg.time_eps, generator, device, rows)
        draws = [t] + [rand_rows(size, rows, generator, device)
                       for size in (shape[:1], shape[:1], shape, shape)]  # fmt: skip
        return {**batch, **dict(zip(NOISE_KEYS, draws))}

    def count(self, batch: dict) -> torch.Tensor | None:
        return None  # a cut answer's last canvas scores fewer positions: the draw decides

    def __call__(self, model: nn.Module, batch: dict,
                 generator: torch.Generator | None = None) -> ObjectiveOutput:  # fmt: skip
        if NOISE_KEYS[0] not in batch:
            batch = self.with_noise(batch, generator)
        t, u_canvas, u_self, u_replace, u_token = (batch[key] for key in NOISE_KEYS)
        base = _base(model)
        canvas, vocab = base.canvas_length, base.config.vocab_size
        input_ids = batch["input_ids"]
        if canvas > input_ids.shape[1]:
            raise ValueError(f"canvas_length {canvas} is above the row length "
                             f"{input_ids.shape[1]}")  # fmt: skip
        rows = canvas_rows(input_ids, maskable_of(batch), self.eos_id, canvas, u_canvas)
        noisy, replaced = corrupt_canvas(rows["canvas_ids"], t, u_replace, u_token, vocab)
        scored = rows["scored"]
        targets = torch.where(scored, rows["canvas_ids"], torch.full_like(noisy, -100))
        condition = u_self < self.cfg.self_conditioning_prob
        loss_sum = model(rows["encoder_ids"], noisy, prompt_mask=rows["prompt_mask"],
                         position_ids=rows["position_ids"],
                         canvas_position_ids=rows["canvas_positions"],
                         self_condition=condition if self.cfg.self_conditioning_prob > 0 else None,
                         targets=targets, target_weights=scored.float(),
                         images=batch.get("images"))  # fmt: skip
        count = scored.sum().float()
        self.last_stats = {"mean_t": t.detach().float().mean(),
                           "num_replaced": (replaced & scored).sum().detach().float(),
                           "num_scored": count.detach()}  # fmt: skip
        return ObjectiveOutput(loss_sum, count)


def _build(context: ObjectiveContext) -> UniformObjective:
    if context.eos_id is None:
        raise ValueError("objective uniform needs the EOS id (where each answer ends)")
    return UniformObjective(context.diffusion, context.eos_id)


#: diffusion: settings the uniform objective has no use for, and their defaults
_UNUSED = {"loss_weight": "inverse_t", "schedule": "linear", "min_masked": 0,
           "random_length_prob": 0.0, "prompt_drop_prob": 0.0}  # fmt: skip


def _check_diffusion(cfg: DiffusionConfig) -> None:
    for key, default in _UNUSED.items():
        if key in cfg.model_fields_set and getattr(cfg, key) != default:
            raise ValueError(
                f"diffusion.{key} is not used by objective uniform (an unweighted cross-entropy "
                f"of one uniformly corrupted canvas per row, no masking): leave it at {default!r}"
            )


def _check_run(run) -> None:
    if run.data.packing or run.data.streaming:
        raise ValueError(
            "objective uniform cuts each row's answer into canvases and needs one example per "
            "row: set data.packing: false (data.pad_policy eos or single_eos) and "
            "data.streaming: false"
        )


register_objective(ObjectiveSpec("uniform", _build, canvas_decoder=True,
                                 check_diffusion=_check_diffusion, check_run=_check_run))  # fmt: skip
