"""Operator controls that `kvreuse serve` and the fleet front share, as ASGI pieces: a separate
listener for `/metrics` (`PortSplit`), the admin token (`check_admin`) and the KV event stream's
incarnation on every response (`InstanceHeader`); their options are in
`kvreuse.serve.ops_options`.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.requests import Request as HttpRequest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvreuse.events.common import INSTANCE_HEADER
from kvreuse.serve.protocol import ApiError

METRICS_ONLY = ("/metrics", "/health")  # what the separate metrics listener serves


class PortSplit:
    """ASGI middleware: on the metrics listener only METRICS_ONLY; elsewhere no /metrics."""

    def __init__(self, app: ASGIApp, metrics_port: int) -> None:
        self.app = app
        self.metrics_port = metrics_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            server = scope.get("server")
            on_metrics = server is not None and server[1] == self.metrics_port
            path = scope["path"]
            if (path == "/metrics" and not on_metrics) or (on_metrics and path not in METRICS_ONLY):
                err = ApiError(404, f"no such endpoint on this port: {path}", code="not_found")
                await JSONResponse(err.body(), status_code=404)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class InstanceHeader:
    """ASGI middleware: every response names the KV event stream's incarnation
    (`INSTANCE_HEADER`), so a router can tell a restarted replica from the one it follows."""

    def __init__(self, app: ASGIApp, instance: str) -> None:
        self.app = app
        self.header = (INSTANCE_HEADER.encode(), instance.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named)


def check_admin(token: str | None, http: HttpRequest) -> None:
    """Nothing without a token; else ApiError 401 unless the request carries it."""
    if token is None:
        return
    given = http.headers.get("authorization", "")
    scheme, _, value = given.partition(" ")
    ok = scheme.lower() == "bearer" and hmac.compare_digest(
        value.strip().encode("utf-8", "surrogateescape"), token.encode("utf-8")
    )
    if not ok:
        raise ApiError(
            401,
            "this endpoint needs the admin token: send 'Authorization: Bearer <token>'",
            type="authentication_error",
            code="invalid_admin_token",
        )


async def api_error(_: HttpRequest, exc: ApiError) -> JSONResponse:
    """The exception handler for ApiError (OpenAI's body; a 401 names the Bearer scheme)."""
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)
