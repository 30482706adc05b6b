"""The HTTP side of `unmask serve`: a Starlette app with OpenAI's routes
(openai_routes.py), the metrics, the web page's data (page_routes.py) and the Train tab
(training.py), docs/serving.md. `Server` holds what the routes share.

Every request becomes one `Job` per prompt for the engine (engine.py); the handler waits
for the job's events on an asyncio queue the engine thread feeds. Errors are OpenAI's error
body with a 4xx status, so the openai client raises its typed errors; the server goes on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from unmask.errors import InputError
from unmask.models.diffusion_gemma_vision import require_vision
from unmask.sampling.decoders import uniform_canvas_model
from unmask.sampling.generate import special_ids, with_uniform_canvas
from unmask.sampling.images import (
    PromptImages,
    data_url_bytes,
    fetch_image_bytes,
    open_image,
    prompt_images,
    with_prefix,
)
from unmask.sampling.run_origin import editing_notice
from unmask.sampling.texts import SamplingModel
from unmask.serve import openai_routes, page_routes, presets, training
from unmask.serve.engine import Draining, Engine, Job, QueueFull
from unmask.serve.guard import Guard, error_body
from unmask.serve.openai_routes import chat_prompt as _chat_prompt  # noqa: F401  (its old name)
from unmask.serve.protocol import (
    Limits,
    RequestError,
    check_lengths,
    parse_json,
    sampling_config,
    sampling_options,
)

#: seconds a client is told to wait after a 429
RETRY_AFTER = 1


def takes_images(sm: SamplingModel) -> bool:
    """Whether the served model takes pictures: a vision tower and the folder's image
    processor (sampling/images.py)."""
    if sm.folder is None or not (Path(sm.folder) / "preprocessor_config.json").is_file():
        return False
    try:
        require_vision(sm.model)
    except InputError:
        return False
    return True


class Server:
    """What the routes share: the model, the engine, the served name and the options."""

    def __init__(self, sm: SamplingModel, engine: Engine, model_name: str,
                 api_key: str | None = None, runs_dir: Path | None = None,
                 limits: Limits | None = None, allowed_hosts: frozenset[str] | None = None,
                 cors_origins: frozenset[str] = frozenset(),
                 training: training.TrainQueue | None = None):  # fmt: skip
        self.sm, self.engine, self.model_name = sm, engine, model_name
        self.training = training  # --allow-train: the Train tab's queue (training.py)
        self.api_key, self.runs_dir = api_key, runs_dir
        self.limits = limits or Limits()
        self.allowed_hosts, self.cors_origins = allowed_hosts, cors_origins
        config = getattr(sm.model, "config", None)
        self.max_context = getattr(config, "max_position_embeddings", None)
        # no token is longer than the tokenizer's longest vocabulary entry, so a prompt of
        # more characters than that many times the context cannot fit: refused untokenized
        vocab = sm.tokenizer.get_vocab()
        self.longest_token = max(map(len, vocab), default=1) if vocab else 1
        # one thread tokenizes (off the event loop; a fast tokenizer is not shared between
        # threads that tokenize at once)
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="unmask-tokenize")
        self.created = int(time.time())
        self.sampling_options = sampling_options(sm.saved)  # the playground's form
        # the decoders, options and presets that apply to this model (presets.py)
        self.playground = presets.playground(
            sm.saved, getattr(config, "model_type", None), uniform_canvas_model(sm.model),
            [option["name"] for option in self.sampling_options])  # fmt: skip
        self.notices: list[str] = []  # warnings about the model (chat.py), for the page
        self.takes_images = takes_images(sm)  # the page offers a picture upload

    def picture_limits(self) -> dict[str, int] | None:
        """/api/info's `images`: the bytes one picture may have (the page refuses a bigger
        one before sending it), None when the model takes no pictures."""
        return {"max_bytes": self.limits.max_image_bytes} if self.takes_images else None

    # ------------------------------------------------------------------- request checks

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            raise RequestError(401, "missing or wrong API key; send Authorization: Bearer KEY",
                               kind="authentication_error", code="invalid_api_key")  # fmt: skip

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise RequestError(404, f"model {name!r} does not exist; this server serves "
                               f"{self.model_name!r}", param="model",
                               code="model_not_found")  # fmt: skip

    def make_job(self, text: str, request, max_tokens: int | None,
                 image_urls: list[str] | None = None, **extra) -> Job:  # fmt: skip
        """The Job of one prompt, its options checked (RequestError 400). Tokenizes: run it
        on `self.tokenizing` (`make_jobs`). image_urls: its pictures (data: URLs; their
        tokens go before the prompt's, as `unmask generate --image`)."""
        sm = self.sm
        pictures = self.pictures(image_urls) if image_urls else None
        config, notices = sampling_config(request, sm.saved, max_tokens,
                                          uniform_canvas_model(sm.model))  # fmt: skip
        try:
            if not config.uniform_canvas and uniform_canvas_model(sm.model):  # DiffusionGemma
                config = with_uniform_canvas(config)  # as `sample` decodes it
            special_ids(config, sm.eos_id, sm.pad_id, self.engine.eot_id)
        except InputError as err:
            raise RequestError(400, str(err), param="unmask") from None
        if self.max_context is not None and len(text) > self.max_context * self.longest_token:
            raise RequestError(
                400, f"the prompt ({len(text)} characters) cannot fit the model's "
                f"{self.max_context} positions", param="prompt",
                code="context_length_exceeded")  # fmt: skip
        ids = sm.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise RequestError(400, "the prompt is empty after tokenization", param="prompt")
        if pictures is not None:
            ids, extra["images"] = with_prefix(ids, pictures), pictures.images
        try:
            config = config.fitted(len(ids))
        except InputError as err:
            raise RequestError(400, str(err), param="max_tokens",
                               code="context_length_exceeded") from None  # fmt: skip
        config = check_lengths(config, self.limits)
        canvas = config.gen_length_max if config.gen_length == "auto" else config.gen_length
        if self.max_context is not None and len(ids) + canvas > self.max_context:
            raise RequestError(
                400, f"the prompt ({len(ids)} tokens) and the answer ({canvas}) exceed the "
                f"model's {self.max_context} positions; shorten the prompt or max_tokens",
                param="prompt", code="context_length_exceeded")  # fmt: skip
        edit_notice = editing_notice(config, sm.trained_edit_fraction)
        notices += [edit_notice] if edit_notice else []
        return Job(ids, config, emit=lambda event: None, seed=request.seed,
                   notices=tuple(notices), **extra)  # fmt: skip

    def pictures(self, urls: list[str]) -> PromptImages:
        """A request's pictures from data: URLs, or http(s) ones with --allow-remote-images
        (RequestError 400: more than `Limits.max_images`, a remote URL without it, one over
        `Limits.max_image_bytes` or `max_image_pixels`, bytes PIL cannot read, a model
        without a vision tower)."""
        if len(urls) > self.limits.max_images:
            raise RequestError(400, f"{len(urls)} pictures in one request are over this "
                               f"server's {self.limits.max_images} (--max-images)",
                               param="messages")  # fmt: skip
        opened = []
        cap = self.limits.max_image_bytes
        for number, url in enumerate(urls, 1):
            name = f"image_url {number}"
            try:
                remote = self.limits.remote_images and url.startswith(("http://", "https://"))
                data = (
                    fetch_image_bytes(url, name, cap) if remote else data_url_bytes(url, name, cap)
                )
                opened.append(open_image(data, name, self.limits.max_image_pixels))
            except InputError as err:
                raise RequestError(400, str(err), param="messages") from None
        try:
            return prompt_images(self.sm.model, self.sm.folder, opened)
        except InputError as err:
            raise RequestError(400, str(err), param="messages") from None

    async def make_jobs(self, texts: list[str], request, max_tokens: int | None,
                        **extra) -> list[Job]:  # fmt: skip
        """`make_job` of each prompt, on the tokenizing thread (a long prompt does not hold
        the event loop: other requests and /health go on)."""
        if len(texts) > self.limits.max_prompts:
            raise RequestError(400, f"{len(texts)} prompts in one request are over this "
                               f"server's {self.limits.max_prompts} (--max-prompts)",
                               param="prompt")  # fmt: skip
        if len(texts) > self.engine.max_batch + self.engine.max_queue:
            raise RequestError(400, f"{len(texts)} prompts can never fit this server's batch "
                               f"and queue ({self.engine.max_batch} + {self.engine.max_queue}); "
                               "send fewer at a time", param="prompt")  # fmt: skip
        loop = asyncio.get_running_loop()

        def make() -> list[Job]:
            return [self.make_job(text, request, max_tokens, **extra) for text in texts]

        return await loop.run_in_executor(self.tokenizing, make)

    # ------------------------------------------------------------------------- running

    def start(self, jobs: list[Job]) -> asyncio.Queue:
        """Submit the jobs; their events arrive on the returned queue as (index, event)."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def sink(index: int) -> Callable[[dict], None]:
            def emit(event: dict) -> None:
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))
                except RuntimeError:  # the loop is closed: nobody is listening any more
                    pass

            return emit

        for index, job in enumerate(jobs):
            job.emit = sink(index)
        for count, job in enumerate(jobs):
            try:
                self.engine.submit(job)
            except (QueueFull, Draining) as err:
                for earlier in jobs[:count]:
                    self.engine.cancel(earlier)
                if isinstance(err, Draining):
                    raise RequestError(503, "the server is shutting down", kind="server_error",
                                       code="shutting_down") from None  # fmt: skip
                raise RequestError(429, f"the queue is full ({err}); retry later",
                                   kind="rate_limit_error", code="queue_full",
                                   headers={"Retry-After": str(RETRY_AFTER)}) from None  # fmt: skip
        return events

    async def events(self, request: Request, jobs: list[Job], queue: asyncio.Queue
                     ) -> AsyncIterator[tuple[int, dict]]:  # fmt: skip
        """The jobs' events until each is done; a client gone cancels the jobs left."""
        left = set(range(len(jobs)))
        checked = time.monotonic()
        try:
            while left:
                try:
                    index, event = await asyncio.wait_for(queue.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    index, event = None, None
                if time.monotonic() - checked >= 0.25:  # events or not, now and then
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if event is None:
                    continue
                if event["type"] == "error":
                    raise RequestError(500, event["message"], kind="server_error")
                if event["type"] == "done":
                    left.discard(index)
                yield index, event
        finally:
            for index in left:
                self.engine.cancel(jobs[index])


async def _read_json(request: Request, limits: Limits) -> Any:
    """The body as JSON (`parse_json`), read within the size and time limits: a body over
    max_body_bytes is refused as soon as its Content-Length (or its bytes) say so."""
    too_big = RequestError(400, f"the request body is over this server's "
                           f"{limits.max_body_bytes} bytes (--max-body-mb)",
                           code="request_too_large", headers={"Connection": "close"})  # fmt: skip
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise RequestError(400, "the Content-Length header is not a number")
        if int(declared) > limits.max_body_bytes:
            raise too_big
    chunks: list[bytes] = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise too_big
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), limits.body_seconds)
    except asyncio.TimeoutError:
        raise RequestError(408, f"the request body did not arrive within "
                           f"{limits.body_seconds:g} s", code="request_timeout",
                           headers={"Connection": "close"}) from None  # fmt: skip
    body = b"".join(chunks)
    if len(body) > 2**16:  # parsing a long body takes a while: not on the event loop
        return await run_in_threadpool(parse_json, body)
    return parse_json(body)


def build_app(server: Server) -> Guard:
    """The ASGI app: OpenAI routes, /health, /metrics, the page and its data, behind the
    Host, Origin and Content-Type checks of guard.py."""

    def route(handler: Callable, open_route: bool = False):
        async def wrapped(request: Request):
            try:
                if not open_route:
                    server.authorize(request)
                return await handler(request)
            except RequestError as err:
                server.engine.stats.count(f"http_{err.status}")
                return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

        return wrapped

    limits = server.limits

    async def health(request: Request):
        if server.engine.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request):
        return PlainTextResponse(metrics_text(server.engine),
                                 media_type="text/plain; version=0.0.4")  # fmt: skip

    async def read_json(request: Request) -> Any:
        return await _read_json(request, limits)

    routes = [
        *openai_routes.routes(server, route, read_json),
        Route("/health", route(health, open_route=True), methods=["GET"]),
        Route("/metrics", route(metrics), methods=["GET"]),
        *page_routes.routes(server, route),
        *training.routes(server, route, read_json),
    ]

    async def http_error(request: Request, exc: HTTPException):
        """Starlette's own refusals (an unknown route, a wrong method) in OpenAI's body."""
        server.engine.stats.count(f"http_{exc.status_code}")
        if exc.status_code == 404:
            message = f"no route {request.url.path!r}; see docs/serving.md for the routes"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path!r}"
        else:
            message = str(exc.detail)
        return JSONResponse(error_body(message, code=f"http_{exc.status_code}"),
                            status_code=exc.status_code, headers=exc.headers)  # fmt: skip

    async def server_error(request: Request, exc: Exception):
        server.engine.stats.count("http_500")
        return JSONResponse(error_body(f"internal error ({type(exc).__name__}); the server "
                                       "goes on", kind="server_error"), status_code=500)  # fmt: skip

    app = Starlette(routes=routes,
                    exception_handlers={HTTPException: http_error, Exception: server_error})  # fmt: skip
    return Guard(app, server.allowed_hosts, server.cors_origins, server.engine.stats.count)


def metrics_text(engine: Engine) -> str:
    """Prometheus text exposition of the engine's counters."""
    s = engine.stats
    lines = []

    def metric(name: str, kind: str, help_text: str, values: dict[str, float] | float,
               key: str = "outcome"):  # fmt: skip
        lines.append(f"# HELP unmask_{name} {help_text}")
        lines.append(f"# TYPE unmask_{name} {kind}")
        if isinstance(values, dict):
            for label, value in sorted(values.items()):
                lines.append(f'unmask_{name}{{{key}="{label}"}} {value}')
        else:
            lines.append(f"unmask_{name} {values}")

    metric("requests_total", "counter", "Prompts by outcome (http_N: refused).", dict(s.requests))
    metric("queue_depth", "gauge", "Prompts waiting for a batch slot.", engine.queue_depth)
    metric("running_requests", "gauge", "Prompts in the running batch.", engine.running)
    metric("forward_passes_total", "counter", "Model forward calls.", s.forwards)
    metric("row_forwards_total", "counter", "Forward calls times rows in them.", s.row_forwards)
    metric("forwards_by_threads_total", "counter", "Forward calls by the torch threads they "
           "ran on (--threads, --one-thread-below).", dict(engine.model.calls), "threads")  # fmt: skip
    metric("positions_decoded_total", "counter", "Canvas positions committed.", s.decoded)
    metric("block_calls_total", "counter", "Blocks decoded (one call each).", s.blocks)
    metric("tokens_generated_total", "counter", "Answer tokens returned.", s.tokens)
    metric("tokens_per_forward", "gauge", "Positions committed per row per forward.",
           round(s.decoded / max(1, s.row_forwards), 4))  # fmt: skip
    metric("tokens_per_second", "gauge", "Answer tokens per second, last 10 s.",
           round(s.tokens_per_second(), 3))  # fmt: skip
    metric("busy_seconds_total", "counter", "Seconds the engine spent decoding.",
           round(s.busy_seconds, 3))  # fmt: skip
    cache = engine.prefix_cache
    metric("prefix_cache_hits_total", "counter", "First forwards of a prompt reused (from "
           "the cache or a row of the same call).", cache.hits if cache else 0)  # fmt: skip
    metric("prefix_cache_misses_total", "counter", "First forwards computed and cached.",
           cache.misses if cache else 0)  # fmt: skip
    metric("prefix_cache_evictions_total", "counter", "Entries dropped for the bound.",
           cache.evictions if cache else 0)  # fmt: skip
    metric("prefix_cache_entries", "gauge", "Entries held.", len(cache) if cache else 0)
    metric("prefix_cache_bytes", "gauge", "Bytes held.", cache.bytes if cache else 0)
    metric("prefix_cache_capacity_bytes", "gauge", "The bound (--prefix-cache-mb).",
           cache.max_bytes if cache else 0)  # fmt: skip
    metric("prefix_cache_saved_row_forwards_total", "counter", "Rows whose first forward "
           "was not computed.", s.saved_row_forwards)  # fmt: skip
    metric("prompts_encoded_total", "counter", "Prompts of canvas rows (DiffusionGemma) "
           "through the encoder: once each.", s.prompts_encoded)  # fmt: skip
    metric("pictures_encoded_total", "counter", "Their pictures through the vision tower.",
           s.pictures_encoded)  # fmt: skip
    return "\n".join(lines) + "\n"
