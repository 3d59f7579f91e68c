"""One request forwarded to a replica, and its answer relayed as the replica gave it (a JSON body
or server-sent events), reading on the way the cached tokens the replica reports
(`usage.prompt_tokens_details.cached_tokens`, OpenAI's field).

A stream whose client did not ask for usage is forwarded with `stream_options.include_usage`
set, so that the front learns the cached tokens, and the replica's usage chunk (the one with
no choices) is left out of what the client receives: the client gets the stream it asked for.
A stream the replica breaks off ends with an error event in OpenAI's shape and `data: [DONE]`.

Every wait on a replica is bounded (`Deadlines`): a `Flight` is one request in flight, and each
of its waits ends with `GaveUp` when its deadline passes or when the front ends the flight (the
replica stopped answering its health checks). A wait is an `asyncio.timeout` scope, so ending a
flight is rescheduling the scope that is open: no task of its own per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]"
T = TypeVar("T")


class Unreachable(Exception):
    """The replica could not be reached: nothing was sent, so another replica may take it."""


@dataclass
class Delivery:
    """What the answer told the front: the cached tokens reported (None: no usage seen) and
    whether it failed (a status ≥ 500, or the replica broke off)."""

    cached_tokens: int | None = None
    failed: bool = False


class GaveUp(Exception):
    """The front stopped waiting for a replica: a deadline passed (504 `replica_timeout`) or the
    replica stopped answering its health checks (502 `replica_down`)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class Flight:
    """One request in flight on a replica. `finish` reports its delivery once, whichever path
    ends it; `end` stops its current wait at once and fails every later one."""

    def __init__(self, replica: str, finish: Callable[[Delivery], None]) -> None:
        self.replica = replica
        self._finish: Callable[[Delivery], None] | None = finish
        self._ended: str | None = None
        self._scope: asyncio.Timeout | None = None
        self.on_finish: Callable[[Flight], None] | None = None

    @property
    def finished(self) -> bool:
        return self._finish is None

    def end(self, why: str) -> None:
        """The replica stopped answering: give up on this request (from the event loop)."""
        self._ended = why
        if self._scope is not None and not self._scope.expired():
            self._scope.reschedule(asyncio.get_running_loop().time())

    def finish(self, delivery: Delivery) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish(delivery)
            if self.on_finish is not None:
                self.on_finish(self)

    async def wait(self, step: Callable[[], Awaitable[T]], until: float, what: str) -> T:
        """`await step()`, given up on at the loop time `until` or when the flight is ended;
        `what` says what did not come ("sent no response headers")."""
        self._check_ended()
        scope = asyncio.timeout_at(until)
        try:
            async with scope:
                self._scope = scope
                return await step()
        except TimeoutError:
            if not scope.expired():
                raise
            self._check_ended()
            raise GaveUp(504, "replica_timeout", f"replica {self.replica} {what}") from None
        finally:
            self._scope = None

    def _check_ended(self) -> None:
        if self._ended is not None:
            msg = f"replica {self.replica} stopped answering ({self._ended})"
            raise GaveUp(502, "replica_down", msg)

    async def chunks(
        self, source: AsyncIterator[bytes], first: bytes, stall: float
    ) -> AsyncIterator[bytes]:
        """`first`, then what `source` yields, each chunk within `stall` seconds of the last."""
        if first:
            yield first
        loop = asyncio.get_running_loop()
        silence = f"sent nothing for {stall:g} s in the middle of a stream (the stall timeout)"
        while True:
            try:
                chunk = await self.wait(source.__anext__, loop.time() + stall, silence)
            except StopAsyncIteration:
                return
            yield chunk


class Flights:
    """The flights of each replica, to end them all when it stops answering."""

    def __init__(self) -> None:
        self._by_replica: dict[str, set[Flight]] = {}

    def open(self, replica: str, finish: Callable[[Delivery], None]) -> Flight:
        flight = Flight(replica, finish)
        self._by_replica.setdefault(replica, set()).add(flight)
        flight.on_finish = lambda f: self._by_replica[replica].discard(f)
        return flight

    def end(self, replica: str, why: str) -> int:
        """End every flight on `replica`; how many there were."""
        flights = list(self._by_replica.get(replica, ()))
        for flight in flights:
            flight.end(why)
        return len(flights)


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
    chunks: AsyncIterator[bytes] | None = None,
) -> AsyncIterator[bytes]:
    """The replica's events, one at a time; `finish` gets the delivery once the stream ends
    (completed, broken off, given up on, or abandoned by the client). `chunks`: the body as
    read so far and on (default: `resp.aiter_bytes()`), e.g. `Flight.chunks`."""
    delivery = Delivery()
    buffer, done = b"", False
    try:
        try:
            async for chunk in resp.aiter_bytes() if chunks is None else chunks:
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
        except GaveUp as exc:
            delivery.failed = True
            yield error_event(exc.message, exc.code) + DONE + b"\n\n"
            return
        if not done:  # the replica closed the stream without ending it
            delivery.failed = True
            msg = f"replica {replica} ended the stream without [DONE]"
            yield error_event(msg, "replica_failed") + DONE + b"\n\n"
    finally:
        close = getattr(chunks, "aclose", None)  # a generator suspended in its own wait
        if close is not None:
            await close()
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


class RelayedResponse(StreamingResponse):
    """A relayed stream that finishes its flight and closes the replica's answer however the
    response ends, even when the client left before the first event was sent (the events'
    generator then never started, so its own cleanup never runs)."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        flight: Flight,
        upstream: httpx.Response,
        headers: dict[str, str],
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.events, self.flight, self.upstream = events, flight, upstream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.events, "aclose", None)
            if close is not None:
                await close()
            await abandon(self.flight, self.upstream, failed=False)


async def abandon(flight: Flight, resp: httpx.Response, failed: bool = True) -> None:
    """Close the replica's answer unread and finish the flight (failed, unless told)."""
    await resp.aclose()
    flight.finish(Delivery(failed=failed))
