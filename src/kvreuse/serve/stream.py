"""Server-sent events for a generation, and a streaming response that gives up on a client that
stops reading.

Every stream ends with `data: [DONE]`: after the final chunk, or after an error event (OpenAI's
error shape) when the request fails, is refused by a draining server, or is stopped at the drain
timeout. A client that stops reading blocks the socket write; after `stall_timeout` seconds of
one blocked write the stream is abandoned (the request is aborted, its blocks freed, and the
connection closed) instead of holding a request slot forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import StreamingResponse
from starlette.types import Send

from kvreuse.serve.backend import Backend
from kvreuse.serve.generate import Gen, run
from kvreuse.serve.loop import Delta, EngineLoop
from kvreuse.serve.protocol import ApiError

log = logging.getLogger("kvreuse.serve")


class GuardedStream(StreamingResponse):
    """A `StreamingResponse` whose every write must finish within `stall_timeout` seconds.

    With `late_headers`, the response starts with its first event, so its headers can say how
    the request was admitted (`late_headers()`, read then: the first event comes after the
    admission); without, at once."""

    def __init__(
        self,
        content: AsyncIterator[str],
        stall_timeout: float,
        label: str,
        late_headers: Callable[[], dict[str, str]] | None = None,
    ) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.stall_timeout = stall_timeout
        self.label = label
        self.late_headers = late_headers

    async def stream_response(self, send: Send) -> None:
        chunks: AsyncIterator[Any] = aiter(self.body_iterator)
        if self.late_headers is not None:
            first = await anext(chunks, None)
            for name, value in self.late_headers().items():
                self.raw_headers.append((name.encode("latin-1"), value.encode("latin-1")))
            chunks = _prepend(first, chunks)
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        try:
            async for chunk in chunks:
                data = chunk.encode() if isinstance(chunk, str) else bytes(chunk)
                message = {"type": "http.response.body", "body": data, "more_body": True}
                try:
                    await asyncio.wait_for(send(message), self.stall_timeout)
                except TimeoutError:
                    log.warning(
                        "%s: the client read nothing for %g s; the stream is abandoned and "
                        "the request aborted",
                        self.label,
                        self.stall_timeout,
                    )
                    return  # the server closes the connection: the body stays incomplete
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()  # the generator's cleanup aborts the request now, not at GC


async def _prepend(
    first: str | bytes | memoryview | None, rest: AsyncIterator[Any]
) -> AsyncIterator[Any]:
    if first is None:
        return
    yield first
    async for chunk in rest:
        yield chunk


def head(gen: Gen, backend: Backend, chat: bool, chunk: bool = False) -> dict[str, Any]:
    kind = "chat.completion" if chat else "text_completion"
    return {
        "id": gen.rid,
        "object": kind + (".chunk" if chat and chunk else ""),
        "created": int(time.time()),
        "model": backend.name,
    }


def _choice(chat: bool, text: str | None, reason: str | None, role: bool = False) -> dict:
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}


def event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


DONE = "data: [DONE]\n\n"


async def sse(
    engine: EngineLoop,
    backend: Backend,
    gen: Gen,
    out: asyncio.Queue[Delta],
    http: HttpRequest,
    chat: bool,
    token_ids: bool,
    usage: bool,
) -> AsyncIterator[str]:
    top = head(gen, backend, chat, chunk=True)
    # a chat stream's first event names the role; with a shared store it waits for the first
    # text, so that the response starts once the request is admitted (GuardedStream)
    role = event({**top, "choices": [_choice(chat, None, None, True)], "usage": None})
    role_due = chat
    try:
        if role_due and backend.store_turns is None:
            role_due = False
            yield role
        async with contextlib.aclosing(run(engine, backend, gen, out, http)) as texts:
            async for text in texts:
                if role_due:
                    role_due = False
                    yield role
                yield event({**top, "choices": [_choice(chat, text, None)], "usage": None})
    except ApiError as exc:
        yield event(exc.body())
        yield DONE
        return
    if gen.finish_reason == "disconnect":
        return
    if role_due:
        yield role
    final = _choice(chat, None, gen.finish_reason)
    if token_ids:
        final["prompt_token_ids"], final["token_ids"] = gen.prompt, gen.token_ids
    yield event({**top, "choices": [final], "usage": None})
    if usage:
        yield event({**top, "choices": [], "usage": gen.usage()})
    yield DONE


def message(gen: Gen, backend: Backend, chat: bool, token_ids: bool) -> dict[str, Any]:
    """The non-streamed answer."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": gen.finish_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": gen.text}
    else:
        choice["text"] = gen.text
    if token_ids:
        choice["prompt_token_ids"], choice["token_ids"] = gen.prompt, gen.token_ids
    return {**head(gen, backend, chat), "choices": [choice], "usage": gen.usage()}
