"""The OpenAI-compatible routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``.

They sit on the same service as the task routes: the same key, body limit, admission limit, engine loop,
prefix pool and metrics. A request is parsed here (a 400 in OpenAI's error shape naming the field),
planned on a prep thread (:func:`~prefixcache.server.openai_plan.plan`), submitted to the engine thread, and
answered as one JSON body or, with ``stream: true``, as server-sent events in OpenAI's chunk format,
one event per piece of text as the model produces it.

Streaming holds back what could still change: the tail that might begin a stop string, and an
incomplete UTF-8 character, so the streamed pieces always add up to the final text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ..engine.detokenize import IncrementalText
from ..errors import PrefixCacheError, UnknownModelError
from ..model.context_window import context_limit
from .openai_plan import Plan, chat_response, completion_response, plan, response_id, usage_of
from .openai_schemas import (
    ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, ModelCard, ModelList, OpenAIError, parse_request,
)
from .admission import Hold
from .middleware import CLIENT, REQUEST_ID_VAR
from .openai_errors import OPENAI_PATHS, openai_error  # noqa: F401  (OPENAI_PATHS: app.py reads it here)
from .service import Service
from .http_errors import http_spelling, status_of

log = logging.getLogger(__name__)

STARTED = int(time.time())
_ERRORS = {code: {"model": OpenAIError} for code in (400, 401, 404, 413, 422, 429, 503)}
_EVENT = {"type": "object", "properties": {"data": {"type": "string", "description": "a chunk as JSON, or [DONE]"}}}
_STREAMED = _ERRORS | {200: {"content": {"text/event-stream": {"schema": _EVENT}},
                             "description": "JSON, or server-sent events with stream: true"}}


def add_openai_routes(app: FastAPI, service: Service) -> None:
    """Add the three routes to ``app``; they serve ``service.loaded`` under the name ``service.loaded.spec``."""
    model_name = service.loaded.spec

    @app.get("/v1/models", response_model=ModelList, tags=["openai"], responses=_ERRORS)
    async def models() -> ModelList:
        """The one model this server runs (OpenAI's model list)."""
        card = ModelCard(id=model_name, created=STARTED, max_model_len=context_limit(service.loaded.model))
        return ModelList(data=[card])

    @app.post("/v1/chat/completions", response_model=ChatCompletion, tags=["openai"], responses=_STREAMED,
              openapi_extra=_body(ChatCompletionRequest, model_name))
    async def chat_completions(request: Request):
        """OpenAI chat completions: generation, or ``guided_choice`` scored over the cached prompt.
        The prompt's leading messages are stored as a prefix for the next request that shares them."""
        return await _serve(service, model_name, ChatCompletionRequest, await request.body(), request.scope.get(CLIENT))

    @app.post("/v1/completions", response_model=Completion, tags=["openai"], responses=_STREAMED,
              openapi_extra=_body(CompletionRequest, model_name))
    async def completions(request: Request):
        """OpenAI text completions over a prompt string or token ids, with the same prefix reuse."""
        return await _serve(service, model_name, CompletionRequest, await request.body(), request.scope.get(CLIENT))


async def _serve(service: Service, model_name: str, kind, body: bytes, client: str | None):
    """Parse, plan, queue and answer one request; ``client`` (the auth middleware's caller) gets its share of the queue."""
    request = parse_request(kind, body)
    if request.model != model_name:
        raise UnknownModelError(f"model {request.model!r} is not served here; this server runs {model_name!r} (GET /v1/models)")
    planned = await service.on_prep_thread(lambda tokenizer: plan(service.openai, service.settings, tokenizer, request))
    chat = kind is ChatCompletionRequest
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        admission = service.engine.admit(1, client=client)
        hold = admission.__enter__()  # QueueFullError here is a 429 with Retry-After, before the stream's 200
        return _AdmittedStream(
            lambda: admission.__exit__(None, None, None),
            _stream(service, planned, model_name, chat, include_usage, client, hold),
            media_type="text/event-stream", headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )
    with service.engine.admit(1, client=client) as hold:
        result = (await service.engine.submit(planned.runner, [planned.item], client, hold)).results[0]
    build = chat_response if chat else completion_response
    if result.get("logprobs"):
        return await service.on_prep_thread(lambda tokenizer: build(result, model_name, tokenizer))
    return build(result, model_name, None)


async def _stream(service: Service, planned: Plan, model_name: str, chat: bool, include_usage: bool,
                  client: str | None, hold: Hold) -> AsyncIterator[str]:
    """Server-sent events: a first chunk (the assistant's role), text pieces as tokens arrive, the finish
    reason, the usage when asked, and ``[DONE]``. An error after the first byte becomes an error event; a full
    queue never does (the caller admits the request before the 200)."""
    chunk = _Chunks(response_id("chatcmpl" if chat else "cmpl"), model_name, chat)
    tokens: asyncio.Queue[int] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    planned.item.on_token = lambda token: loop.call_soon_threadsafe(tokens.put_nowait, token)
    text = _StreamText(service.stream_tokenizer, planned.stops)
    job = None
    try:  # admitted by the caller (_AdmittedStream gives the room back when the response ends)
        if chat:
            yield chunk.event(role="assistant", content="")
        job = asyncio.ensure_future(service.engine.submit(planned.runner, [planned.item], client, hold))
        while not job.done() or not tokens.empty():
            getter = asyncio.ensure_future(tokens.get())
            await asyncio.wait({getter, job}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            piece = text.add(getter.result())
            if piece:
                yield chunk.event(content=piece)
        result = job.result().results[0]
    except PrefixCacheError as exc:  # after the 200: an error event with the status the answer would have had
        yield f"data: {json.dumps(stream_error(service, exc))}\n\n"
        return
    finally:  # the client went away (the stream was cancelled): its sequence leaves the loop at the next step
        if job is not None and not job.done():
            job.cancel()
    rest = text.rest(result["text"])
    if rest:
        yield chunk.event(content=rest)
    yield chunk.event(finish=result["finish"])
    if include_usage:
        yield chunk.usage(usage_of(result).model_dump())
    yield "data: [DONE]\n\n"


def stream_error(service: Service, exc: PrefixCacheError) -> dict:
    """The error event of a stream that had begun: ``exc``'s own status (a 5xx logged with the request id and
    counted, as an answer's would be)."""
    status = status_of(exc)
    if status >= 500:
        log.error("request %s: its stream ended with %d: %s: %s", REQUEST_ID_VAR.get(), status, type(exc).__name__, exc)
        service.metrics.server_errors.labels("(stream)", str(status)).inc()
    return openai_error(exc.render(http_spelling), status, getattr(exc, "param", None))


class _AdmittedStream(StreamingResponse):
    """A stream whose request was admitted before its 200: ``release`` gives the room back when the response ends,
    however it ends (sent whole, failed, or the client gone, even before the first byte)."""

    def __init__(self, release, content, **kwargs):
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


class _Chunks:
    """OpenAI's streaming chunks of one response (``chat.completion.chunk`` or ``text_completion``)."""

    def __init__(self, id_: str, model: str, chat: bool):
        self.head = {"id": id_, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": model}
        self.chat = chat

    def event(self, content: str | None = None, role: str | None = None, finish: str | None = None) -> str:
        if self.chat:
            delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish}
        return f"data: {json.dumps(self.head | {'choices': [choice]})}\n\n"

    def usage(self, usage: dict) -> str:
        return f"data: {json.dumps(self.head | {'choices': [], 'usage': usage})}\n\n"


class _StreamText:
    """The text of the tokens so far, handed out in pieces that can no longer change."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1  # a stop string may still be forming there
        self.decoded = IncrementalText(tokenizer)  # O(new text) per token, not a decode of everything so far
        self.sent = ""

    def add(self, token: int) -> str:
        self.decoded.add(token)
        text = self.decoded.text
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        safe = text[: min(cuts)] if cuts else text[: len(text) - self.hold]
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        piece, self.sent = safe[len(self.sent):], safe
        return piece

    def rest(self, final: str) -> str:
        """What the final text adds to what was sent (nothing when a sent piece is not its prefix)."""
        return final[len(self.sent):] if final.startswith(self.sent) else ""


BODY_SCHEMAS: dict[str, dict] = {}
"""The request bodies' nested models, for the OpenAPI document's ``components.schemas`` (``app.py`` adds them)."""


def _body(kind, model_name: str) -> dict:
    """The request body's JSON Schema for the OpenAPI document, ``model`` limited to the one served (the
    routes read and check the body themselves)."""
    schema = kind.model_json_schema(ref_template="#/components/schemas/{model}")
    schema["properties"]["model"]["enum"] = [model_name]
    BODY_SCHEMAS.update(schema.pop("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
