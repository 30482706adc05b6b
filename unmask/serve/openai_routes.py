"""The OpenAI routes of `unmask serve` (POST /v1/completions, /v1/chat/completions, GET
/v1/models) and the playground's canvas stream (POST /v1/unmask/canvas): each request
becomes the engine's jobs (`Server.make_jobs`), answered in OpenAI's body or as server-sent
events. app.py's `build_app` mounts them.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from unmask.data.sft import split_chat
from unmask.errors import InputError
from unmask.sampling.show import EOS_GLYPH
from unmask.serve.engine import Job
from unmask.serve.protocol import (
    CanvasRequest,
    ChatRequest,
    CompletionRequest,
    RequestError,
    parse_request,
)


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _usage(done: list[dict]) -> dict[str, int]:
    """OpenAI's usage fields, and `edits`: the answer tokens the decoder replaced by others
    (joint_threshold's token edits; 0 for decoders that never edit)."""
    prompt = sum(d["prompt_tokens"] for d in done)
    completion = sum(d["tokens"] for d in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "edits": sum(d.get("edits", 0) for d in done)}  # fmt: skip


def _notices(jobs: list[Job]) -> dict[str, list[str]]:
    """{"notices": [...]}: what the request's options were taken as and warnings about them
    (each said once), beside OpenAI's fields; {} when there are none."""
    notices = list(dict.fromkeys(n for job in jobs for n in job.notices))
    return {"notices": notices} if notices else {}


def chat_prompt(tokenizer, messages) -> str:
    """The prompt of a conversation: the tokenizer's chat template with the generation
    prompt, or (no template, as the char tokenizer) the "role: content" lines unmask trains
    chat data with, ending in "assistant: " (data/sft.py)."""
    turns = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        return split_chat(tokenizer, [*turns, {"role": "assistant", "content": ""}])[0]
    except InputError as err:
        raise RequestError(400, str(err), param="messages") from None


def routes(server, route: Callable, read_json: Callable) -> list[Route]:
    """The OpenAI routes and the canvas stream for `server` (app.Server). `route` wraps a
    handler with the API key check and the error bodies (app.build_app); `read_json(request)`
    reads a body within the server's limits."""
    limits = server.limits

    async def completions(request: Request):
        req = parse_request(CompletionRequest, await read_json(request))
        server.check_model(req.model)
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if not prompts:
            raise RequestError(400, "prompt is an empty list", param="prompt")
        stops = req.stops(limits)
        jobs = await server.make_jobs(prompts, req, req.max_tokens, stops=stops)
        return await respond(request, req, jobs, chat=False)

    async def chat(request: Request):
        req = parse_request(ChatRequest, await read_json(request))
        server.check_model(req.model)
        stops = req.stops(limits)
        prompt = await asyncio.get_running_loop().run_in_executor(
            server.tokenizing, chat_prompt, server.sm.tokenizer, req.messages)  # fmt: skip
        max_tokens = req.max_completion_tokens or req.max_tokens
        urls = [url for message in req.messages for url in message.image_urls()]
        jobs = await server.make_jobs([prompt], req, max_tokens, stops=stops,
                                      image_urls=urls)  # fmt: skip
        return await respond(request, req, jobs, chat=True)

    async def respond(request: Request, req, jobs: list[Job], chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": server.model_name}  # fmt: skip
        queue = server.start(jobs)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(request, jobs, queue, head, chat, usage),
                                     media_type="text/event-stream")  # fmt: skip
        done: dict[int, dict] = {}
        async for index, event in server.events(request, jobs, queue):
            if event["type"] == "done":
                done[index] = event
        if len(done) < len(jobs):  # the client left
            return PlainTextResponse("", status_code=499)
        choices = []
        for index in range(len(jobs)):
            d = done[index]
            if chat:
                choices.append({"index": index, "finish_reason": d["finish_reason"],
                                "message": {"role": "assistant", "content": d["text"]}})  # fmt: skip
            else:
                choices.append({"index": index, "text": d["text"], "logprobs": None,
                                "finish_reason": d["finish_reason"]})  # fmt: skip
        return JSONResponse({**head, "choices": choices, "usage": _usage(list(done.values())),
                             **_notices(jobs)})  # fmt: skip

    async def stream(request, jobs, queue, head, chat, usage):
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {**head, "object": kind}

        def chunk(index: int, text: str | None, reason: str | None) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                return {"index": index, "delta": delta, "finish_reason": reason}
            return {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}

        if chat:  # the role first, as OpenAI sends it
            yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                        "content": ""}, "finish_reason": None}], **_notices(jobs)})  # fmt: skip
        elif _notices(jobs):  # the notices before the text
            yield _sse({**head, "choices": [], **_notices(jobs)})
        done = []
        try:
            async for index, event in server.events(request, jobs, queue):
                if event["type"] == "block":
                    yield _sse({**head, "choices": [chunk(index, event["text"], None)]})
                elif event["type"] == "done":
                    done.append(event)
                    yield _sse({**head, "choices": [chunk(index, None, event["finish_reason"])]})
        except RequestError as err:  # headers are sent: the error goes in the stream
            yield _sse(err.body())
        if usage and len(done) == len(jobs):
            yield _sse({**head, "choices": [], "usage": _usage(done)})
        yield "data: [DONE]\n\n"

    async def canvas(request: Request):
        """The playground: the answer canvas after every denoising step (null = a mask)."""
        req = parse_request(CanvasRequest, await read_json(request))
        (job,) = await server.make_jobs([req.prompt], req, req.max_tokens, trace=True,
                                        image_urls=req.image_urls or None)  # fmt: skip
        queue = server.start([job])
        sm = server.sm
        # a uniform-canvas model (DiffusionGemma) has no masks: every canvas position is a token
        mask_id = None if server.playground["uniform_canvas"] else sm.mask_id

        def token_text(token: int) -> str | None:
            if token == mask_id:
                return None
            if token == sm.eos_id:
                return EOS_GLYPH
            return sm.tokenizer.decode([token])

        async def steps():
            count = 0
            try:
                async for _, event in server.events(request, [job], queue):
                    if event["type"] == "step":
                        count += 1
                        frame = {"step": count,
                                 "canvas": [token_text(t) for t in event["canvas"]]}  # fmt: skip
                        if "proposed" in event:  # block decoding: each mask's proposal
                            frame["proposed"] = [None if t is None else token_text(t)
                                                 for t in event["proposed"]]  # fmt: skip
                            frame["probability"] = event["probability"]
                        elif "probability" in event:  # entropy_bound: each shown token's
                            frame["probability"] = event["probability"]
                        yield _sse(frame)
                    elif event["type"] == "done":
                        yield _sse({"done": True, "text": event["text"],
                                    "finish_reason": event["finish_reason"],
                                    "forwards": event["forwards"], "edits": event["edits"],
                                    **_notices([job])})  # fmt: skip
            except RequestError as err:
                yield _sse(err.body())

        return StreamingResponse(steps(), media_type="text/event-stream")

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": server.model_name, "object": "model", "created": server.created,
             "owned_by": "unmask"}]})  # fmt: skip

    return [
        Route("/v1/completions", route(completions), methods=["POST"]),
        Route("/v1/chat/completions", route(chat), methods=["POST"]),
        Route("/v1/models", route(models), methods=["GET"]),
        Route("/v1/unmask/canvas", route(canvas), methods=["POST"]),
    ]
