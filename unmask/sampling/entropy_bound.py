"""`entropy_bound`: DiffusionGemma's sampler (Google's block-diffusion model, model_type
diffusion_gemma, models/diffusion_gemma.py), as transformers 5.24 defines it.

Written from transformers' `DiffusionGemmaGenerationMixin.generate`
(transformers/models/diffusion_gemma/generation_diffusion_gemma.py, transformers 5.24.0):
its `EntropyBoundSampler`, `StableAndConfidentStoppingCriteria` and
`LinearTemperatureScheduleLogitsProcessor`, with the defaults of its
`DiffusionGemmaGenerationConfig` (`ENTROPY_BOUND_DEFAULTS`). For each prompt:

1. the encoder reads the prompt once (`model.encode`: every layer's K/V);
2. canvases of the model's `canvas_length` tokens follow it, ceil(gen_length /
   canvas_length) of them at most, each denoised by steps n = N, N - 1, ..., 1
   (N = max_denoising_steps) until it stops:
   a. the decoder reads the canvas (`model.decode`, over the encoder's K/V), with the
      previous step's tempered logits as its self-conditioning signal (none at the first
      step of a canvas);
   b. logits / T, T = end + (start - end) n / N (the linear schedule: temperature_start at
      the first step, end + (start - end) / N at the last);
   c. a token is drawn at every position from softmax(logits / T) (`torch.multinomial`);
   d. acceptance by entropy: positions sorted by their entropy H (of softmax(logits / T)),
      the first k taken while H_1 + ... + H_k - H_k <= entropy_bound (the lowest always);
      the drawn tokens there are the accepted canvas, every other position is renoised
      (a new uniformly random token) for the next step. Nothing is kept between steps
      but the canvas itself: a position accepted at one step is renoised at the next
      unless accepted again;
   e. adaptive stopping: the canvas's argmax (of the tempered logits) is stable when it
      equals the argmax of each of the stability_threshold steps before, confident when
      the mean entropy over the canvas is below confidence_threshold; stable and confident
      stops the canvas;
3. the canvas's last argmax (not the accepted canvas) is the canvas's answer; it is
   appended to the encoder's cache (`model.encode(canvas, cache)`, positions after it),
   and a row whose canvas holds EOS (or the end-of-turn token `end_of_turn_id` knows)
   ends there.

A canvas starts as uniformly random tokens (`torch.randint` over the model's vocabulary).
Random draws are per row: each row draws from its own generator, seeded seed + n for the
n-th row the `generator` given seeds (`row_seeds`), in transformers' order for one prompt:
the canvas's tokens, then each step's `torch.multinomial` over the canvas (C, V) and
`torch.randint` (1, C) for renoising. So a row's draws never depend on the other rows (its
logits only by rounding: the batch's padding and shapes), and a prompt alone with seed S
draws what transformers' `generate` draws after `torch.manual_seed(S)`
(tests/unit/test_entropy_bound.py checks the tokens and the steps). seed: the generator's
own (`unmask generate --seed S`, a served request's seed) while it has drawn nothing, so
prompt i of `unmask generate --seed S` draws from S + i whatever the batch size; a number
drawn from it when something else drew from it; without one, a number drawn from torch's
global generator.

Left-padded prompts: the padding is masked out (the model's prompt_mask) and positions are
counted over each row's own tokens, so a row's positions are those it has alone
(transformers' batched `generate` counts them from the padded start; RoPE attends by
relative position, so only rounding differs).

What unmask's output holds: the (B, P + gen_length) canvas, the answer cut to gen_length
(transformers returns whole canvases), and after a row's first EOS every position is EOS
(transformers: pad), as every unmask decoder writes it. nfe counts the decoder's forwards
(denoising steps), row_forwards the rows in them, as transformers' tokens_per_forward
does; the encoder's passes (one per prompt, one per appended canvas) are not counted.
decoded: answer tokens up to and with the first EOS, so tokens_per_forward is
transformers'. History / on_step: after every step, the canvas's current argmax (what
transformers streams as the draft); positions not generated yet hold mask_id (pad_id
without one). An on_step with a true `wants_probability` attribute is called as
on_step(canvas, probability=(B, G) float): each shown token's probability under its step's
tempered distribution (NaN where nothing is drawn yet; the server's playground hover).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field

from unmask.errors import InputError
from unmask.models.diffusion_gemma_vision import Images
from unmask.sampling.decoders import (
    DecoderOptions,
    WholeDecoder,
    register_decoder,
    uniform_canvas_model,
)
from unmask.sampling.generate import GenerationOutput

if TYPE_CHECKING:  # pragma: no cover
    from unmask.sampling.config import SamplingConfig

#: row seeds are (seed + row) mod 2**64, torch.Generator.manual_seed's range
_SEED_RANGE = 2**64


# Its options and their defaults, those of transformers 5.24's DiffusionGemmaGenerationConfig
# (`_get_default_generation_params`: sampler_config.entropy_bound, max_denoising_steps,
# t_max, t_min, stability_threshold, confidence_threshold)
ENTROPY_BOUND_DEFAULTS = {"entropy_bound": 0.1, "max_denoising_steps": 48,
                          "temperature_start": 0.8, "temperature_end": 0.4,
                          "stability_threshold": 1, "confidence_threshold": 0.005}  # fmt: skip


class EntropyBoundOptions(DecoderOptions):
    """The options only decoder entropy_bound reads, SamplingConfig fields; None: its
    default (`ENTROPY_BOUND_DEFAULTS`)."""

    entropy_bound: float | None = Field(None, gt=0.0)
    """Decoder entropy_bound: each step accepts the sampled tokens of lowest entropy while
    the sum of their entropies less the largest stays within this bound (more accepted:
    faster, less independent); the rest of the canvas is renoised. None = transformers'
    0.1."""
    max_denoising_steps: int | None = Field(None, gt=0)
    """Decoder entropy_bound: the most denoising steps (decoder forwards) of one canvas; it
    stops sooner once stable and confident. None = transformers' 48."""
    temperature_start: float | None = Field(None, ge=0.0)
    """Decoder entropy_bound: the temperature of the linear schedule at its start
    (transformers' t_max); at step n of N remaining it is end + (start - end) n / N. None =
    0.8."""
    temperature_end: float | None = Field(None, ge=0.0)
    """Decoder entropy_bound: the schedule's end temperature (transformers' t_min), below
    temperature_start; the last step's is end + (start - end) / N. None = 0.4."""
    stability_threshold: int | None = Field(None, ge=0)
    """Decoder entropy_bound, adaptive stopping: a canvas is stable when its argmax equals
    that of each of this many steps before (0: always stable). None = transformers' 1."""
    confidence_threshold: float | None = Field(None, gt=0.0)
    """Decoder entropy_bound, adaptive stopping: a canvas is confident when its tokens'
    mean entropy (tempered) is below this; stable and confident stops it. None = 0.005."""


#: options decoder entropy_bound refuses when given: what it reads instead (the rest of the
#: sentence "decoder entropy_bound takes no NAME: ...")
NOT_ENTROPY_BOUND = {
    "temperature": "its temperature follows temperature_start to temperature_end",
    "top_p": "it samples the whole tempered distribution, as transformers does",
    "top_k": "it samples the whole tempered distribution, as transformers does",
    "steps": "a canvas takes at most max_denoising_steps",
    "block_length": "its canvases are the model's canvas_length",
    "remasking": "it accepts tokens by entropy_bound",
    "schedule": "it accepts tokens by entropy_bound",
    "alg_temp": "it accepts tokens by entropy_bound",
    "threshold": "it accepts tokens by entropy_bound",
    "factor": "it accepts tokens by entropy_bound",
    "sub_block_length": "its canvases are the model's canvas_length",
    "eos_penalty": "transformers' sampler changes no logit",
    "logits_eos_inf": "transformers' sampler changes no logit",
    "confidence_eos_eot_inf": "it accepts tokens by entropy_bound",
    "cfg_scale": "the model has no [MASK] to guide with",
    "cache": "the prompt's K/V are computed once, by the encoder",
    "cache_refresh": "the prompt's K/V are computed once, by the encoder",
    "shift_logits": "the decoder predicts each canvas position in place",
    "block_causal": "the canvas attends to the encoder's K/V and to itself",
    "blocks_from_start": "its canvases start after the prompt",
    "ddpm_cache": "every step renoises the canvas",
    "growing_canvas": "its canvases are the model's canvas_length",
    "logits_hook": "hooks are read by the masked decoders",
    "tokens_hook": "hooks are read by the masked decoders",
}


def entropy_bound_settings(config: SamplingConfig) -> dict[str, Any]:
    """The options of decoder entropy_bound: each one given, else transformers' default
    (`ENTROPY_BOUND_DEFAULTS`)."""
    return {name: default if getattr(config, name) is None else getattr(config, name)
            for name, default in ENTROPY_BOUND_DEFAULTS.items()}  # fmt: skip


def schedule_temperature(step: int, steps: int, start: float, end: float,
                         device: torch.device | None = None) -> torch.Tensor:  # fmt: skip
    """The temperature at denoising step `step` (counting down: steps at the first, 1 at
    the last): end + (start - end) step / steps, a float32 0-dim tensor computed as
    transformers' LinearTemperatureScheduleLogitsProcessor computes it."""
    remaining = torch.tensor(step, device=device, dtype=torch.int32)
    return end + ((start - end) * (remaining / steps))


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """(..., C, V) logits -> (..., C) entropy of softmax(logits) (torch's Categorical, as
    transformers computes it for acceptance and stopping)."""
    return torch.distributions.Categorical(logits=logits).entropy()


def entropy_bound_accept(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """(..., C) entropies -> bool (..., C): the positions accepted, the lowest-entropy ones
    while their cumulative entropy less the largest of them (the last, sorted ascending)
    stays within `bound`; the lowest is always accepted."""
    ordered, order = torch.sort(entropy, dim=-1, descending=False)
    chosen = ordered.cumsum(dim=-1) - ordered <= bound
    return torch.zeros_like(chosen).scatter(-1, order, chosen)


class StableAndConfident:
    """Adaptive stopping of one canvas's rows: a row stops when its argmax canvas equals
    those of each of the last `stability` steps (0: always stable) and its mean token
    entropy is below `confidence`. The history starts at -1 (no token), so with stability
    s a canvas takes at least s + 1 steps."""

    def __init__(self, rows: int, canvas_length: int, stability: int, confidence: float,
                 device: torch.device | None = None):  # fmt: skip
        self.stability, self.confidence = stability, confidence
        self.history = torch.full((stability, rows, canvas_length), -1, dtype=torch.long,
                                  device=device)  # fmt: skip

    def __call__(self, rows: torch.Tensor, argmax: torch.Tensor,
                 entropy: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Rows `rows` (indices) with this step's argmax (R, C) and entropies (R, C) ->
        bool (R,): they stop; their history moves on by this step."""
        confident = entropy.mean(dim=-1) < self.confidence
        if self.stability == 0:
            return confident
        past = self.history[:, rows]
        stable = (past == argmax[None]).all(dim=-1).all(dim=0)
        self.history[:, rows] = torch.cat((past[1:], argmax[None]), dim=0)
        return stable & confident


#: generator -> (its state after the rows it seeded, their base seed, how many): the next
#: call with it continues the count while nothing else drew from it
_SEEDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def row_seeds(generator: torch.Generator | None, rows: int) -> list[int]:
    """The seeds of a call's rows: base + n for the n-th row this generator seeds, where
    base is the generator's own seed while it has drawn nothing (so a prompt alone with
    --seed S draws what transformers draws after torch.manual_seed(S), and prompt i of
    `unmask generate --seed S` gets S + i whatever the batch size), else a number drawn
    from it (it was used for something else). None: a base drawn from torch's global
    generator."""
    top = 2**62
    if generator is None:
        base = int(torch.randint(top, (1,)))
        return [(base + row) % _SEED_RANGE for row in range(rows)]
    device, state = generator.device, generator.get_state()
    seeded = _SEEDED.get(generator)
    if seeded is not None and torch.equal(seeded[0], state):  # the rows after those before
        base, start = seeded[1], seeded[2]
    else:
        unused = torch.Generator(device=device).manual_seed(generator.initial_seed())
        fresh = torch.equal(unused.get_state(), state)
        base = generator.initial_seed() if fresh else int(torch.randint(top, (1,),
                                                                        generator=generator,
                                                                        device=device))  # fmt: skip
        start = 0
    _SEEDED[generator] = (generator.get_state(), base, start + rows)
    return [(base + start + row) % _SEED_RANGE for row in range(rows)]


class EntropyBound(WholeDecoder):
    """`entropy_bound`: DiffusionGemma's entropy-bound sampler with adaptive stopping and
    the linear temperature schedule, over canvases of the model's canvas_length (the module
    doc). Options entropy_bound, max_denoising_steps, temperature_start / _end,
    stability_threshold, confidence_threshold (`entropy_bound_settings`)."""

    options = tuple(EntropyBoundOptions.model_fields)
    refuses = NOT_ENTROPY_BOUND
    uniform_canvas = True
    block_layout = False
    #: `unmask serve` batches its rows continuously, canvas by canvas (serve/canvases.py),
    #: with `serve_canvas`: each row draws from its own generator and reads only its own K/V
    serves_by_canvas = True

    @classmethod
    def serve_canvas(cls, model, cache, positions, generators, config, out, show=None,
                     probability=None) -> torch.Tensor:  # fmt: skip
        """One canvas of served rows: `denoise_canvas`, the steps `decode` runs."""
        return denoise_canvas(model, cache, positions, generators,
                              entropy_bound_settings(config), out, show, probability)  # fmt: skip

    @classmethod
    def check(cls, config: SamplingConfig) -> None:
        """Its own options: the masked decoders' are refused when given, gen_length is a
        number of tokens, and the temperature schedule falls (transformers' t_max > t_min)."""
        if config.gen_length == "auto":
            raise ValueError("decoder entropy_bound stops a row at the canvas holding EOS; "
                             "give gen_length N (the most tokens)")  # fmt: skip
        defaults = type(config).model_fields
        for name, why in NOT_ENTROPY_BOUND.items():
            value = getattr(config, name)
            if value is not None and value != defaults[name].get_default():
                raise ValueError(f"decoder entropy_bound takes no {name} ({why}); leave {name} "
                                 f"at its default")  # fmt: skip
        settings = entropy_bound_settings(config)
        start, end = settings["temperature_start"], settings["temperature_end"]
        if start <= end:
            raise ValueError(f"decoder entropy_bound: temperature_start ({start}) must be "
                             f"above temperature_end ({end}): the schedule falls from start to "
                             f"end")  # fmt: skip

    @torch.no_grad()
    def decode(self, model, prompt_ids, prompt_valid, config, *, mask_id, eos_id, pad_id,
               eot_id, generator, on_step, images: Images | None = None) -> GenerationOutput:  # fmt: skip
        if not uniform_canvas_model(model):
            kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
            raise InputError(f"decoder entropy_bound denoises the random-token canvases of a "
                             f"prompt encoder's model (model_type diffusion_gemma); this model "
                             f"({kind}) is not one: use decoder masked")  # fmt: skip
        started = time.perf_counter()
        placeholder = next((i for i in (mask_id, pad_id) if i is not None), 0)  # not drawn yet
        run = _Run(model, prompt_ids, prompt_valid, config, placeholder, generator,
                   [i for i in (eos_id, eot_id) if i is not None], images)  # fmt: skip
        run.history = [] if config.history else None
        run.on_step = on_step
        answers, generated = run.all_canvases()
        fill = next((i for i in (eos_id, eot_id, pad_id, mask_id) if i is not None), 0)
        out, gen = run.out, config.gen_length  # whole canvases, cut to gen_length
        out.sequences, out.tokens, out.decoded = _ended(prompt_ids, answers[:, :gen],
                                                        generated[:, :gen], run.stops, fill)  # fmt: skip
        out.history = run.history
        out.seconds = time.perf_counter() - started
        return out


class _Run:
    """One `EntropyBound.decode` call: the rows, their generators, positions and cache."""

    def __init__(self, model, prompt_ids: torch.Tensor, prompt_valid: torch.Tensor,
                 config: SamplingConfig, mask_id: int, generator: torch.Generator | None,
                 stops: list[int], images: Images | None = None):  # fmt: skip
        self.model, self.config, self.mask_id, self.stops = model, config, mask_id, stops
        self.settings = entropy_bound_settings(config)
        self.prompt_ids = prompt_ids
        batch, width = prompt_ids.shape
        self.device = device = prompt_ids.device
        self.canvas_length = model.config.diffusion_gemma.canvas_length
        self.gen_length = config.gen_length
        self.canvases = -(-config.gen_length // self.canvas_length)
        self.generators = [torch.Generator(device=device).manual_seed(seed)
                           for seed in row_seeds(generator, batch)]  # fmt: skip
        self.lengths = prompt_valid.sum(1)  # each row's own tokens: its positions count them
        self.out = GenerationOutput(prompt_ids, width)
        self.history: list[torch.Tensor] | None = None
        self.on_step = None
        positions = (prompt_valid.long().cumsum(1) - 1).clamp_min(0)
        padded = not bool(prompt_valid.all())
        self.cache = model.encode(prompt_ids, position_ids=positions,
                                  prompt_mask=prompt_valid if padded else None,
                                  images=images)  # fmt: skip
        total = self.canvases * self.canvas_length
        self.answers = torch.full((batch, total), mask_id, dtype=torch.long, device=device)
        self.generated = torch.zeros((batch, total), dtype=torch.bool, device=device)
        #: the probability of each shown (argmax) token under its step's tempered
        #: distribution, for an on_step that asks for it (`wants_probability`)
        self.probability = torch.full((batch, total), float("nan"), device=device)

    def all_canvases(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every canvas of every row -> (answers (B, canvases x C), generated: bool, False
        after the canvas a row ended with)."""
        length, rows = self.canvas_length, torch.arange(self.prompt_ids.shape[0],
                                                          device=self.device)  # fmt: skip
        stops = torch.tensor(self.stops, dtype=torch.long, device=self.device)
        for index in range(self.canvases):
            columns = slice(index * length, (index + 1) * length)
            positions = (self.lengths[rows, None] + index * length
                         + torch.arange(length, device=self.device))  # fmt: skip
            canvas = self._denoise(rows, positions, columns)
            self.answers[rows, columns] = canvas
            self.generated[rows, columns] = True
            if index == self.canvases - 1:
                break
            keep = ~torch.isin(canvas, stops).any(dim=1)  # EOS in the canvas: the row ends
            if not keep.any():
                break
            if not keep.all():
                rows, canvas, positions = rows[keep], canvas[keep], positions[keep]
                self.cache = self.cache.select_rows(keep.nonzero().squeeze(1))
            self.cache = self.model.encode(canvas, self.cache, position_ids=positions)
        return self.answers, self.generated

    def _denoise(self, rows: torch.Tensor, positions: torch.Tensor,
                 columns: slice) -> torch.Tensor:  # fmt: skip
        """The steps of one canvas for batch rows `rows` (the cache's rows) -> its argmax
        canvas (R, C)."""
        gens = [self.generators[r] for r in rows.tolist()]
        wanted = getattr(self.on_step, "wants_probability", False)
        shown = torch.full((len(gens), self.canvas_length), float("nan"), device=self.device)

        def show(argmax: torch.Tensor) -> None:
            if wanted:
                self.probability[rows, columns] = shown
            self._show(rows, argmax, columns)

        return denoise_canvas(self.model, self.cache, positions, gens, self.settings, self.out,
                              show, shown if wanted else None)  # fmt: skip

    def _show(self, rows: torch.Tensor, argmax: torch.Tensor, columns: slice) -> None:
        """History / on_step: the (B, P + G) canvas with this canvas's current argmax."""
        if self.history is None and self.on_step is None:
            return
        answers = self.answers.clone()
        answers[rows, columns] = argmax
        canvas = torch.cat((self.prompt_ids, answers[:, : self.gen_length]), dim=1)
        if self.history is not None:
            self.history.append(canvas)
        if self.on_step is None:
            return
        if getattr(self.on_step, "wants_probability", False):  # the playground's hover
            self.on_step(canvas.clone(), probability=self.probability[:, : self.gen_length])
        else:
            self.on_step(canvas.clone())


def denoise_canvas(model, cache, positions: torch.Tensor, generators: list[torch.Generator],
                   settings: dict[str, Any], out, show: Callable | None = None,
                   probability: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The denoising steps of one canvas (the module doc's 2a-2e) for the rows of `cache`
    (the encoder's K/V of their prompts and earlier canvases), each drawing from its own
    generator -> the canvas's last argmax (R, C). positions (R, C): the canvas's RoPE
    positions; settings: `entropy_bound_settings`; out: counts nfe, steps and row_forwards;
    show(argmax) after every step; probability (R, C): filled with each shown token's
    probability under its step's tempered distribution (the rows still denoising)."""
    steps, length = settings["max_denoising_steps"], positions.shape[1]
    device, vocab = positions.device, model.config.vocab_size
    # self-conditioning logits in the (tied) embedding's dtype, as transformers casts them
    signal_dtype = model.lm_head.weight.dtype
    gens = generators
    current = torch.cat([torch.randint(0, vocab, (1, length), generator=g, device=device)
                         for g in gens])  # fmt: skip
    argmax = current.clone()
    signal: torch.Tensor | None = None  # the last step's tempered logits (R, C, V)
    done = torch.zeros(len(gens), dtype=torch.bool, device=device)
    stopper = StableAndConfident(len(gens), length, settings["stability_threshold"],
                                 settings["confidence_threshold"], device)  # fmt: skip
    live, rows_cache = None, cache
    for step in range(steps, 0, -1):
        index = (~done).nonzero().squeeze(1)
        if live is None or index.numel() != live.numel():  # rows stopped: a smaller batch
            live = index
            rows_cache = cache if live.numel() == len(gens) else cache.select_rows(live)
        logits = model.decode(current[live], rows_cache,
                              None if signal is None else signal[live],
                              position_ids=positions[live])  # fmt: skip
        out.nfe += 1
        out.steps += 1
        out.row_forwards += live.numel()
        temperature = schedule_temperature(step, steps, settings["temperature_start"],
                                           settings["temperature_end"], device)  # fmt: skip
        tempered = logits / temperature
        probs = torch.softmax(tempered, dim=-1, dtype=torch.float32)
        drawn = torch.stack([torch.multinomial(probs[i], 1, generator=gens[r]).squeeze(-1)
                             for i, r in enumerate(live.tolist())])  # fmt: skip
        best = torch.argmax(tempered, dim=-1)
        if probability is not None:
            probability[live] = probs.amax(dim=-1)
        entropy = token_entropy(tempered)
        accepted = entropy_bound_accept(entropy, settings["entropy_bound"])
        kept = torch.where(accepted, drawn, current[live])
        noise = torch.cat([torch.randint(0, vocab, (1, length), generator=gens[r],
                                         device=device) for r in live.tolist()])  # fmt: skip
        current[live] = torch.where(accepted, kept, noise)
        argmax[live] = best
        if signal is None:
            signal = tempered.new_zeros((len(gens), *tempered.shape[1:]), dtype=signal_dtype)
        signal[live] = tempered.to(signal_dtype)
        done[live] |= stopper(live, best, entropy)
        if show is not None:
            show(argmax)
        if done.all():
            break
    return argmax


def _ended(prompt_ids: torch.Tensor, answers: torch.Tensor, generated: torch.Tensor,
           stops: list[int], fill: int) -> tuple[torch.Tensor, int, int]:  # fmt: skip
    """(sequences (B, P + G), answer tokens before each row's first stop token, summed,
    answer tokens up to and with it): answers cut to G = gen_length, positions after the
    first stop token (and those never generated) set to `fill` (EOS)."""
    answers = answers.clone()
    stop = torch.isin(answers, torch.tensor(stops, dtype=torch.long, device=answers.device))
    before = (stop.long().cumsum(dim=1) - stop.long()) == 0  # up to and with the first stop
    kept = generated & before
    answers[~kept] = fill
    tokens = int((kept & ~stop).sum())
    return torch.cat((prompt_ids, answers), dim=1), tokens, int(kept.sum())


register_decoder("entropy_bound", EntropyBound)

__all__ = [
    "ENTROPY_BOUND_DEFAULTS",
    "EntropyBound",
    "StableAndConfident",
    "denoise_canvas",
    "entropy_bound_settings",
    "entropy_bound_accept",
    "row_seeds",
    "schedule_temperature",
    "token_entropy",
]
