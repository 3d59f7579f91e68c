"""The OpenAI-compatible HTTP app: `create_app(backend)`.

GET  /health                 200 {"status": "ok"}, 503 when the step loop has failed
GET  /v1/models              the one model served
POST /v1/completions         prompt: text or token ids; SSE with "stream": true
POST /v1/chat/completions    the chat template of `kvreuse.serve.protocol`
GET  /metrics                Prometheus text (own registry per app)
POST /reset_prefix_cache     200, or 409 while blocks are in use
GET  /kvreuse/geometry       the cache geometry as a TOML geometry file (for qualify)
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request as HttpRequest

from kvreuse.deployment import geometry_toml
from kvreuse.serve.backend import Backend
from kvreuse.serve.generate import Gen, check_model, prepare, run, submit
from kvreuse.serve.loop import Delta, EngineLoop
from kvreuse.serve.metrics import new_registry, take_snapshot
from kvreuse.serve.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    parse,
    render_chat,
)


def create_app(
    backend: Backend, *, max_pending: int = 256, force_include_usage: bool = False
) -> FastAPI:
    """`force_include_usage`: every stream ends with a usage chunk, even when the client did not
    ask for one with `stream_options.include_usage` (vLLM's --enable-force-include-usage)."""
    engine = EngineLoop(backend, max_pending)
    registry, collector = new_registry()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="kvreuse", lifespan=lifespan)
    app.state.engine, app.state.backend = engine, backend

    @app.exception_handler(ApiError)
    async def _api_error(_: HttpRequest, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            raise ApiError(503, engine.failure or "not running", type="service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {
            "id": backend.name,
            "object": "model",
            "created": 0,
            "owned_by": "kvreuse",
            "max_model_len": backend.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/kvreuse/geometry")
    async def geometry() -> PlainTextResponse:
        return PlainTextResponse(
            geometry_toml(backend.live_deployment()), media_type="application/toml"
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        snap = await engine.call(lambda b: take_snapshot(b, engine.stats))
        collector.set(snap)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset() -> JSONResponse:
        if not await engine.call(_reset):
            raise ApiError(
                409,
                "the prefix cache is in use (requests are running or waiting); "
                "retry when the server is idle",
                type="conflict",
                code="cache_in_use",
            )
        return JSONResponse({"status": "reset"})

    @app.post("/v1/completions")
    async def completions(http: HttpRequest) -> Response:
        req: CompletionRequest = parse(CompletionRequest, await _json(http))
        check_model(backend, req.model)
        prompt = _completion_prompt(backend, req.prompt)
        gen = prepare(backend, req, prompt, "cmpl", req.max_tokens)
        return await _respond(engine, backend, gen, req, http, False, force_include_usage)

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest) -> Response:
        req: ChatRequest = parse(ChatRequest, await _json(http))
        check_model(backend, req.model)
        prompt = backend.tokenizer.encode(render_chat(req.messages))
        limit = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
        gen = prepare(backend, req, prompt, "chatcmpl", limit)
        return await _respond(engine, backend, gen, req, http, True, force_include_usage)

    return app


def _reset(backend: Backend) -> bool:
    return not backend.scheduler.has_work() and backend.mgr.reset()


async def _json(http: HttpRequest) -> Any:
    try:
        return json.loads(await http.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


def _completion_prompt(backend: Backend, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError(
                400,
                "batched prompts are not supported; send one prompt per request",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return backend.tokenizer.encode(prompt)
    return list(prompt)


async def _respond(
    engine: EngineLoop,
    backend: Backend,
    gen: Gen,
    req: Any,
    http: HttpRequest,
    chat: bool,
    force_usage: bool,
) -> Response:
    out = submit(engine, gen)
    if req.stream:
        asked = req.stream_options is not None and req.stream_options.include_usage
        usage = force_usage or asked
        return StreamingResponse(
            _sse(engine, backend, gen, out, http, chat, req.return_token_ids, usage),
            media_type="text/event-stream",
        )
    async for _ in run(engine, backend, gen, out, http):
        pass
    if gen.finish_reason == "disconnect":
        return Response(status_code=499)
    head = _head(gen, backend, chat)
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": gen.finish_reason,
            "message": {"role": "assistant", "content": gen.text},
        }
    else:
        choice = {
            "index": 0,
            "text": gen.text,
            "logprobs": None,
            "finish_reason": gen.finish_reason,
        }
    if req.return_token_ids:
        choice["prompt_token_ids"], choice["token_ids"] = gen.prompt, gen.token_ids
    return JSONResponse({**head, "choices": [choice], "usage": gen.usage()})


def _head(gen: Gen, backend: Backend, chat: bool, chunk: bool = False) -> dict[str, Any]:
    kind = "chat.completion" if chat else "text_completion"
    return {
        "id": gen.rid,
        "object": kind + (".chunk" if chat and chunk else ""),
        "created": int(time.time()),
        "model": backend.name,
    }


def _chunk(
    head: dict[str, Any], chat: bool, text: str | None, reason: str | None, role: bool = False
) -> str:
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": reason,
        }
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
    return _event({**head, "choices": [choice], "usage": None})


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _sse(
    engine: EngineLoop,
    backend: Backend,
    gen: Gen,
    out: asyncio.Queue[Delta],
    http: HttpRequest,
    chat: bool,
    token_ids: bool,
    usage: bool,
) -> AsyncIterator[str]:
    head = _head(gen, backend, chat, chunk=True)
    try:
        if chat:
            yield _chunk(head, chat, None, None, role=True)
        async for text in run(engine, backend, gen, out, http):
            if text:
                yield _chunk(head, chat, text, None)
    except ApiError as exc:
        yield _event(exc.body())
        yield "data: [DONE]\n\n"
        return
    if gen.finish_reason == "disconnect":
        return
    final = json.loads(_chunk(head, chat, None, gen.finish_reason)[len("data: ") :])
    if token_ids:
        final["choices"][0]["prompt_token_ids"] = gen.prompt
        final["choices"][0]["token_ids"] = gen.token_ids
    yield _event(final)
    if usage:
        yield _event({**head, "choices": [], "usage": gen.usage()})
    yield "data: [DONE]\n\n"
