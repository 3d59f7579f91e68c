"""The fleet's OpenAI-compatible front: `create_front(dispatcher, tokenizer)`.

GET  /health                 200 while at least one replica is up; 503 otherwise
GET  /v1/models              the replicas' model
POST /v1/completions         routed, then forwarded (SSE relayed with "stream": true)
POST /v1/chat/completions    the same; tokenised with the replicas' chat template
GET  /metrics                per-replica routing counters (kvreuse.fleet.serving.metrics); only
                             on `metrics_port` when one is given
GET  /fleet/replicas         each replica: url, state (up, down, restarting, given-up), load,
                             event stream state; needs the admin token when one is configured
                             (401 otherwise)

A request is validated and tokenised exactly as a `kvreuse serve` replica does it (the same
request models and errors, the same chat template, the same tokenizer), so the front hashes the
very tokens the replica will look up. It is routed (`Dispatcher.route`), forwarded with httpx,
and answered as the replica answered, with headers added: `x-kvreuse-replica` (where it
went) and, when the policy predicts, `x-kvreuse-predicted-cached-tokens` and
`x-kvreuse-mirror-exact` (whether the prediction came from an exact mirror of the very process
that answered, which a kvreuse replica names in every response); with replica tiers also
`x-kvreuse-predicted-cached-tokens-by-medium` ("GPU=…,CPU=…,STORE=…", as a replica's
`usage.prompt_tokens_details.cached_tokens_by_medium`).

Failures: a replica that cannot be reached is marked down and the request goes to another
(nothing was sent); a replica that fails once the request is sent fails only that request, with
an error in OpenAI's shape (502, or an error event in a stream). Every wait on a replica has a
deadline (`kvreuse.fleet.serving.deadlines.Deadlines`): past it the request ends with 504
`replica_timeout` (in a stream that has begun: an error event). A health check every
`health_interval` seconds takes replicas out of rotation and back in; one that does not answer
it in time also has its requests in flight ended (502 `replica_down`), while one that answers
"not healthy" (draining) keeps them: finishing those is what its drain is for. A replica whose
process `kvreuse fleet` is restarting is out of rotation until the new process is followed
(kvreuse.fleet.serving.supervise), whatever its health check says.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest

from kvreuse.events.common import INSTANCE_HEADER, STORE_VIEW_HEADER
from kvreuse.fleet import DEFAULT_HEALTH_INTERVAL_S
from kvreuse.fleet.serving.deadlines import Deadlines
from kvreuse.fleet.serving.dispatch import Dispatcher, Member, NoReplica, Routed
from kvreuse.fleet.serving.forward import (
    Delivery,
    Flight,
    Flights,
    GaveUp,
    RelayedResponse,
    Unreachable,
    abandon,
    open_upstream,
    read_answer,
    relay_stream,
)
from kvreuse.fleet.serving.members import DOWN
from kvreuse.fleet.serving.metrics import FrontMetrics
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
# "true" when the prediction came from an exact mirror of the very process that answered
MIRROR_EXACT_HEADER = "x-kvreuse-mirror-exact"
# the prediction by medium, "GPU=…,CPU=…,STORE=…", as usage's cached_tokens_by_medium
PREDICTED_BY_MEDIUM_HEADER = "x-kvreuse-predicted-cached-tokens-by-medium"
# The client's own timeouts: no read timeout, since how long a read may wait depends on where the
# answer is (the front's deadlines bound it); the Ray ingress uses these as they are.
TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=None)
HEALTH_TIMEOUT = 2.0  # seconds a replica's /health may take before it counts as not answering


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
    health_interval: float = DEFAULT_HEALTH_INTERVAL_S,
    deadlines: Deadlines | None = None,
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
    front = _Front(dispatcher, metrics, deadlines or Deadlines(), Flights())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        connect = front.deadlines.connect
        timeout = httpx.Timeout(connect=connect, read=None, write=TIMEOUT.write, pool=None)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            front.client = client
            checker = asyncio.ensure_future(_health_loop(front, health_interval))
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
    _info_routes(app, front, models or [], admin_token)
    _generation_routes(app, front, tokenizer, max_body_bytes)
    return app


def _info_routes(
    app: FastAPI, front: _Front, models: list[dict[str, Any]], admin_token: str | None
) -> None:
    dispatcher, metrics = front.dispatcher, front.metrics

    @app.get("/health")
    async def health() -> JSONResponse:
        up = [m.name for m in dispatcher.members if m.up]
        if not up:
            raise ApiError(503, "no replica is up", type="service_unavailable", code="no_replica")
        return JSONResponse({"status": "ok", "replicas_up": len(up)})

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": list(models)})

    @app.get("/metrics")
    async def scrape() -> Response:
        await asyncio.to_thread(metrics.refresh)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/fleet/replicas")
    async def replicas(http: HttpRequest) -> JSONResponse:
        check_admin(admin_token, http)
        rows = await asyncio.to_thread(dispatcher.status)
        return JSONResponse({"policy": dispatcher.router.policy.name, "replicas": rows})


def _generation_routes(
    app: FastAPI, front: _Front, tokenizer: Tokenizer, max_body_bytes: int
) -> None:
    async def proxy(http: HttpRequest, path: str, chat: bool) -> Response:
        try:
            raw = await read_body(http, max_body_bytes)
        except Disconnected:
            return Response(status_code=499)
        req = await asyncio.to_thread(parse_request, raw, chat, tokenizer)
        return await _forward(front, req, path)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest) -> Response:
        return await proxy(http, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest) -> Response:
        return await proxy(http, "/v1/chat/completions", chat=True)


@dataclass
class _Front:
    """What the front's handlers share."""

    dispatcher: Dispatcher
    metrics: FrontMetrics
    deadlines: Deadlines
    flights: Flights
    client: httpx.AsyncClient | None = None


async def _forward(front: _Front, req: FrontRequest, path: str) -> Response:
    """Route, send (to another replica while one cannot be reached), relay; the request leaves
    the replica's load (`Flight.finish`) on every path."""
    rid = f"fleet-{uuid.uuid4().hex}"
    tried: set[int] = set()
    loop = asyncio.get_running_loop()
    assert front.client is not None
    client, deadlines = front.client, front.deadlines
    while True:
        routed = await _route(front, req, rid, frozenset(tried))
        member = routed.member
        flight = front.flights.open(member.name, functools.partial(_finish, front, routed))
        # a non-streamed answer's headers come with its body, once it is generated
        limit = _limit(deadlines, req.stream)
        head_by = loop.time() + (deadlines.first_byte if req.stream else deadlines.answer)
        url = member.url  # a restarted replica moves: only this address failed
        send = functools.partial(open_upstream, client, url + path, req.body)
        try:
            resp = await flight.wait(send, head_by, f"sent no response headers within {limit}")
            break
        except Unreachable as exc:  # nothing was sent: another replica may take it
            flight.finish(Delivery(failed=True))
            front.dispatcher.mark_down(member, str(exc), url=url)
            tried.add(member.index)
        except (httpx.HTTPError, GaveUp) as exc:
            flight.finish(Delivery(failed=True))
            raise _replica_error(member, exc) from None
        except BaseException:
            flight.finish(Delivery(failed=True))
            raise
    headers = {REPLICA_HEADER: member.name}
    if routed.predicted is not None:
        headers[PREDICTED_HEADER] = str(routed.predicted)
        if routed.by_medium is not None:
            parts = (f"{medium}={n}" for medium, n in routed.by_medium.items())
            headers[PREDICTED_BY_MEDIUM_HEADER] = ",".join(parts)
        headers[MIRROR_EXACT_HEADER] = "true" if await _confirm(front, routed, resp) else "false"
    try:
        if req.stream and resp.status_code == 200:
            return await _stream(front, flight, resp, req, head_by, headers)
        content, delivery = await flight.wait(
            functools.partial(read_answer, resp), head_by, f"did not answer within {limit}"
        )
    except (httpx.HTTPError, GaveUp) as exc:
        await abandon(flight, resp)
        raise _replica_error(member, exc) from None
    except BaseException:
        await abandon(flight, resp)
        raise
    flight.finish(delivery)
    kind = resp.headers.get("content-type", "application/json")
    return Response(content, status_code=resp.status_code, media_type=kind, headers=headers)


async def _confirm(front: _Front, routed: Routed, resp: httpx.Response) -> bool:
    """Whether the prediction came from an exact mirror of the process that answered: a
    replica that names another incarnation than the mirror followed has restarted."""
    announced = resp.headers.get(INSTANCE_HEADER)
    view = resp.headers.get(STORE_VIEW_HEADER)
    if announced is not None and announced != routed.instance:  # it observes: not on the loop
        return await asyncio.to_thread(front.dispatcher.confirm, routed, announced, view)
    return front.dispatcher.confirm(routed, announced, view)


async def _route(front: _Front, req: FrontRequest, rid: str, tried: frozenset[int]) -> Routed:
    try:
        routed = await asyncio.to_thread(
            front.dispatcher.route,
            req.tokens,
            request_id=rid,
            cache_salt=req.cache_salt,
            exclude=tried,
        )
    except NoReplica as exc:
        raise ApiError(503, str(exc), type="service_unavailable", code="no_replica") from None
    front.metrics.on_routed(routed.member.name, routed.num_tokens)
    return routed


async def _stream(
    front: _Front,
    flight: Flight,
    resp: httpx.Response,
    req: FrontRequest,
    first_by: float,
    headers: dict[str, str],
) -> Response:
    """Relay a stream once its first bytes came: until then nothing has gone to the client, so
    a replica that sends nothing gets a 504 of its own rather than a stream with an error."""
    source = resp.aiter_bytes()
    what = f"sent no event within {_limit(front.deadlines, True)}"
    first = await flight.wait(lambda: anext(source, b""), first_by, what)
    chunks = flight.chunks(source, first, front.deadlines.stall)
    events = relay_stream(resp, flight.replica, req.strip_usage, flight.finish, chunks)
    return RelayedResponse(events, flight, resp, headers)


def _limit(deadlines: Deadlines, stream: bool) -> str:
    """The deadline of a request's first bytes, for messages."""
    if stream:
        return f"{deadlines.first_byte:g} s (the first-byte timeout)"
    return f"{deadlines.answer:g} s (the answer timeout)"


def _finish(front: _Front, routed: Routed, delivery: Delivery) -> None:
    front.dispatcher.done(routed)
    name = routed.member.name
    if delivery.failed:
        front.metrics.on_failed(name)
    if delivery.cached_tokens is not None:
        front.metrics.on_delivered(name, routed.predicted, delivery.cached_tokens)


def _replica_error(member: Member, exc: Exception) -> ApiError:
    if isinstance(exc, GaveUp):
        return ApiError(exc.status, exc.message, type="server_error", code=exc.code)
    return ApiError(
        502,
        f"replica {member.name} failed to answer: {type(exc).__name__}: {exc}",
        type="server_error",
        code="replica_failed",
    )


async def _health_loop(front: _Front, every: float) -> None:
    """Take replicas that stop answering /health out of rotation, and back in; end the requests
    in flight on one that does not answer at all; catch up the mirrors of quiet replicas."""
    dispatcher = front.dispatcher
    assert front.client is not None
    while True:
        await asyncio.sleep(every)
        try:
            for member in list(dispatcher.members):
                url = member.url  # a supervised replica restarted meanwhile is elsewhere
                ok, why, answered, instance = await _healthy(front.client, url)
                if url != member.url:
                    continue
                if not answered and (ended := front.flights.end(member.name, why)):
                    log.warning("fleet: ended %d request(s) on %s: %s", ended, member.name, why)
                if instance is not None:  # a restart between two checks shows here
                    await asyncio.to_thread(dispatcher.observe, member, instance)
                if member.up and not ok:
                    dispatcher.mark_down(member, why, url=url)
                elif member.state == DOWN and ok:
                    await asyncio.to_thread(dispatcher.revive, member)
            await asyncio.to_thread(dispatcher.refresh)
        except Exception as exc:  # the next round tries again; the front goes on serving
            log.error("fleet health check failed: %s: %s", type(exc).__name__, exc)


async def _healthy(client: httpx.AsyncClient, url: str) -> tuple[bool, str, bool, str | None]:
    """(healthy, why not, whether it answered in time: a refused connection answers too, the
    incarnation of its KV event stream it named)."""
    try:
        resp = await client.get(f"{url}/health", timeout=HEALTH_TIMEOUT)
    except httpx.TimeoutException as exc:
        return False, f"no answer to a health check in {HEALTH_TIMEOUT:g} s ({exc!r})", False, None
    except httpx.HTTPError as exc:
        return False, f"health check failed: {type(exc).__name__}: {exc}", True, None
    if resp.status_code != 200:
        return False, f"health check answered {resp.status_code}", True, None
    return True, "", True, resp.headers.get(INSTANCE_HEADER)


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
