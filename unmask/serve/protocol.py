"""The OpenAI-style request bodies `unmask serve` accepts, their errors, and how a request
becomes a `SamplingConfig` (the same options `unmask generate` takes).

Unknown fields are refused (a misspelled option must not be silently ignored); unmask's own
sampler options go under `unmask` (the openai client's `extra_body={"unmask": {...}}`),
checked against SamplingConfig's fields. Options of a call that name code (the hooks) are
not accepted from a request, nor any path: the model is fixed when the server starts.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from unmask.errors import InputError, describe_validation_error, did_you_mean
from unmask.sampling.config import RUNTIME_OPTIONS, SamplingConfig, resolve_sampling

#: SamplingConfig fields a request sets with OpenAI's names (max_tokens -> gen_length)
OPENAI_NAMED = ("gen_length", "temperature", "top_p", "top_k")
#: SamplingConfig fields a request may set under "unmask"
UNMASK_OPTIONS = tuple(
    name
    for name in SamplingConfig.model_fields
    if name not in RUNTIME_OPTIONS and name not in OPENAI_NAMED
)


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
    model_config = ConfigDict(extra="forbid")


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
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    user: str | None = None
    unmask: dict[str, Any] | None = None
    """unmask's sampler options by SamplingConfig name: steps, block_length, threshold,
    cache, remasking, ..."""

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise RequestError(400, "stop takes up to 4 non-empty strings", param="stop")
        return tuple(stops)


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    """One prompt, or several (one choice each)."""


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    def text(self) -> str:
        """The message's text (content parts of type text joined; others refused)."""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, "only text content parts are supported",
                                   param="messages")  # fmt: skip
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)


class CanvasRequest(_Strict):
    """The page's playground: one prompt, every denoising step streamed."""

    prompt: str
    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    seed: int | None = None
    unmask: dict[str, Any] | None = None


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


def sampling_config(request, saved: dict[str, Any], max_tokens: int | None) -> SamplingConfig:
    """The request's SamplingConfig: the model folder's options, then the request's (its
    "unmask" options, then the OpenAI-named ones), later ones winning, as `unmask generate`
    merges a folder's options with its flags. RequestError 400 on a bad option."""
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
    try:
        return resolve_sampling(saved, options, named)
    except InputError as err:
        raise RequestError(400, str(err), param="unmask") from None


def check_lengths(config: SamplingConfig) -> SamplingConfig:
    """config, its lengths checked (blocks, steps per block); RequestError 400 otherwise."""
    try:
        config.check_lengths()
    except ValueError as err:
        raise RequestError(400, str(err), param="unmask") from None
    return config
