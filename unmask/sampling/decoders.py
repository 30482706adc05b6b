"""Decoders: the named strategies a canvas is decoded with, one registry for `sample` (hence
`unmask generate`, `unmask eval` and the lm-eval adapter) and the server's engine.

`DECODERS` maps a name to a decoder class; `register_decoder` adds one from outside the
package; `SamplingConfig.decoder` names one (None: the one the options imply, `implied`).
Each decoder declares what it reads (`Decoder`): the options that are its own (every other
decoder refuses them when given), the names they take, the options it refuses, what kind of
model it decodes, its checks and how it fits a canvas; `SamplingConfig`'s validation, the
command line's choices and the playground read them from here. A built-in decoder's own
option fields (types, bounds, defaults, docstrings) are a `DecoderOptions` model in its
module, which `SamplingConfig` composes into flat fields (sampling/config.py); its
`options` are that model's field names. A decoder from another
package declares its own options as one pydantic model (`Decoder.options_model`), given as
`SamplingConfig.decoder_options` and checked for the decoder that runs (`check_own_options`,
one line naming it). Two kinds:

- `BlockDecoder`: the steps of one block of a canvas (`Canvas`, sampling/generate.py).
  `sample` makes one per block, left to right, and the server's engine makes one per block
  call, for rows at different blocks of different answers (continuous batching, prefix
  cache). A subclass implements `step`; `forward` gives the block's logits through the
  canvas's K/V cache, classifier-free guidance and the server's prefix cache, so a new
  decoder gets all three by calling it.
- `WholeDecoder`: decodes every answer of a batch in one call (`decode`); the server runs
  its requests one at a time.

Built in, each registered by its own module: `masked` (masked.py: the masked-diffusion
block decoder: LLaDA's, Dream's, Fast-dLLM's threshold / factor and v2's sub-blocks, MDLM's
`origin`, chosen by remasking, schedule, threshold, factor, sub_block_length),
`left_to_right` (autoregressive.py: an autoregressive model, one token per forward with a
KV cache), `blocks_from_start` (blocks_from_start.py: Fast-dLLM v2's form),
`joint_threshold` (editing.py: LLaDA2.1's token editing) and `entropy_bound`
(entropy_bound.py: DiffusionGemma's sampler). A model's canvas of random tokens (no [MASK]) is its family's shape's
(`ModelShape.canvas_decoder`, `uniform_canvas_model`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from unmask.errors import describe_validation_error, did_you_mean
from unmask.models.families import FAMILIES, family_for_hf_type

if TYPE_CHECKING:  # pragma: no cover
    from unmask.sampling.config import SamplingConfig
    from unmask.sampling.generate import Canvas, GenerationOutput

#: every decoder by name, the built-in ones first
DECODERS: dict[str, type[BlockDecoder] | type[WholeDecoder]] = {}


#: the settings of SamplingConfig and of each model it is composed of: unknown keys refused,
#: each attribute's docstring its description, numbers finite
OPTION_SETTINGS = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)


class DecoderOptions(BaseModel):
    """The base of a built-in decoder's options model (`MaskedOptions` in masked.py,
    `JointThresholdOptions` in editing.py, `EntropyBoundOptions` in entropy_bound.py): its
    fields, with their bounds, defaults and docstrings, are `SamplingConfig` fields
    (config.py composes the models), under SamplingConfig's settings (`OPTION_SETTINGS`)."""

    model_config = OPTION_SETTINGS


class Decoder:
    """What a decoder declares about the `SamplingConfig` it decodes with; the registry's
    readers (sampling/config.py's validation, `option_choices`, the playground) take it from
    here, so a decoder's options, checks, presets and fitting live with the decoder."""

    #: the options only this decoder reads: any other decoder refuses them when given
    #: (differing from the field's default), naming this one. A built-in decoder's are the
    #: fields of its options model (a `DecoderOptions` in its own module), which are
    #: SamplingConfig's fields
    options: tuple[str, ...] = ()
    #: the names each of its options that takes a name accepts (`option_choices`)
    choices: Mapping[str, tuple[str, ...]] = MappingProxyType({})
    #: options of the schema it refuses when given, each with why (the playground hides
    #: them; `check` raises)
    refuses: Mapping[str, str] = MappingProxyType({})
    #: decodes canvases that start as uniformly random tokens (no [MASK]): the only kind of
    #: decoder a uniform_canvas model takes
    uniform_canvas = False
    #: decodes an autoregressive model (left to right): the only kind such a model takes
    autoregressive = False
    #: takes block_causal attention with the logit shift (Fast-dLLM v2's form)
    shifted_blocks = False
    #: lays gen_length out in blocks with a step budget (`SamplingConfig.fitted` and the
    #: lm-eval adapter round a canvas to whole blocks); False: whole canvases on the
    #: decoder's own schedule, which takes gen_length alone
    block_layout = True
    #: whether the decoder replaces tokens it committed (counted in GenerationOutput.edits,
    #: shown by `--show`, the summary line and the served usage's `edits`)
    edits_tokens = False
    #: its own options as one pydantic model, for a decoder that is not unmask's (from
    #: another package): the fields with their docstrings and defaults, their checks and any
    #: presets in the model's validators. They are given as `SamplingConfig.decoder_options`
    #: (`unmask generate --decoder-option NAME=VALUE`, a mapping in YAML and in a folder's
    #: generation_config.json, a request's "unmask": {"decoder_options": {...}}), checked
    #: here for the decoder that runs (`check_own_options`) and read with `own_options`;
    #: None: it takes none
    options_model: type[BaseModel] | None = None
    #: `unmask serve` batches its rows continuously, canvas by canvas (serve/canvases.py):
    #: each turn denoises one canvas of every row with its `serve_canvas` (each row drawing
    #: from its own generator, reading only its own K/V); `register_decoder` refuses the flag
    #: on a decoder that does not define serve_canvas
    serves_by_canvas = False

    @classmethod
    def serve_canvas(cls, model, cache, positions: torch.Tensor,
                     generators: list[torch.Generator], config: SamplingConfig, out,
                     show: Callable | None = None,
                     probability: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """A `serves_by_canvas` decoder's per-canvas step for the rows of `cache` (the
        encoder's K/V of their prompts and earlier canvases) -> the canvas (R, C): positions
        (R, C) its RoPE positions; out counts nfe, steps and row_forwards; show(argmax)
        after every step; probability (R, C), when given, filled with each shown token's
        probability."""
        raise NotImplementedError(f"{cls.__name__} is not served by canvas")

    @classmethod
    def own_options(cls, config: SamplingConfig) -> BaseModel | None:
        """Its options model filled from config.decoder_options (the model's defaults where
        none is given; its presets applied by its validators); None without a model."""
        if cls.options_model is None:
            return None
        return cls.options_model.model_validate(config.decoder_options or {})

    @classmethod
    def check(cls, config: SamplingConfig) -> None:
        """ValueError (one line) when `config` asks what this decoder cannot do; its own
        options are checked here, the schema's single options by SamplingConfig."""

    @classmethod
    def edits(cls, config: SamplingConfig) -> bool:
        """Whether decoding with `config` can replace a committed token (edits_tokens,
        unless the options turn edits off)."""
        return cls.edits_tokens


class BlockDecoder(Decoder):
    """The steps of one block, positions [start, stop) of `canvas`: each `step` commits
    some of the block's masks in canvas.x; `max_steps` bounds the steps a block may take.

    config: the SamplingConfig; special: the token ids the EOS options act on
    (`special_ids`); steps_per_block: the block's share of config.steps."""

    def __init__(self, config: SamplingConfig, model: torch.nn.Module, canvas: Canvas,
                 start: int, stop: int, steps_per_block: int, mask_id: int,
                 special: dict[str, list[int]]):  # fmt: skip
        self.config, self.model, self.canvas = config, model, canvas
        self.start, self.stop, self.mask_id = start, stop, mask_id
        self.special = special
        self.steps_per_block = steps_per_block
        self.max_steps = stop - start
        #: the columns the model sees: the whole canvas, or with growing_canvas up to the
        #: block's end
        self.visible = stop if config.growing_canvas else canvas.x.shape[1]
        #: the server's cross-request cache (serve/engine.py): called for step 0 instead of
        #: the full forward, as first_forward(store, columns) -> (B, Lb, V) logits, it puts
        #: the K/V in the canvas's cache as the full forward would. None: the plain forward
        self.first_forward: Callable[[bool, slice], torch.Tensor] | None = None
        #: the server's playground: keep each step's proposals and their probabilities
        #: (`proposed`, `proposal_p`: (B, Lb), NaN probability where nothing was masked)
        self.trace = False
        self.proposed: torch.Tensor | None = None
        self.proposal_p: torch.Tensor | None = None

    def step(self, step: int, generator: torch.Generator | None, out: GenerationOutput) -> bool:
        """Commit this step's tokens in canvas.x (counting forwards in out.nfe and
        out.row_forwards, commits in out.decoded, steps in out.steps); False when the block
        is done (no step was taken)."""
        raise NotImplementedError

    def block_masks(self) -> torch.Tensor:
        """Bool (B, Lb): the block's positions still masked."""
        return self.canvas.x[:, self.start : self.stop] == self.mask_id

    def forward(self, step: int, first: int | None = None) -> torch.Tensor:
        """Logits (B, Lb, V) of the block's positions at this step: a full forward (which
        refreshes the cache) at the block start, every cache_refresh steps and without a
        cache; else only what the cache does not hold. Dream's logit shift applied.
        `first`: the logits of positions [first, block end) instead (first <= the block's
        start), whose K/V are then recomputed at every step, never read from the cache
        (joint_threshold's edit_scope all edits them)."""
        cfg, stop = self.config, self.stop
        start = self.start if first is None else first
        shift = 1 if cfg.shift_logits else 0
        refresh = step == 0 or (cfg.cache_refresh > 0 and step % cfg.cache_refresh == 0)
        if cfg.cache == "none" or refresh:
            lo, hi, store = 0, self.visible, cfg.cache != "none"
            if step == 0 and self.first_forward is not None:
                return self.first_forward(store, slice(start - shift, stop - shift))
        else:
            lo, hi, store = start - shift, (self.visible if cfg.cache == "prefix" else stop), False
        full = self.canvas.forward(self.model, lo, hi, store, self.visible)  # (B, hi - lo, V)
        # Dream shift: position i is predicted from hidden state i - 1 (start >= 1)
        return full[:, start - shift - lo : stop - shift - lo]


class WholeDecoder(Decoder):
    """Decodes every answer of a batch in one call."""

    def decode(self, model: torch.nn.Module, prompt_ids: torch.Tensor,
               prompt_valid: torch.Tensor, config: SamplingConfig, *, mask_id: int,
               eos_id: int | None, pad_id: int | None, eot_id: int | None,
               generator: torch.Generator | None,
               on_step: Callable[[torch.Tensor], None] | None) -> GenerationOutput:  # fmt: skip
        """The GenerationOutput `sample` returns: prompt_ids (B, P) left-padded,
        prompt_valid (B, P) bool True on real prompt tokens."""
        raise NotImplementedError


def register_decoder(name: str, decoder: type[BlockDecoder] | type[WholeDecoder]) -> None:
    """Add `decoder` (a BlockDecoder or WholeDecoder subclass) as `SamplingConfig.decoder`
    value `name` (a `--decoder` choice, an `"unmask": {"decoder": ...}` option of a served
    request). ValueError when the name is taken, the class is neither kind, or it declares
    `serves_by_canvas` without a `serve_canvas`."""
    if name in DECODERS:
        raise ValueError(f"decoder {name!r} is already registered")
    if not (isinstance(decoder, type) and issubclass(decoder, (BlockDecoder, WholeDecoder))):
        raise ValueError(f"decoder {name!r} must subclass BlockDecoder or WholeDecoder")
    if decoder.serves_by_canvas and decoder.serve_canvas.__func__ is Decoder.serve_canvas.__func__:
        raise ValueError(f"decoder {name!r} declares serves_by_canvas but no serve_canvas "
                         f"(its per-canvas step, which `unmask serve` runs)")  # fmt: skip
    DECODERS[name] = decoder


def decoder_names() -> tuple[str, ...]:
    return tuple(DECODERS)


def implied(config: SamplingConfig) -> str:
    """The decoder a config names, or the one its options imply: the first registered
    decoder of an autoregressive model (left_to_right) or of a uniform-canvas one
    (entropy_bound, DiffusionGemma) by their declarations, blocks_from_start for Fast-dLLM
    v2's form, else the first registered one (masked)."""
    if config.decoder is not None:
        return config.decoder
    if config.autoregressive:
        return next(name for name, kind in DECODERS.items() if kind.autoregressive)
    if config.uniform_canvas:
        return next(name for name, kind in DECODERS.items() if kind.uniform_canvas)
    return "blocks_from_start" if config.blocks_from_start else next(iter(DECODERS))


def uniform_canvas_model(model: torch.nn.Module) -> bool:
    """Whether `model` (or the wrapper that forwards its attributes) denoises canvases that
    start as random tokens with a prompt encoder (`encode` / `decode`): its family's shape
    says so (`ModelShape.canvas_decoder`: DiffusionGemma). Decoded by a uniform_canvas
    decoder (entropy_bound), never by a masked one."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    family = family or family_for_hf_type(model_type)
    return family is not None and family.shape.canvas_decoder


def owner_of(option: str) -> str | None:
    """The decoder whose own option `option` is (`Decoder.options`), or None."""
    return next((name for name, kind in DECODERS.items() if option in kind.options), None)


def decoder_choices(option: str) -> tuple[str, ...] | None:
    """The names a decoder's own option accepts (`Decoder.choices`), or None."""
    owner = owner_of(option)
    return None if owner is None else DECODERS[owner].choices.get(option)


def refused_options(decoder: str) -> set[str]:
    """The options `decoder` refuses when given: those it declares, and every other
    decoder's own."""
    others = {o for name, kind in DECODERS.items() if name != decoder for o in kind.options}
    return set(DECODERS[decoder].refuses) | others


def given(config: Any, option: str) -> bool:
    """Whether `config` sets `option` away from its field's default."""
    field = type(config).model_fields[option]
    return getattr(config, option) != field.get_default()


def check_own_options(config: SamplingConfig, decoder: str) -> None:
    """ValueError (one line naming the decoder) when config.decoder_options are not the
    options `decoder` declares (`Decoder.options_model`): given to a decoder without a model,
    a name the model has no field for, or a value its checks refuse."""
    given = config.decoder_options
    if given is None:
        return
    model = DECODERS[decoder].options_model
    if model is None:
        raise ValueError(f"decoder {decoder!r} declares no options of its own; drop "
                         f"decoder_options {sorted(given)}")  # fmt: skip
    for name in given:
        if name not in model.model_fields:
            raise ValueError(f"unknown option {name!r} of decoder {decoder!r}"
                             f"{did_you_mean(name, model.model_fields)}; its options: "
                             f"{', '.join(model.model_fields)}")  # fmt: skip
    try:
        model.model_validate(given)
    except ValidationError as err:
        raise ValueError(f"decoder {decoder!r}: "
                         f"{describe_validation_error(err, 'option')}") from None  # fmt: skip


def decoder_class(config: SamplingConfig) -> type[BlockDecoder] | type[WholeDecoder]:
    return DECODERS[implied(config)]


def edits_tokens(config: SamplingConfig) -> bool:
    """Whether the config's decoder replaces tokens it committed (joint_threshold)."""
    return decoder_class(config).edits_tokens


def decodes_by_block(config: SamplingConfig) -> bool:
    """Whether the config's decoder works block by block (the server batches those)."""
    return issubclass(decoder_class(config), BlockDecoder)


__all__ = [
    "DECODERS",
    "BlockDecoder",
    "Decoder",
    "DecoderOptions",
    "OPTION_SETTINGS",
    "WholeDecoder",
    "decoder_choices",
    "decoder_class",
    "decoder_names",
    "decodes_by_block",
    "edits_tokens",
    "given",
    "implied",
    "owner_of",
    "refused_options",
    "check_own_options",
    "register_decoder",
    "uniform_canvas_model",
]
