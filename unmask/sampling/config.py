"""Sampling settings, declared once: `SamplingConfig`, and how layered settings resolve into
one (`resolve_sampling`, a folder's family defaults: `FolderSampling`).

Every sampling option is a field of `SamplingConfig`: `sample` reads it, the
`unmask generate` flags and the lm-eval adapter's model_args are its fields, and a model
folder's generation_config.json carries them in its "unmask" entry (written and read by
sampling/generation_file.py). The run config's `eval:` section (the held-out generation at
the end of training) holds one too: unmask/config/eval.py. The options every decoder reads
or refuses are declared here; a built-in decoder's own options are declared in its module,
as one model (`MaskedOptions` in masked.py, `JointThresholdOptions` in editing.py,
`EntropyBoundOptions` in entropy_bound.py), which SamplingConfig composes into the same
flat fields (a decoder from another package gives its own as `decoder_options`).
"""

from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from unmask.errors import InputError, describe_validation_error, did_you_mean
from unmask.sampling.decoders import (
    DECODERS,
    OPTION_SETTINGS,
    BlockDecoder,
    check_own_options,
    decoder_choices,
    decoder_class,
    decoder_names,
    given,
    implied,
    owner_of,
)
from unmask.sampling.editing import JointThreshold, JointThresholdOptions
from unmask.sampling.entropy_bound import EntropyBound, EntropyBoundOptions
from unmask.sampling.hooks import import_hook
from unmask.sampling.masked import MaskedBlockDecoder, MaskedOptions
from unmask.sampling.schedules import SCHEDULES
from unmask.sampling.transfer import remasking_choices

CACHES = ("none", "prefix", "dual")
# the options that take one of a set of names; remasking's set grows with
# transfer.register_confidence, so each is read when a value is checked
_CHOICES = {
    "remasking": remasking_choices,
    "schedule": lambda: SCHEDULES,
    "cache": lambda: CACHES,
    "decoder": decoder_names,
    "block_origin": lambda: BLOCK_ORIGINS,
}
# a decoder's own options that take one of a set of names: the decoder declares the names
# (`Decoder.choices`: joint_threshold's presets and edit scopes, masked's fill rules)
_DECODER_CHOICES = tuple(name for kind in (MaskedBlockDecoder, JointThreshold, EntropyBound)
                         for name in kind.choices)  # fmt: skip
# options that may be None (not given) though they take one of a set of names
_UNSET_CHOICES = ("decoder", *_DECODER_CHOICES)
# where blocks are counted from: the answer's first position (blocks of the answer alone),
# or the request's first token (LLaDA2's generate, SGLang: the prompt's tail shares the
# first decoded block with masks); sampling/layout.py
BLOCK_ORIGINS = ("answer", "request")
# Options of one call, never of a model folder: generation_config.json neither holds nor
# gives them (a downloaded folder must not name code to run), model_dump leaves them out.
RUNTIME_OPTIONS = ("logits_hook", "tokens_hook", "history")


class _SharedOptions(BaseModel):
    """SamplingConfig's options up to the decoder's choice: the canvas, proposals, commits,
    cache, attention, the kind of model and the decoder."""

    model_config = OPTION_SETTINGS

    gen_length: int | Literal["auto"] = 32
    """Tokens to generate after each prompt (the canvas of masks), or `auto`: start from
    one block and grow by a block while the model is not ready to end, up to
    gen_length_max (autolength.py)."""
    row_length: int | None = Field(None, gt=1)
    """Fit the canvas to the rows the model was trained on: each prompt gets gen_length =
    row_length - its length in tokens, so prompt + answer fill one training row (the
    trainer records data.packing_length here in every checkpoint). A gen_length given
    after it (a flag, a task) wins; None = use gen_length."""
    steps: int | None = Field(None, gt=0)
    """Denoising steps over the whole answer; None = gen_length (one token per step)."""
    block_length: int | None = Field(None, gt=0)
    """Semi-autoregressive block length, decoded left to right; None = gen_length."""
    temperature: float = Field(0.0, ge=0.0)
    """Sampling temperature of the proposed tokens; 0 = greedy (argmax). Applied before
    top_p and top_k, as in Dream and transformers."""
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    """Nucleus filtering of the proposals, on the tempered distribution (None = off); with
    top_k too, the nucleus is taken first (Dream's order)."""
    top_k: int | None = Field(None, ge=0)
    """Top-k filtering of the proposals (None or 0 = off)."""
    eos_penalty: float = Field(0.0, ge=0.0)
    """Subtracted from the EOS and PAD logits before filtering and confidences (0 = off), so
    an instruct model that ends too early or pads with EOS answers longer."""
    logits_eos_inf: bool = False
    """LLaDA: EOS is never proposed (its logit is -inf): every answer fills the canvas."""
    confidence_eos_eot_inf: bool = False
    """LLaDA: proposals of EOS or the end-of-turn token get confidence 0, so they are
    committed last (ids from the tokenizer: its EOS and <|eot_id|> or <|im_end|>)."""
    remasking: str = "low_confidence"
    """Which proposals to commit: `low_confidence` (LLaDA), `random`, Dream's `maskgit_plus`,
    `topk_margin`, `entropy`, `confidence_threshold` (Dream: steps' quotas, what falls
    under `threshold` carried to the next step), or `origin` (masks revealed at random);
    or a score added with `unmask.sampling.register_confidence`."""
    schedule: Literal[SCHEDULES] = "llada"
    """Tokens committed per step: `llada` per-block quotas or `dream` timesteps."""
    eps: float = Field(1e-3, gt=0.0, lt=1.0)
    """Final noise level of the `dream` timesteps and `origin` reveal fractions."""
    alg_temp: float | None = Field(None, ge=0.0)
    """Dream: draw the committed positions from softmax(confidence / alg_temp) instead of
    taking the top ones (None or 0 = top ones)."""
    threshold: float | None = None
    """Fast-dLLM parallel decoding: commit every proposal with confidence >= threshold (and
    at least the top one) each step."""
    sub_block_length: int | None = Field(None, gt=0)
    """Fast-dLLM v2: decode each block in sub-blocks of this many positions, left to right,
    each with threshold / factor parallel decoding (None = the whole block at once)."""
    factor: float | None = Field(None, ge=0.0)
    """Fast-dLLM parallel decoding, factor rule: accept ranks while conf_r >= 1 - factor /
    (r + 1)."""
    cfg_scale: float = Field(0.0, ge=0.0)
    """Classifier-free guidance scale (0 = off): un + (scale + 1) (cond - un)."""
    cache: Literal[CACHES] = "none"
    """K/V cache: `none`, `prefix` (everything before the block reused) or `dual` (prefix
    and suffix reused); refreshed at each block start."""
    cache_refresh: int = Field(0, ge=0)
    """Also refresh the cache every N steps inside a block (0 = only at block starts; 1 =
    every step, exact)."""
    shift_logits: bool = False
    """Dream's logit shift: position i is predicted from the output at i - 1 (default:
    from the model folder; on for Dream models)."""
    block_causal: bool = False
    """Block-diffusion attention: a position sees its own block and earlier ones (default:
    from the model folder; on for bd3lm models)."""
    autoregressive: bool = False
    """Left to right, one token per forward with a KV cache, under a causal mask: how an
    autoregressive model (`diffusion.objective: ar`) samples (default: from the model
    folder). temperature, top_k, top_p, gen_length (row_length) apply; steps, blocks and
    remasking do not."""
    uniform_canvas: bool = False
    """The model denoises canvases that start as uniformly random tokens, its prompt read
    once by an encoder (Google's DiffusionGemma, model_type diffusion_gemma): decoder
    entropy_bound decodes it, and the masked decoders do not apply (it has no [MASK]).
    Default: from the model folder (on for diffusion_gemma folders)."""
    blocks_from_start: bool = False
    """Fast-dLLM v2's form (with block_causal and shift_logits): blocks counted from the
    sequence's first position, so the first answer block holds the prompt's tail; sub-block
    threshold decoding; each later block's first token read from the finished block's last
    position (blocks_from_start.py). Default: from the model folder."""
    decoder: str | None = None
    """The decoding strategy by name: masked, left_to_right, blocks_from_start,
    joint_threshold (LLaDA2.1's token editing), entropy_bound (DiffusionGemma's sampler),
    or one added with `unmask.sampling.register_decoder` (docs/sampling.md). Default: the
    one the options imply (left_to_right with autoregressive, entropy_bound with
    uniform_canvas, blocks_from_start with blocks_from_start, else masked)."""
    decoder_options: dict[str, Any] | None = None
    """Options a decoder from another package declares itself (its `options_model`,
    sampling/decoders.py `Decoder`), by name: `--decoder-option NAME=VALUE` (repeated; the
    value read as a YAML scalar), a mapping in YAML and in generation_config.json, or
    "decoder_options": {...} under a request's "unmask". Checked by the decoder that runs
    (a decoder without an options model refuses them). Default: none (its own defaults)."""


class _BlockGridOptions(BaseModel):
    """SamplingConfig's options of the block decoders' grid (`BlockDecoder`)."""

    model_config = OPTION_SETTINGS

    block_origin: str = "answer"
    """Where blocks are counted from: `answer` (the answer's first position: blocks hold
    only masks) or `request` (the request's first token, as LLaDA2's generate and SGLang
    count them: the prompt's tail shares the first decoded block with masks, is context
    there and never changes; the canvas ends on the first block boundary at or after
    prompt + gen_length, so gen_length need not be whole blocks; block_causal attention is
    cut on the same grid). Steps are then counted per block (block_steps). Default: from
    the model folder (request for llada2_moe folders)."""
    block_steps: int | None = Field(None, gt=0)
    """Denoising steps of each block (LLaDA2's `steps`), at most gen_length //
    minimal_topk; instead of `steps` over the whole answer. None = steps / the number of
    blocks (block_origin request: one token a step, block_length)."""
    minimal_topk: int = Field(1, ge=1)
    """LLaDA2: block_steps is capped at gen_length // minimal_topk."""


# pydantic takes the fields of the bases last to first, then the class's own: this order
# keeps SamplingConfig's fields in the order they had (the order of the command line's
# flags, the playground's options and a folder's generation_config.json)
class SamplingConfig(MaskedOptions, _BlockGridOptions, EntropyBoundOptions,
                     JointThresholdOptions, _SharedOptions):  # fmt: skip
    """How `sample` fills a masked canvas (docs/diffusion.md, Sampling).

    Each option is checked on its own here; whether the lengths fit together (blocks, steps
    per block) is checked by `check_lengths`, which `sample` calls, so callers may adjust
    lengths after reading a folder's defaults.
    """

    model_config = OPTION_SETTINGS

    ddpm_cache: bool = False
    """With `origin` remasking: reuse the last logits while no token changed (MDLM)."""
    gen_length_max: int | None = Field(None, gt=0)
    """gen_length auto: the most tokens a canvas may grow to (a multiple of block_length)."""
    auto_eos_threshold: float = Field(0.5, ge=0.0, le=1.0)
    """gen_length auto: the canvas stops growing once P(EOS) at its last position reaches
    this (0 = never grow, 1 = grow to the cap)."""
    growing_canvas: bool = False
    """Show the model only the prompt, finished blocks and the current block, so a long
    gen_length with EOS stopping costs only the blocks a row needs."""
    logits_hook: str | Callable[..., Any] | None = Field(None, exclude=True)
    """Dream's logits hook: f(step, x, logits) -> logits, called after every forward (a
    callable, or `module:function` on the command line; docs/sampling.md)."""
    tokens_hook: str | Callable[..., Any] | None = Field(None, exclude=True)
    """Dream's tokens hook: f(step, x, logits) -> x, called after every step's commits and
    once before the first as (None, x, None)."""
    history: bool = Field(False, exclude=True)
    """Keep the canvas after every step in GenerationOutput.history (Python API)."""

    def record(self) -> dict[str, Any]:
        """Every setting, the runtime ones too (hooks as their callables), for a results
        file: what changed the outputs, whether or not a folder may carry it."""
        return {**self.model_dump(), **{name: getattr(self, name) for name in RUNTIME_OPTIONS}}

    @field_validator("logits_hook", "tokens_hook", mode="before")
    @classmethod
    def _importable_hook(cls, value):
        return import_hook(value) if isinstance(value, str) else value

    @field_validator(*_CHOICES, *_DECODER_CHOICES, mode="before")
    @classmethod
    def _known_choice(cls, value, info):
        if value is None and info.field_name in _UNSET_CHOICES:  # the implied / default one
            return value
        choices = option_choices(info.field_name)
        if value not in choices:
            raise ValueError(
                f"unknown {info.field_name} {value!r}{did_you_mean(str(value), choices)}; "
                f"expected one of {list(choices)}"
            )
        return value

    @field_validator("gen_length")
    @classmethod
    def _positive_length(cls, value):
        if value != "auto" and value <= 0:
            raise ValueError(
                f"gen_length must be a positive number of tokens or 'auto' (got {value})"
            )
        return value

    @model_validator(mode="after")
    def _compatible_options(self) -> "SamplingConfig":
        if self.gen_length == "auto":
            check_auto_length(self)
        if self.threshold is not None and self.factor is not None:
            raise ValueError("give threshold or factor, not both")
        if self.remasking == "confidence_threshold" and self.threshold is None:
            raise ValueError("remasking='confidence_threshold' needs a threshold (Dream: 0.9)")
        if self.sub_block_length is not None and self.threshold is None and self.factor is None:
            raise ValueError("sub_block_length decodes with threshold or factor; give one")
        if self.confidence_eos_eot_inf and self.remasking in ("random", "origin"):
            raise ValueError(
                f"confidence_eos_eot_inf changes confidences; remasking={self.remasking!r} "
                "uses none (use low_confidence)"
            )
        if self.remasking == "origin" and (self.threshold is not None or self.factor is not None):
            raise ValueError("remasking='origin' reveals masks at random; it takes no threshold")
        if self.ddpm_cache and (self.remasking != "origin" or self.cache != "none"):
            raise ValueError("ddpm_cache needs remasking='origin' and cache='none'")
        decoder = implied(self)  # what the options are checked for: the decoder that runs
        kind = DECODERS[decoder]
        if self.uniform_canvas and not kind.uniform_canvas:
            raise ValueError(f"decoder {decoder!r} fills [MASK] tokens, and this model has none "
                             f"(uniform_canvas: its canvas starts as random tokens, as "
                             f"DiffusionGemma's); use decoder entropy_bound")  # fmt: skip
        for name in type(self).model_fields:
            owner = owner_of(name)
            if owner is not None and owner != decoder and given(self, name):
                raise ValueError(f"{name} is an option of decoder {owner} (the decoder here is "
                                 f"{decoder!r}); give decoder {owner}")  # fmt: skip
        if self.autoregressive and not kind.autoregressive:
            raise ValueError(f"an autoregressive model decodes left to right; decoder "
                             f"{decoder!r} decodes masks it never learned to fill")  # fmt: skip
        kind.check(self)
        check_own_options(self, decoder)
        check_block_origin(self, decoder)
        if self.block_causal and self.shift_logits and not kind.shifted_blocks:
            raise ValueError(
                "block_causal attention cannot use the logit shift (the first position of "
                "a block would be predicted from the block before, which cannot see it)"
            )
        return self

    @property
    def resolved_steps(self) -> int:
        """steps, or gen_length when None."""
        return self.steps or self.gen_length

    @property
    def resolved_block_length(self) -> int:
        """block_length, or gen_length when None."""
        return self.block_length or self.gen_length

    def steps_per_block(self) -> int:
        """The denoising steps of each block: block_steps (at most gen_length //
        minimal_topk, LLaDA2's cap), else with block_origin request one token a step
        (block_length), else steps / the number of blocks (lengths checked)."""
        if self.block_steps is not None:
            gen = self.gen_length if self.gen_length != "auto" else self.gen_length_max
            return max(1, min(self.block_steps, gen // self.minimal_topk))
        if self.block_origin == "request":
            return self.resolved_block_length
        return self.resolved_steps // self.check_lengths()

    def check_lengths(self) -> int:
        """The number of blocks; ValueError when the lengths do not split into blocks
        (gen_length auto: the cap's blocks, checked on validation). With block_origin
        request any gen_length fits: the answer's blocks, at most this many, depend on the
        prompt's length."""
        if self.gen_length == "auto":
            return self.gen_length_max // self.block_length
        if self.block_origin == "request" or self.block_steps is not None:
            block = self.resolved_block_length
            if self.block_origin == "answer" and self.gen_length % block:
                raise ValueError(f"gen_length ({self.gen_length}) must be a multiple of "
                                 f"block_length ({block})")  # fmt: skip
            sub = self.sub_block_length
            if sub is not None and block % sub != 0:
                raise ValueError(f"block_length ({block}) must be a multiple of "
                                 f"sub_block_length ({sub})")  # fmt: skip
            tail = block - 1 if self.block_origin == "request" else 0  # a prompt's tail
            return -(-(self.gen_length + tail) // block)
        steps, gen, block = self.resolved_steps, self.gen_length, self.resolved_block_length
        if gen % block != 0:
            raise ValueError(f"gen_length ({gen}) must be a multiple of block_length ({block})")
        num_blocks = gen // block
        if steps % num_blocks != 0:
            raise ValueError(
                f"steps ({steps}) must be a multiple of the number of blocks "
                f"gen_length / block_length = {num_blocks}"
            )
        sub = self.sub_block_length
        if sub is not None and block % sub != 0:
            raise ValueError(f"block_length ({block}) must be a multiple of sub_block_length "
                             f"({sub})")  # fmt: skip
        return num_blocks

    def fitted(self, prompt_len: int) -> "SamplingConfig":
        """The config for a prompt of prompt_len tokens: unchanged without row_length, else
        gen_length = row_length - prompt_len (rounded up to whole blocks for block-causal
        models), one block unless block_length divides it, steps = one token per step
        unless given (then a multiple of the blocks)."""
        if self.row_length is None or self.gen_length == "auto":
            return self
        gen = self.row_length - prompt_len
        if gen <= 0:
            raise InputError(
                f"a prompt of {prompt_len} tokens leaves no room for an answer in the "
                f"{self.row_length}-token rows the model was trained on; give --gen-length N"
            )
        if not decoder_class(self).block_layout:  # whole canvases, no blocks or step budget
            return self.updated(gen_length=gen, row_length=None)
        if self.block_origin == "request" or self.block_steps is not None:
            return self.updated(gen_length=gen, row_length=None)  # any length; per-block steps
        block = self.block_length
        if self.block_causal:  # the block size it trained with; whole blocks only
            gen = -(-gen // block) * block
        elif not block or gen % block:
            block = gen
        blocks = gen // block
        steps = gen if self.steps is None else max(blocks, round(self.steps / blocks) * blocks)
        return self.updated(gen_length=gen, block_length=block, steps=steps, row_length=None)

    def updated(self, **options: Any) -> "SamplingConfig":
        """A validated copy with every option that is not None replaced (row_length=None
        is kept as given: the copy no longer fits its canvas)."""
        fields = without_none(options)
        if "row_length" in options:
            fields["row_length"] = options["row_length"]
        runtime = {name: getattr(self, name) for name in RUNTIME_OPTIONS}
        return self.model_validate({**self.model_dump(), **runtime, **fields})


def option_choices(name: str) -> tuple[str, ...] | None:
    """The names option `name` accepts now (remasking: with the registered scores), or None
    for an option that is not a choice of names."""
    choices = _CHOICES.get(name)
    return decoder_choices(name) if choices is None else tuple(choices())


def check_auto_length(config: SamplingConfig) -> None:
    """gen_length auto needs a cap (gen_length_max) of whole blocks, at least one."""
    block, cap = config.block_length, config.gen_length_max
    if block is None or cap is None:
        raise ValueError(
            "gen_length auto needs block_length (the growth step) and gen_length_max (the cap)"
        )
    if cap < block:
        raise ValueError(
            f"gen_length_max ({cap}) is smaller than one block (block_length {block}); "
            f"raise gen_length_max to at least {block}"
        )
    if cap % block:
        raise ValueError(f"gen_length_max ({cap}) must be a multiple of block_length ({block})")


def check_block_origin(config: SamplingConfig, decoder: str) -> None:
    """block_origin and block_steps: options of the block decoders (`BlockDecoder`); the
    request origin counts steps per block."""
    by_block = issubclass(decoder_class(config), BlockDecoder)
    given = {"block_origin": config.block_origin != "answer",
             "block_steps": config.block_steps is not None}  # fmt: skip
    for name, value in given.items():
        if value and not by_block:
            raise ValueError(f"{name} is an option of the block decoders (masked, "
                             f"joint_threshold); decoder {decoder!r} does not decode by "
                             f"blocks")  # fmt: skip
    if config.block_origin == "request":
        if config.gen_length == "auto":
            raise ValueError("block_origin request needs a gen_length N (its canvas ends on "
                             "the block boundary after prompt + gen_length)")  # fmt: skip
        if config.steps is not None:
            raise ValueError("with block_origin request steps are counted per block: give "
                             "block_steps instead of steps")  # fmt: skip
        if config.shift_logits:
            raise ValueError("block_origin request has no logit shift (a first block at the "
                             "request's first token has no position before it); a Dream "
                             "model decodes with block_origin answer")  # fmt: skip
    if config.block_steps is not None and config.steps is not None:
        raise ValueError("give steps (over the whole answer) or block_steps (per block), not "
                         "both")  # fmt: skip


def without_none(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if v is not None}


def resolve_sampling(*layers: dict[str, Any], strict: bool = False) -> SamplingConfig:
    """One SamplingConfig from layered settings (a folder's defaults, then a task's, then
    the user's); later layers win, None means "not set". Bad values: one-line InputError.
    strict: values of the type each field has, no coercion (the server's requests: "8" is
    not a number)."""
    folder = next((i for i, layer in enumerate(layers) if isinstance(layer, FolderSampling)),
                  None)  # fmt: skip
    if folder is not None:  # a family's default decoding: the largest part that fits
        given = {k for layer in layers[folder + 1 :] for k, v in layer.items() if v is not None}
        tiers = layers[folder].tiers(given)
        for tier in tiers[:-1]:  # a tier fits when its options and lengths do
            try:
                config = _resolve((*layers[:folder], tier, *layers[folder + 1 :]), strict)
                config.check_lengths()
                return config
            except (InputError, ValueError):
                continue
        layers = (*layers[:folder], tiers[-1], *layers[folder + 1 :])
    return _resolve(layers, strict)


def _resolve(layers, strict: bool) -> SamplingConfig:
    merged: dict[str, Any] = {}
    for layer in layers:
        layer = without_none(layer)
        if "gen_length" in layer:  # a length given later wins over fitting to the rows
            merged.pop("row_length", None)
        elif "row_length" in layer:
            merged.pop("gen_length", None)
        if "decoder" in layer and layer["decoder"] != merged.get("decoder"):
            # another decoder: the earlier layers' decoder_options were that decoder's own
            merged.pop("decoder_options", None)
        merged.update(layer)
    try:
        return SamplingConfig.model_validate(merged, strict=strict)
    except ValidationError as err:
        raise InputError(describe_validation_error(err, "sampling option", _hint)) from None


def _hint(loc: tuple[str, ...]) -> str:
    return did_you_mean(loc[-1], SamplingConfig.model_fields)


#: options of a family's default decoding that lay out the canvas; the others (thresholds,
#: rules, steps) are the decoder's, and are dropped first when the options given conflict
LAYOUT_OPTIONS = ("gen_length", "block_length", "block_origin", "block_causal")


class FolderSampling(dict):
    """A released folder's sampling options: its own (the dict), over its family's default
    decoding (`Family.decoding`, `defaults`). `resolve_sampling` takes the defaults where
    they fit the options given: all of them; else only the canvas layout
    (`LAYOUT_OPTIONS`), when the options given name another rule (a decoder, steps over
    the whole answer, factor, ...); else none."""

    def __init__(self, own: dict[str, Any], defaults: Mapping[str, Any]):
        super().__init__({**defaults, **own})
        self.own, self.defaults = dict(own), dict(defaults)

    def tiers(self, given: set[str]) -> list[dict[str, Any]]:
        """The layers to try, in order, for options `given` by the later layers."""
        rest = {k: v for k, v in self.defaults.items() if k not in given}
        layout = {k: v for k, v in rest.items() if k in LAYOUT_OPTIONS}
        return [{**rest, **self.own}, {**layout, **self.own}, dict(self.own)]
