"""The fleet's OpenAI-compatible front: `create_front(dispatcher, tokenizer)`.

GET  /health                 200 while at least one replica is up; 503 otherwise
GET  /v1/models              the replicas' model
POST /v1/completions         routed, then forwarded (SSE relayed with "stream": true)
POST /v1/chat/completions    the same; tokenised with the replicas' chat template
GET  /metrics                per-replica routing counters (kvreuse.fleet.front_metrics); only
                             on `metrics_port` when one is given
GET  /fleet/replicas         each replica: url, up or down, load, event stream state; needs the
                             admin token when one is configured (401 otherwise)

A request is validated and tokenised exactly as a `kvreuse serve` replica does it (the same
request models and errors, the same chat template, the same tokenizer), so the front hashes the
very tokens the replica will look up. It is routed (`Dispatcher.route`), forwarded with httpx,
and answered as the replica answered, with two headers added: `x-kvreuse-replica` (where it
went) and `x-kvreuse-predicted-cached-tokens` (the policy's prediction, when it makes one).

Failures: a replica that cannot be reached is marked down and the request goes to another
(nothing was sent); a replica that fails once the request is sent fails only that request, with
an error in OpenAI's shape (502, or an error event in a stream). A health check every
`health_interval` seconds takes replicas out of rotation and back in.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest

from kvreuse.fleet.dispatch import Dispatcher, Member, NoReplica, Routed
from kvreuse.fleet.forward import Delivery, Unreachable, open_upstream, read_answer, relay_stream
from kvreuse.fleet.front_metrics import FrontMetrics
from kvreuse.serve.body import DEFAULT_MAX_BODY_BYTES, Disconnected, decode_json, read_body
from kvreuse.serve.ops import PortSplit, api_error, check_admin
from kvreuse.serve.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    http_error,
    parse,
    prompt_tokens,
    render_chat,
)
from kvreuse.tokenizer import Tokenizer

log = logging.getLogger("kvreuse.fleet")

REPLICA_HEADER = "x-kvreuse-replica"
PREDICTED_HEADER = "x-kvreuse-predicted-cached-tokens"
# No read timeout: a generation takes as long as it takes; a dead replica is found by the
# connection breaking or by the health check.
TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=None)


@dataclass(frozen=True)
class FrontRequest:
    """A request as the front routes it: the body to forward, its tokens and cache salt."""

    body: bytes
    tokens: list[int]
    cache_salt: str | None
    stream: bool
    strip_usage: bool  # usage was added for the front's sake: leave it out of the answer


def parse_request(raw: bytes, chat: bool, tokenizer: Tokenizer) -> FrontRequest:
    """Validate like the replica (same 400s) and tokenise like it; runs off the event loop."""
    body = decode_json(raw)
    if chat:
        chat_req: ChatRequest = parse(ChatRequest, body)
        req: ChatRequest | CompletionRequest = chat_req
        tokens = tokenizer.encode(render_chat(chat_req.messages))
    else:
        completion: CompletionRequest = parse(CompletionRequest, body)
        req = completion
        tokens = prompt_tokens(completion.prompt, tokenizer)
    asked = req.stream_options is not None and req.stream_options.include_usage
    strip = req.stream and not asked
    if strip:
        options = body.get("stream_options")
        body["stream_options"] = {**(options if isinstance(options, dict) else {})}
        body["stream_options"]["include_usage"] = True
        raw = json.dumps(body).encode()
    return FrontRequest(raw, tokens, req.cache_salt, req.stream, strip)


def create_front(
    dispatcher: Dispatcher,
    tokenizer: Tokenizer,
    *,
    models: list[dict[str, Any]] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    health_interval: float = 2.0,
    admin_token: str | None = None,
    metrics_port: int | None = None,
    on_shutdown: Callable[[], None] | None = None,
) -> FastAPI:
    """The front over `dispatcher`'s replicas; `models`: the cards /v1/models lists.
    `admin_token`: what /fleet/replicas requires (it lists the replicas' addresses);
    `metrics_port`: serve /metrics only on connections to that local port; `on_shutdown`: run
    (in a thread) once the front has stopped serving, before its process may end."""
    metrics = FrontMetrics(dispatcher.status)
    for member in dispatcher.members:
        metrics.add_replica(member.name)
    state: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
            state["client"] = client
            checker = asyncio.ensure_future(_health_loop(dispatcher, client, health_interval))
            try:
                yield
            finally:
                checker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await checker
                if on_shutdown is not None:
                    await asyncio.to_thread(on_shutdown)

    app = FastAPI(title="kvreuse fleet", version="0.1.0", lifespan=lifespan)
    app.state.dispatcher, app.state.metrics = dispatcher, metrics
    install_errors(app)
    if metrics_port is not None:
        app.add_middleware(PortSplit, metrics_port=metrics_port)

    @app.get("/health")
    async def health() -> JSONResponse:
        up = [m.name for m in dispatcher.members if m.up]
        if not up:
            raise ApiError(503, "no replica is up", type="service_unavailable", code="no_replica")
        return JSONResponse({"status": "ok", "replicas_up": len(up)})

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": list(models or [])})

    @app.get("/metrics")
    async def scrape() -> Response:
        await asyncio.to_thread(metrics.refresh)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/fleet/replicas")
    async def replicas(http: HttpRequest) -> JSONResponse:
        check_admin(admin_token, http)
        rows = await asyncio.to_thread(dispatcher.status)
        return JSONResponse({"policy": dispatcher.router.policy.name, "replicas": rows})

    async def proxy(http: HttpRequest, path: str, chat: bool) -> Response:
        try:
            raw = await read_body(http, max_body_bytes)
        except Disconnected:
            return Response(status_code=499)
        req = await asyncio.to_thread(parse_request, raw, chat, tokenizer)
        return await _forward(dispatcher, metrics, state["client"], req, path)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest) -> Response:
        return await proxy(http, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest) -> Response:
        return await proxy(http, "/v1/chat/completions", chat=True)

    return app


async def _forward(
    dispatcher: Dispatcher,
    metrics: FrontMetrics,
    client: httpx.AsyncClient,
    req: FrontRequest,
    path: str,
) -> Response:
    rid = f"fleet-{uuid.uuid4().hex}"
    tried: set[int] = set()
    while True:
        try:
            routed = await asyncio.to_thread(
                dispatcher.route,
                req.tokens,
                request_id=rid,
                cache_salt=req.cache_salt,
                exclude=frozenset(tried),
            )
        except NoReplica as exc:
            raise ApiError(503, str(exc), type="service_unavailable", code="no_replica") from None
        member = routed.member
        metrics.on_routed(member.name, routed.num_tokens)
        try:
            resp = await open_upstream(client, member.url + path, req.body)
            break
        except Unreachable as exc:  # nothing was sent: another replica may take it
            _finish(dispatcher, metrics, routed, Delivery(failed=True))
            dispatcher.mark_down(member, str(exc))
            tried.add(member.index)
        except httpx.HTTPError as exc:
            _finish(dispatcher, metrics, routed, Delivery(failed=True))
            raise _replica_failed(member, exc) from None
    headers = {REPLICA_HEADER: member.name}
    if routed.predicted is not None:
        headers[PREDICTED_HEADER] = str(routed.predicted)
    if req.stream and resp.status_code == 200:
        events = relay_stream(
            resp,
            member.name,
            req.strip_usage,
            lambda delivery: _finish(dispatcher, metrics, routed, delivery),
        )
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    try:
        content, delivery = await read_answer(resp)
    except httpx.HTTPError as exc:
        _finish(dispatcher, metrics, routed, Delivery(failed=True))
        raise _replica_failed(member, exc) from None
    _finish(dispatcher, metrics, routed, delivery)
    kind = resp.headers.get("content-type", "application/json")
    return Response(content, status_code=resp.status_code, media_type=kind, headers=headers)


def _finish(
    dispatcher: Dispatcher, metrics: FrontMetrics, routed: Routed, delivery: Delivery
) -> None:
    dispatcher.done(routed)
    name = routed.member.name
    if delivery.failed:
        metrics.on_failed(name)
    if delivery.cached_tokens is not None:
        metrics.on_delivered(name, routed.predicted, delivery.cached_tokens)


def _replica_failed(member: Member, exc: Exception) -> ApiError:
    return ApiError(
        502,
        f"replica {member.name} failed to answer: {type(exc).__name__}: {exc}",
        type="server_error",
        code="replica_failed",
    )


async def _health_loop(dispatcher: Dispatcher, client: httpx.AsyncClient, every: float) -> None:
    """Take replicas that stop answering /health out of rotation, and back in; catch up the
    mirrors of quiet replicas."""
    while True:
        await asyncio.sleep(every)
        try:
            for member in list(dispatcher.members):
                ok, why = await _healthy(client, member)
                if member.up and not ok:
                    dispatcher.mark_down(member, why)
                elif not member.up and ok:
                    await asyncio.to_thread(dispatcher.revive, member)
            await asyncio.to_thread(dispatcher.refresh)
        except Exception as exc:  # the next round tries again; the front goes on serving
            log.error("fleet health check failed: %s: %s", type(exc).__name__, exc)


async def _healthy(client: httpx.AsyncClient, member: Member) -> tuple[bool, str]:
    try:
        resp = await client.get(f"{member.url}/health", timeout=2.0)
    except httpx.HTTPError as exc:
        return False, f"health check failed: {type(exc).__name__}: {exc}"
    if resp.status_code != 200:
        return False, f"health check answered {resp.status_code}"
    return True, ""


def install_errors(app: FastAPI) -> None:
    """Every error as OpenAI's {"error": {...}} body: ours, unknown paths, and the unexpected."""

    app.exception_handler(ApiError)(api_error)
    app.exception_handler(HTTPException)(http_error)

    @app.exception_handler(Exception)
    async def _internal(_: HttpRequest, exc: Exception) -> JSONResponse:
        err = ApiError(
            500,
            f"internal error in the fleet front: {type(exc).__name__}: {exc}",
            type="server_error",
        )
        return JSONResponse(err.body(), status_code=500)
