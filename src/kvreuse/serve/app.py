"""The OpenAI-compatible HTTP app: `create_app(backend)`.

GET  /health                 200 {"status": "ok"}; 503 when the step loop has failed or the
                             server is draining
GET  /v1/models              the one model served
POST /v1/completions         prompt: text or token ids; SSE with "stream": true
POST /v1/chat/completions    the chat template of `kvreuse.serve.protocol`
GET  /metrics                Prometheus text (own registry per app); only on `metrics_port`
                             when one is given
POST /reset_prefix_cache     200, or 409 while blocks are in use; needs the admin token when
                             one is configured (401 otherwise)
GET  /kvreuse/geometry       the cache geometry as a TOML geometry file (for qualify)
GET  /kvreuse/store          the store it shares with other servers: the Redis key of the
                             store's journal, its medium and every tier's, in order (a router
                             mirrors the store from the journal); 404 without one

Bodies are read up to `max_body_bytes` (413 beyond) and decoded, validated and tokenised in a
worker thread, so a large body does not stall the event loop (`/health` included).

With `kv_events` (a `kvreuse.events.Publisher`) the step loop publishes the cache's KV events
to it; the app closes it at shutdown, after the step loop has stopped. Every response then
names the stream's incarnation (`x-kvreuse-kv-events-instance`, and `kv_events_instance` in
/health), so a router can tell a restarted replica from the one whose stream it follows.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest

from kvreuse.deployment import geometry_toml
from kvreuse.serve import defaults
from kvreuse.serve.backend import Backend
from kvreuse.serve.body import DEFAULT_MAX_BODY_BYTES, Disconnected, decode_json, read_body
from kvreuse.serve.generate import Gen, check_model, check_prompt_length, prepare, run, submit
from kvreuse.serve.lifecycle import Lifecycle
from kvreuse.serve.loop import EngineLoop, EventSink, Unavailable
from kvreuse.serve.metrics import new_registry, take_snapshot
from kvreuse.serve.openapi import error_responses, install_openapi, request_body
from kvreuse.serve.ops import InstanceHeader, PortSplit, api_error, check_admin
from kvreuse.serve.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    http_error,
    parse,
    prompt_tokens,
    render_chat,
)
from kvreuse.serve.stream import GuardedStream, message, sse


def create_app(
    backend: Backend,
    *,
    max_pending: int = defaults.MAX_PENDING,
    force_include_usage: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    stream_stall_timeout: float = defaults.STREAM_STALL_S,
    admin_token: str | None = None,
    metrics_port: int | None = None,
    kv_events: EventSink | None = None,
) -> FastAPI:
    """`force_include_usage`: every stream ends with a usage chunk, even when the client did not
    ask for one with `stream_options.include_usage` (vLLM's --enable-force-include-usage).
    `metrics_port`: serve /metrics only on connections to that local port (and nothing else
    there but /health)."""
    engine = EngineLoop(backend, max_pending, kv_events)
    life = Lifecycle(engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            engine.stop(timeout=10.0)
            if kv_events is not None:  # after the loop: it sends what the last steps queued
                kv_events.close()
            backend.close()

    app = FastAPI(title="kvreuse", version="0.1.0", lifespan=lifespan)
    app.state.engine, app.state.backend, app.state.lifecycle = engine, backend, life
    app.state.kv_events = kv_events
    _install_errors(app)
    if metrics_port is not None:
        app.add_middleware(PortSplit, metrics_port=metrics_port)
    instance = getattr(kv_events, "instance_id", None)
    if instance is not None:
        app.add_middleware(InstanceHeader, instance=str(instance))
    _info_routes(app, engine, backend, life, instance)
    _admin_routes(app, engine, admin_token)
    opts = _GenOptions(max_body_bytes, force_include_usage, stream_stall_timeout)
    _generation_routes(app, engine, backend, life, opts)
    install_openapi(app, (CompletionRequest, ChatRequest))
    return app


@dataclass(frozen=True)
class _GenOptions:
    max_body_bytes: int
    force_include_usage: bool
    stream_stall_timeout: float


def _info_routes(
    app: FastAPI, engine: EngineLoop, backend: Backend, life: Lifecycle, instance: str | None
) -> None:
    @app.get("/health", responses=error_responses(503))
    async def health() -> JSONResponse:
        if not engine.alive:
            raise ApiError(503, engine.failure or "not running", type="service_unavailable")
        if life.draining:
            raise ApiError(503, "the server is shutting down", type="service_unavailable")
        body = (
            {"status": "ok"}
            if instance is None
            else {"status": "ok", "kv_events_instance": instance}
        )
        return JSONResponse(body)

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

    # read once: the tiers' specs never change, and the step loop owns the manager
    stack = backend.mgr.tiers
    store = {
        "journal": backend.store_journal,
        "medium": next((t.spec.medium for t in stack.tiers if t.shared), None),
        "media": [t.spec.medium for t in stack.tiers],
    }

    @app.get("/kvreuse/store", responses=error_responses(404))
    async def shared_store() -> JSONResponse:
        if store["journal"] is None:
            raise ApiError(404, "this server shares no store (kvreuse serve --store-shared)")
        return JSONResponse(store)


def _admin_routes(app: FastAPI, engine: EngineLoop, admin_token: str | None) -> None:
    registry, collector = new_registry()

    @app.get("/metrics", responses=error_responses(503))
    async def metrics() -> Response:
        snap = await engine.call(lambda b: take_snapshot(b, engine.stats))
        collector.set(snap)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache", responses=error_responses(401, 409, 503))
    async def reset(http: HttpRequest) -> JSONResponse:
        check_admin(admin_token, http)
        if not await engine.call(_reset):
            raise ApiError(
                409,
                "the prefix cache is in use (requests are running or waiting); "
                "retry when the server is idle",
                type="conflict",
                code="cache_in_use",
            )
        return JSONResponse({"status": "reset"})


def _generation_routes(
    app: FastAPI, engine: EngineLoop, backend: Backend, life: Lifecycle, opts: _GenOptions
) -> None:
    async def generate(http: HttpRequest, build: Callable[[bytes], tuple[Any, Gen]]) -> Response:
        try:
            raw = await read_body(http, opts.max_body_bytes)
        except Disconnected:
            return Response(status_code=499)
        req, gen = await asyncio.to_thread(build, raw)  # decoding and tokenising: off the loop
        life.enter(gen)
        try:
            return await _respond(engine, backend, gen, req, http, life, opts)
        except BaseException:
            life.leave(gen)
            raise

    body, errors = request_body(CompletionRequest), error_responses()

    @app.post("/v1/completions", openapi_extra=body, responses=errors)
    async def completions(http: HttpRequest) -> Response:
        return await generate(http, lambda raw: _build_completion(backend, raw))

    body = request_body(ChatRequest)

    @app.post("/v1/chat/completions", openapi_extra=body, responses=errors)
    async def chat(http: HttpRequest) -> Response:
        return await generate(http, lambda raw: _build_chat(backend, raw))


def _install_errors(app: FastAPI) -> None:
    app.exception_handler(ApiError)(api_error)

    @app.exception_handler(Unavailable)
    async def _unavailable(_: HttpRequest, exc: Unavailable) -> JSONResponse:
        err = ApiError(503, str(exc), type="service_unavailable")
        return JSONResponse(err.body(), status_code=503)

    app.exception_handler(HTTPException)(http_error)


def _reset(backend: Backend) -> bool:
    return not backend.scheduler.has_work() and backend.mgr.reset()


def _build_completion(backend: Backend, raw: bytes) -> tuple[CompletionRequest, Gen]:
    body = decode_json(raw)
    if isinstance(body, dict):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
            check_prompt_length(backend, len(prompt))  # before any per-token work
    req: CompletionRequest = parse(CompletionRequest, body)
    ids = prompt_tokens(req.prompt, backend.tokenizer)
    return req, prepare(backend, req, ids, "cmpl", req.max_tokens)


def _build_chat(backend: Backend, raw: bytes) -> tuple[ChatRequest, Gen]:
    req: ChatRequest = parse(ChatRequest, decode_json(raw))
    check_model(backend, req.model)
    prompt = backend.tokenizer.encode(render_chat(req.messages))
    limit = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    return req, prepare(backend, req, prompt, "chatcmpl", limit)


async def _respond(
    engine: EngineLoop,
    backend: Backend,
    gen: Gen,
    req: Any,
    http: HttpRequest,
    life: Lifecycle,
    opts: _GenOptions,
) -> Response:
    chat = isinstance(req, ChatRequest)
    out = submit(engine, gen)
    if req.stream:
        asked = req.stream_options is not None and req.stream_options.include_usage
        usage = opts.force_include_usage or asked
        events = sse(engine, backend, gen, out, http, chat, req.return_token_ids, usage)
        stall = opts.stream_stall_timeout
        # with a shared store, the response starts at the admission, naming its store view
        late = gen.headers if backend.store_turns is not None else None
        return GuardedStream(_leaving(events, life, gen), stall, gen.rid, late)
    try:
        async for _ in run(engine, backend, gen, out, http):
            pass
    finally:
        life.leave(gen)
    if gen.finish_reason == "disconnect":
        return Response(status_code=499)
    return JSONResponse(message(gen, backend, chat, req.return_token_ids), headers=gen.headers())


async def _leaving(events: AsyncIterator[str], life: Lifecycle, gen: Gen) -> AsyncIterator[str]:
    try:
        async for e in events:
            yield e
    finally:
        life.leave(gen)
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()
