"""The OpenAI-style request bodies `unmask serve` accepts, their errors, and how a request
becomes a `SamplingConfig` (the same options `unmask generate` takes).

Unknown fields are refused (a misspelled option must not be silently ignored); unmask's own
sampler options go under `unmask` (the openai client's `extra_body={"unmask": {...}}`),
checked against SamplingConfig's fields. Options of a call that name code (the hooks) are
not accepted from a request, nor any path: the model is fixed when the server starts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from unmask.data.images import MAX_IMAGE_PIXELS
from unmask.errors import InputError, describe_validation_error, did_you_mean
from unmask.sampling.config import (
    RUNTIME_OPTIONS,
    SamplingConfig,
    option_choices,
    resolve_sampling,
)
from unmask.sampling.decoders import implied
from unmask.sampling.entropy_bound import ENTROPY_BOUND_DEFAULTS

#: SamplingConfig fields a request sets with OpenAI's names (max_tokens -> gen_length)
OPENAI_NAMED = ("gen_length", "temperature", "top_p", "top_k")
#: SamplingConfig fields a request may set under "unmask"
UNMASK_OPTIONS = tuple(
    name
    for name in SamplingConfig.model_fields
    if name not in RUNTIME_OPTIONS and name not in OPENAI_NAMED
)


#: a seed is a 64-bit signed integer (torch.Generator.manual_seed's range)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
#: OpenAI's bound on stop strings per request
MAX_STOPS = 4


@dataclass(frozen=True)
class Limits:
    """The most work one request may ask for (server flags; docs/serving.md, Security).
    A request over any is refused with 400 before it is tokenized or queued."""

    max_tokens: int = 4096
    """Answer tokens of one prompt: the canvas (max_tokens, gen_length, gen_length_max)."""
    max_steps: int = 4096
    """Denoising steps of one prompt (`unmask.steps`; decoder entropy_bound: of one canvas,
    `unmask.max_denoising_steps`)."""
    max_prompts: int = 32
    """Prompts in one completions request (a list prompt)."""
    max_stop_chars: int = 256
    """Characters of one stop string (at most MAX_STOPS strings, as OpenAI's API)."""
    max_body_bytes: int = 4 * 2**20
    """Bytes of one request body."""
    body_seconds: float = 30.0
    """Seconds a client may take to send a request's body."""
    max_image_bytes: int = 3 * 2**20
    """Bytes of one picture (an image_url part; as base64 data it fits the default body)."""
    max_image_pixels: int = MAX_IMAGE_PIXELS
    """Pixels (width x height) of one picture, read from its header before it is decoded."""
    max_images: int = 8
    """Pictures in one request (image_url parts of all its messages; the page's image_urls)."""
    remote_images: bool = False
    """Fetch http(s) image_url parts (off: data: URLs only)."""


class RequestError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind, self.headers = kind, headers or {}

    def body(self) -> dict[str, Any]:
        """{"error": {message, type, param, code}}, the shape the openai client parses."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}  # fmt: skip


class _Strict(BaseModel):
    """Types as OpenAI's API has them: no coercion ("8" is not a number, 1 is not true), no
    unknown fields, no NaN or infinity."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    """A last chunk with no choices and the usage of the request."""


class _Sampling(_Strict):
    """Fields completions and chat completions share."""

    model: str
    max_tokens: int | None = Field(None, gt=0)
    """Answer tokens (the canvas); None = the model folder's default (its
    generation_config.json: a fixed length, row_length or auto)."""
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    user: str | None = None
    unmask: dict[str, Any] | None = None
    """unmask's sampler options by SamplingConfig name: steps, block_length, threshold,
    cache, remasking, ..."""

    def stops(self, limits: Limits) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise RequestError(400, f"stop takes up to {MAX_STOPS} non-empty strings",
                               param="stop")  # fmt: skip
        if any(len(s) > limits.max_stop_chars for s in stops):
            raise RequestError(400, f"a stop string is longer than this server's "
                               f"{limits.max_stop_chars} characters (--max-stop-chars)",
                               param="stop")  # fmt: skip
        return tuple(stops)


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    """One prompt, or several (one choice each)."""


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    def text(self) -> str:
        """The message's text (content parts of type text joined; image_url parts are
        `image_urls`; others refused)."""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") == "image_url":
                continue
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, "only text and image_url content parts are supported",
                                   param="messages")  # fmt: skip
            parts.append(part["text"])
        return "".join(parts)

    def image_urls(self) -> list[str]:
        """The urls of its image_url content parts, in order."""
        if isinstance(self.content, str):
            return []
        urls = []
        for part in self.content:
            if part.get("type") == "image_url":
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, dict) else None
                if not isinstance(url, str):
                    raise RequestError(400, 'an image_url part needs {"image_url": {"url": '
                                       '"data:image/png;base64,..."}}', param="messages")  # fmt: skip
                urls.append(url)
        return urls


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)


class CanvasRequest(_Strict):
    """The page's playground: one prompt, every denoising step streamed. image_urls: its
    pictures (data: URLs, as a chat message's image_url parts give them; their tokens go
    before the prompt's)."""

    prompt: str
    image_urls: list[str] | None = None
    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    unmask: dict[str, Any] | None = None


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON (send a number, or null)")


def parse_json(body: bytes) -> Any:
    """The request body as JSON, strictly: UTF-8, no NaN / Infinity, no lone surrogate in a
    string (a tokenizer cannot take one), nesting within what Python's parser recurses
    through. RequestError 400 otherwise."""
    try:
        value = json.loads(body, parse_constant=_refuse_constant)
    except RecursionError:
        raise RequestError(400, "the request body is nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as err:
        raise RequestError(400, f"the request body is not valid JSON ({err})") from None
    _check_strings(value)
    return value


def _check_strings(value: Any) -> None:
    """RequestError 400 on a string (or key) that is not valid Unicode text (a lone UTF-16
    surrogate such as "\\ud800"). Iterative: parse_json bounded the depth already."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            items = (item,)
        elif isinstance(item, dict):
            items = tuple(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
            continue
        else:
            continue
        for text in items:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(400, "a string in the request holds a lone UTF-16 "
                                   "surrogate (\\ud800-\\udfff without its pair); send valid "
                                   "Unicode text") from None  # fmt: skip


def finite_json(value: Any) -> Any:
    """value with every NaN or infinite float replaced by None (JSON has no NaN: a diverged
    run's loss is served as null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value


def parse_request(kind: type[_Strict], body: Any) -> _Strict:
    """The validated request; RequestError 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    try:
        return kind.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        hint = lambda loc: did_you_mean(str(loc[-1]), kind.model_fields)  # noqa: E731
        message = describe_validation_error(err, "field", hint)
        raise RequestError(400, message, param=param) from None


def sampling_config(request, saved: dict[str, Any], max_tokens: int | None,
                    uniform_canvas: bool = False) -> tuple[SamplingConfig, list[str]]:  # fmt: skip
    """The request's SamplingConfig: the model folder's options, then the request's (its
    "unmask" options, then the OpenAI-named ones), later ones winning, as `unmask generate`
    merges a folder's options with its flags; the request's values strictly typed. OpenAI's
    temperature / top_p / top_k reach a decoder with a notion of its own through
    `OPENAI_MAPPINGS` (never a 400: generic clients send them on every request), with the
    notices saying what was done. uniform_canvas: the model is one (DiffusionGemma), so the
    implied decoder is entropy_bound. RequestError 400 on a bad option."""
    options = dict(request.unmask or {})
    for key in options:
        if key not in UNMASK_OPTIONS:
            if key in RUNTIME_OPTIONS:
                why = "is not accepted from a request (it names code to run)"
            elif key in OPENAI_NAMED:
                why = "is a top-level field (gen_length: max_tokens)"
            else:
                why = "is not a sampling option" + did_you_mean(key, UNMASK_OPTIONS)
            raise RequestError(400, f"unmask.{key} {why}", param=f"unmask.{key}")
    named = {"gen_length": max_tokens, "temperature": request.temperature,
             "top_p": getattr(request, "top_p", None), "top_k": getattr(request, "top_k", None)}  # fmt: skip
    notices: list[str] = []
    try:
        decoder = implied(resolve_sampling(saved, options, {"uniform_canvas": uniform_canvas
                                                            or None}, strict=True))  # fmt: skip
    except InputError:
        decoder = None  # the full resolve below names the problem
    if decoder in OPENAI_MAPPINGS:
        named, notices = OPENAI_MAPPINGS[decoder](named, options, saved)
    try:
        return resolve_sampling(saved, options, named, strict=True), notices
    except InputError as err:
        raise RequestError(400, str(err), param="unmask") from None


def entropy_bound_named(named: dict[str, Any], options: dict[str, Any],
                        saved: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:  # fmt: skip
    """OpenAI's sampling fields for decoder entropy_bound (DiffusionGemma), which has no
    single temperature and samples the whole distribution: a temperature T > 0 scales its
    schedule (temperature_start and temperature_end, the request's or the folder's, else
    transformers' 0.8 -> 0.4: T = 1 keeps it); T = 0 asks for greedy answers, which it
    cannot give (every step draws), so the schedule stays; top_p and top_k are left out.
    Each is said in a notice."""
    named = dict(named)
    notices = []
    temperature = named.pop("temperature", None)
    if temperature is not None:
        given = [k for k in ("temperature_start", "temperature_end") if options.get(k) is not None]
        start, end = (next(v for v in (options.get(k), saved.get(k), ENTROPY_BOUND_DEFAULTS[k])
                           if v is not None) for k in ("temperature_start", "temperature_end"))  # fmt: skip
        if given:
            notices.append(f"temperature {temperature:g} ignored: unmask.{given[0]} sets "
                           "decoder entropy_bound's temperature schedule")  # fmt: skip
        elif temperature == 0:
            notices.append(f"temperature 0 ignored: decoder entropy_bound samples at every "
                           f"step (no greedy answer); its schedule {start:g} -> {end:g} is kept "
                           "(give a seed for repeatable answers)")  # fmt: skip
        else:
            named["temperature_start"] = start * temperature
            named["temperature_end"] = end * temperature
            notices.append(f"temperature {temperature:g} mapped onto decoder entropy_bound's "
                           f"schedule: temperature_start {start * temperature:g}, "
                           f"temperature_end {end * temperature:g} (x{temperature:g})")  # fmt: skip
    for key in ("top_p", "top_k"):
        if named.pop(key, None) is not None:
            notices.append(f"{key} ignored: decoder entropy_bound samples the whole tempered "
                           "distribution, as transformers does")  # fmt: skip
    return named, notices


#: decoders whose own notion of temperature / top_p replaces OpenAI's: (named, options,
#: saved) -> (the named options to apply, notices)
OPENAI_MAPPINGS = {"entropy_bound": entropy_bound_named}


def sampling_options(saved: dict[str, Any]) -> list[dict[str, Any]]:
    """What the playground offers: every sampling option a request takes (the OpenAI-named
    ones, then unmask's, in SamplingConfig's order; `unmask generate`'s flags less the
    hooks), each with its kind (int, float, bool, choice, int_or_auto), its choices, the
    value this model folder uses (its generation_config.json, else the built-in default) and
    the first sentence of its description."""
    out = []
    for name, field in SamplingConfig.model_fields.items():
        if name in RUNTIME_OPTIONS or name == "decoder_options":  # a plug-in decoder's own
            continue  # options: a request gives them by name, the page has no form for them
        choices = option_choices(name)
        annotation = str(field.annotation)
        if name == "gen_length":  # max_tokens: a count ("auto" only from the folder)
            kind = "int"
        elif choices:
            kind = "choice"
        elif "Literal" in annotation:  # a number or a word: gen_length int | "auto"
            kind = "int_or_auto"
        elif "bool" in annotation:
            kind = "bool"
        elif "float" in annotation:
            kind = "float"
        else:
            kind = "int"
        value = saved.get(name, field.get_default())
        out.append({"name": "max_tokens" if name == "gen_length" else name,
                    "group": "openai" if name in OPENAI_NAMED else "unmask",
                    "kind": kind, "choices": list(choices or ()),
                    "value": value, "doc": (field.description or "").split(". ")[0]})  # fmt: skip
    return out


def check_lengths(config: SamplingConfig, limits: Limits) -> SamplingConfig:
    """config, its lengths checked (blocks, steps per block) and within the server's limits
    (canvas, steps); RequestError 400 otherwise."""
    canvas = config.gen_length_max if config.gen_length == "auto" else config.gen_length
    if canvas > limits.max_tokens:
        raise RequestError(400, f"the answer canvas ({canvas} tokens) is over this server's "
                           f"{limits.max_tokens} (--max-tokens)", param="max_tokens",
                           code="context_length_exceeded")  # fmt: skip
    steps = config.steps or canvas
    if steps > limits.max_steps:
        raise RequestError(400, f"unmask.steps ({steps}) is over this server's "
                           f"{limits.max_steps} (--max-steps)", param="unmask.steps")  # fmt: skip
    canvas_steps = config.max_denoising_steps or 0  # entropy_bound: the steps of one canvas
    if canvas_steps > limits.max_steps:
        raise RequestError(400, f"unmask.max_denoising_steps ({canvas_steps}) is over this "
                           f"server's {limits.max_steps} (--max-steps)",
                           param="unmask.max_denoising_steps")  # fmt: skip
    try:
        config.check_lengths()
    except ValueError as err:
        raise RequestError(400, str(err), param="unmask") from None
    return config
