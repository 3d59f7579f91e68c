"""One request forwarded to a replica, and its answer relayed as the replica gave it (a JSON body
or server-sent events), reading on the way the cached tokens the replica reports
(`usage.prompt_tokens_details.cached_tokens`, OpenAI's field).

A stream whose client did not ask for usage is forwarded with `stream_options.include_usage`
set, so that the front learns the cached tokens, and the replica's usage chunk (the one with
no choices) is left out of what the client receives: the client gets the stream it asked for.
A stream the replica breaks off ends with an error event in OpenAI's shape and `data: [DONE]`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx

DONE = b"data: [DONE]"


class Unreachable(Exception):
    """The replica could not be reached: nothing was sent, so another replica may take it."""


@dataclass
class Delivery:
    """What the answer told the front: the cached tokens reported (None: no usage seen) and
    whether it failed (a status ≥ 500, or the replica broke off)."""

    cached_tokens: int | None = None
    failed: bool = False


def cached_tokens(obj: Any) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` of an answer or chunk, when present."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if type(value) is int and value >= 0 else None


async def open_upstream(client: httpx.AsyncClient, url: str, body: bytes) -> httpx.Response:
    """POST `body` to `url` and return the response with its body still to read."""
    request = client.build_request(
        "POST", url, content=body, headers={"content-type": "application/json"}
    )
    try:
        return await client.send(request, stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise Unreachable(f"{type(exc).__name__}: {exc}") from None


async def read_answer(resp: httpx.Response) -> tuple[bytes, Delivery]:
    """The whole (non-streamed) answer and what it delivered; httpx.HTTPError when the replica
    breaks off."""
    try:
        content = await resp.aread()
    finally:
        await resp.aclose()
    delivery = Delivery(failed=resp.status_code >= 500)
    if resp.status_code == 200:
        with contextlib.suppress(ValueError):
            delivery.cached_tokens = cached_tokens(json.loads(content))
    return content, delivery


def error_event(message: str, code: str) -> bytes:
    err = {"message": message, "type": "server_error", "param": None, "code": code}
    return b"data: " + json.dumps({"error": err}).encode() + b"\n\n"


async def relay_stream(
    resp: httpx.Response,
    replica: str,
    strip_usage: bool,
    finish: Callable[[Delivery], None],
) -> AsyncIterator[bytes]:
    """The replica's events, one at a time; `finish` gets the delivery once the stream ends
    (completed, broken off, or abandoned by the client)."""
    delivery = Delivery()
    buffer, done = b"", False
    try:
        try:
            async for chunk in resp.aiter_bytes():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    done = done or event.strip() == DONE
                    if _keep(event, delivery, strip_usage):
                        yield event + b"\n\n"
        except httpx.HTTPError as exc:
            delivery.failed = True
            msg = f"replica {replica} broke off the stream ({type(exc).__name__}: {exc})"
            yield error_event(msg, "replica_failed") + DONE + b"\n\n"
            return
        if not done:  # the replica closed the stream without ending it
            delivery.failed = True
            msg = f"replica {replica} ended the stream without [DONE]"
            yield error_event(msg, "replica_failed") + DONE + b"\n\n"
    finally:
        await resp.aclose()
        finish(delivery)


def _keep(event: bytes, delivery: Delivery, strip_usage: bool) -> bool:
    """Read an event's cached tokens; False for a usage chunk the client did not ask for."""
    if not event.startswith(b"data: ") or event.strip() == DONE:
        return True
    try:
        obj = json.loads(event[6:])
    except ValueError:
        return True
    if isinstance(obj, dict) and "error" in obj:
        delivery.failed = True
    cached = cached_tokens(obj)
    if cached is None:
        return True
    delivery.cached_tokens = cached
    return not (strip_usage and obj.get("choices") == [])
