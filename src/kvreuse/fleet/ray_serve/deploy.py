"""The Ray Serve deployments of the fleet (imports Ray; built by `kvreuse.fleet.ray_serve.app`).

    FleetIngress     OpenAI's endpoints (FastAPI); validates and tokenises each request as a
                     kvreuse replica does, and calls the replicas' handle with the tokens
    KvreuseReplica   one `kvreuse serve` process per Ray replica (a child of the replica
                     actor, on 127.0.0.1 of its node), its KV events and replay sockets bound
                     on every interface of the node so that routers on other nodes reach them

Why a process and not the ASGI app in the actor: `kvreuse serve` runs its step loop on its own
thread with its own event loop and publisher; inside a Ray actor that loop would share the
actor's event loop and lifecycle hooks, while as a child process it is exactly the server that
`kvreuse serve` runs everywhere else (same options, same drain on SIGTERM). The actor forwards
each call to it over 127.0.0.1 and ends it in `__del__` (and the kernel ends it if the actor
dies: PR_SET_PDEATHSIG).
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at run time
# (a Request parameter must be the class, not its name).
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import httpx
import ray  # type: ignore[import-not-found, unused-ignore]
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve  # type: ignore[import-not-found, unused-ignore]
from ray.serve.config import RequestRouterConfig  # type: ignore[import-not-found, unused-ignore]
from starlette.requests import Request as HttpRequest

from kvreuse.fleet.ray_serve import shared
from kvreuse.fleet.serving.forward import open_upstream, read_answer, relay_stream
from kvreuse.fleet.serving.front import (
    PREDICTED_HEADER,
    REPLICA_HEADER,
    TIMEOUT,
    install_errors,
    parse_request,
)
from kvreuse.fleet.serving.replicas import ReplicaProcess
from kvreuse.serve.body import DEFAULT_MAX_BODY_BYTES, Disconnected, read_body
from kvreuse.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

ROUTER_CLASS = "kvreuse.fleet.ray_serve.router:KvreuseRequestRouter"


def _on_node(endpoint: str | None, ip: str) -> str | None:
    """A bound wildcard endpoint (tcp://0.0.0.0:PORT) as other nodes reach it."""
    if endpoint is None or not endpoint.startswith("tcp://"):
        return endpoint
    return f"tcp://{ip}:{endpoint.rsplit(':', 1)[1]}"


@serve.deployment(health_check_period_s=5)
class KvreuseReplica:
    """A `kvreuse serve` child process, reached by the ingress through this actor."""

    def __init__(self, serve_args: list[str], start_timeout: float = 180.0) -> None:
        self.name = serve.get_replica_context().replica_id.unique_id
        # the replay socket always binds; serve wants the two endpoints spelled differently
        replay = "tcp://0.0.0.0:0"
        self.proc = ReplicaProcess(self.name, "tcp://*:0", serve_args, replay_endpoint=replay)
        self.proc.start()
        self.proc.wait_ready(time.monotonic() + start_timeout)
        ip = ray.util.get_node_ip_address()
        self.announce = {
            shared.EVENTS_KEY: _on_node(self.proc.events_bound, ip),
            shared.REPLAY_KEY: _on_node(self.proc.replay_endpoint, ip),
        }
        self.client = httpx.AsyncClient(timeout=TIMEOUT)

    def record_replica_metadata(self) -> dict[str, Any]:
        return dict(self.announce)

    def record_routing_stats(self) -> dict[str, Any]:
        return dict(self.announce)

    async def models(self, _: Any = None) -> list[dict[str, Any]]:
        """The model cards of the `kvreuse serve` process."""
        resp = await self.client.get(f"{self.proc.url}/v1/models")
        data = resp.json().get("data") if resp.status_code == 200 else None
        return data if isinstance(data, list) else []

    async def _send(self, payload: dict[str, Any]) -> httpx.Response:
        url = f"{self.proc.url}{payload['path']}"
        return await open_upstream(self.client, url, payload["body"])

    def check_health(self) -> None:
        if not self.proc.alive():
            raise RuntimeError(f"kvreuse serve of replica {self.name} exited")

    async def complete(self, payload: dict[str, Any]) -> dict[str, Any]:
        resp = await self._send(payload)
        content, _ = await read_answer(resp)
        kind = resp.headers.get("content-type", "application/json")
        return {"status": resp.status_code, "content": content, "type": kind, "replica": self.name}

    async def stream(self, payload: dict[str, Any]) -> AsyncIterator[Any]:
        """First a head ({"status", "replica"}, with the whole body when it is an error), then
        the events."""
        resp = await self._send(payload)
        if resp.status_code != 200:
            content, _ = await read_answer(resp)
            yield {"status": resp.status_code, "content": content, "replica": self.name}
            return
        yield {"status": 200, "replica": self.name}
        async for event in relay_stream(resp, self.name, payload["strip_usage"], lambda _: None):
            yield event

    def __del__(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None:
            proc.stop()


# Defined before the deployments: Ray serialises a deployment's class when it is decorated, with
# the module's names as they are at that moment.
async def _rest(gen: Any) -> AsyncIterator[bytes]:
    async for event in gen:
        yield event


def _headers(rid: str, replica: str) -> dict[str, str]:
    headers = {REPLICA_HEADER: replica}
    predicted = (shared.take_prediction(rid) or {}).get(replica)
    if predicted is not None:
        headers[PREDICTED_HEADER] = str(predicted)
    return headers


api = FastAPI(title="kvreuse fleet on Ray Serve")
install_errors(api)


@serve.deployment
@serve.ingress(api)
class FleetIngress:
    """OpenAI's endpoints; every generation goes through the replicas' handle (and router)."""

    def __init__(self, replicas: Any, tokenizer: str | None) -> None:
        self.replicas = replicas
        self.tokenizer: Tokenizer = HFTokenizer(tokenizer) if tokenizer else ByteTokenizer()
        self.models: list[dict[str, Any]] = []

    @api.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @api.get("/v1/models")
    async def list_models(self) -> JSONResponse:
        if not self.models:  # every replica serves the same model
            self.models = await self.replicas.options(method_name="models").remote()
        return JSONResponse({"object": "list", "data": self.models})

    @api.post("/v1/completions")
    async def completions(self, http: HttpRequest) -> Response:
        return await self._proxy(http, "/v1/completions", chat=False)

    @api.post("/v1/chat/completions")
    async def chat(self, http: HttpRequest) -> Response:
        return await self._proxy(http, "/v1/chat/completions", chat=True)

    async def _proxy(self, http: HttpRequest, path: str, chat: bool) -> Response:
        try:
            raw = await read_body(http, DEFAULT_MAX_BODY_BYTES)
        except Disconnected:
            return Response(status_code=499)
        req = parse_request(raw, chat, self.tokenizer)
        rid = f"ray-{uuid.uuid4().hex}"
        payload = {
            "path": path,
            "body": req.body,
            "tokens": req.tokens,
            "cache_salt": req.cache_salt,
            "strip_usage": req.strip_usage,
            "rid": rid,
        }
        if req.stream:
            gen = self.replicas.options(method_name="stream", stream=True).remote(payload)
            head = await gen.__anext__()
            headers = _headers(rid, head["replica"])
            if head["status"] != 200:
                return Response(head["content"], head["status"], headers, "application/json")
            return StreamingResponse(_rest(gen), media_type="text/event-stream", headers=headers)
        answer = await self.replicas.options(method_name="complete").remote(payload)
        headers = _headers(rid, answer["replica"])
        return Response(answer["content"], answer["status"], headers, answer["type"])


def application(
    num_replicas: int,
    serve_args: list[str],
    geometry_toml: str,
    *,
    policy: str,
    load_weight: float,
    replica_cpus: float,
    tokenizer: str | None,
) -> Any:
    """The bound application: the ingress over `num_replicas` kvreuse replicas."""
    router = RequestRouterConfig(
        request_router_class=ROUTER_CLASS,
        request_router_kwargs={
            "geometry": geometry_toml,
            "policy": policy,
            "load_weight": load_weight,
        },
        request_routing_stats_period_s=1.0,
    )
    replicas = (
        cast(Any, KvreuseReplica)
        .options(
            num_replicas=num_replicas,
            request_router_config=router,
            ray_actor_options={"num_cpus": replica_cpus},
        )
        .bind(serve_args)
    )
    ingress = cast(Any, FleetIngress).options(ray_actor_options={"num_cpus": 0})
    return ingress.bind(replicas, tokenizer)
