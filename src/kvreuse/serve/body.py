"""A request body from the socket to a checked JSON value: a size limit enforced while reading
(413), then decoding that turns every malformed input into one 400 line: invalid JSON, nesting
deeper than `MAX_DEPTH` (Python's parser would raise RecursionError), integers longer than
Python's 4,300-digit conversion limit, and lone surrogates (valid JSON escapes that no UTF-8
text can hold; the tokenizer and the cache's hashing would fail on them later).

Decoding runs in a worker thread (`kvreuse.serve.app`), so a large body does not stall the
event loop.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest

from kvreuse.serve import defaults
from kvreuse.serve.protocol import ApiError

log = logging.getLogger("kvreuse.serve")

MAX_DEPTH = 64
DEFAULT_MAX_BODY_BYTES = defaults.MAX_BODY_BYTES
_SURROGATE = re.compile("[\ud800-\udfff]")


class Disconnected(Exception):
    """The client went away before its request body was complete (nobody to answer)."""


async def read_body(http: HttpRequest, limit: int) -> bytes:
    """The whole body, or 413 as soon as it is known to exceed `limit` bytes (declared or
    received): a large upload is never buffered past the limit."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, f"declares {int(declared)} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit, f"exceeds it after {size} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        log.info(
            "client %s disconnected while sending the body of %s %s (%d bytes received)",
            _peer(http),
            http.method,
            http.url.path,
            size,
        )
        raise Disconnected from None
    return b"".join(chunks)


def _peer(http: HttpRequest) -> str:
    client = http.client
    return f"{client.host}:{client.port}" if client else "unknown"


def _too_large(limit: int, how: str) -> ApiError:
    return ApiError(
        413,
        f"the request body {how}; the limit is {limit} bytes (kvreuse serve --max-body-bytes)",
        code="request_too_large",
    )


def decode_json(raw: bytes) -> Any:
    """Parse and check a body; ApiError(400) naming the problem."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:  # e.g. an integer beyond Python's int/str conversion limit
        raise ApiError(400, f"the request body is not valid JSON: {_short_reason(exc)}") from None
    check_value(value)
    return value


def _short_reason(exc: ValueError) -> str:
    text = str(exc)
    if "integer string conversion" in text:
        return "an integer has more than 4300 digits"
    return text.split(";")[0]


def _too_deep() -> ApiError:
    return ApiError(400, f"the request body is nested more than {MAX_DEPTH} levels deep")


def check_value(value: Any) -> None:
    """Depth and lone surrogates, in one iterative walk (no recursion on hostile nesting)."""
    stack: list[tuple[Any, int, tuple[str, ...]]] = [(value, 1, ())]
    while stack:
        v, depth, path = stack.pop()
        if isinstance(v, str):
            _check_text(v, path)
        elif isinstance(v, dict | list):
            if depth > MAX_DEPTH:
                raise _too_deep()
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, item in items:
                key = str(k)
                if isinstance(k, str):
                    _check_text(k, path)
                if isinstance(item, str | dict | list):
                    stack.append((item, depth + 1, (*path, key)))


def _check_text(text: str, path: tuple[str, ...]) -> None:
    m = _SURROGATE.search(text)
    if m is not None:
        where = ".".join(path) or "the body"
        raise ApiError(
            400,
            f"{where}: {m.group()!r} at index {m.start()} is a lone surrogate, which is not "
            "valid Unicode text",
            param=path[0] if path else None,
        )
