"""From a validated OpenAI request to tokens and back: prompt checks, the request's life in the
step loop (with disconnect detection) and its text (`kvreuse.serve.detok`)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request as HttpRequest

from kvreuse.events.common import STORE_VIEW_HEADER
from kvreuse.serve.backend import Backend
from kvreuse.serve.detok import TextState, advance
from kvreuse.serve.loop import Delta, EngineLoop, Overloaded, Unavailable
from kvreuse.serve.protocol import ApiError, _Common, short

DEFAULT_MAX_TOKENS = 16
MAX_STOPS = 16  # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 256


@dataclass
class Gen:
    """One generation: what to run and what came out so far."""

    rid: str
    prompt: list[int]
    max_tokens: int
    sampling: Any
    salt: str | None
    stop_ids: frozenset[int]
    stop_strs: tuple[str, ...]
    token_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    cached_by_medium: dict[str, int] | None = None  # with tiers (Delta.cached_by_medium)
    store_view: str | None = None  # with a shared store, once admitted (Delta.store_view)
    finish_reason: str | None = None
    out: asyncio.Queue[Delta] | None = None  # set by `submit`
    text_state: TextState = field(init=False)

    def __post_init__(self) -> None:
        self.text_state = TextState(self.stop_strs)

    @property
    def text(self) -> str:
        return self.text_state.text

    def headers(self) -> dict[str, str]:
        """The response headers that say how it was admitted (`STORE_VIEW_HEADER`)."""
        return {} if self.store_view is None else {STORE_VIEW_HEADER: self.store_view}

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage; with tiers below the cache, `prompt_tokens_details` also says where
        the cached tokens came from (`cached_tokens_by_medium`: "GPU", "CPU", "STORE")."""
        details: dict[str, Any] = {"cached_tokens": self.cached_tokens}
        if self.cached_by_medium is not None:
            details["cached_tokens_by_medium"] = self.cached_by_medium
        return {
            "prompt_tokens": len(self.prompt),
            "completion_tokens": len(self.token_ids),
            "total_tokens": len(self.prompt) + len(self.token_ids),
            "prompt_tokens_details": details,
        }


def check_model(backend: Backend, model: str | None) -> None:
    if model is not None and model != backend.name and model not in backend.aliases:
        raise ApiError(
            400,
            f"the model {short(model)} does not exist; this server serves {backend.name!r}",
            param="model",
            code="model_not_found",
        )


def check_prompt_length(backend: Backend, num_tokens: int) -> None:
    """Before any per-token work: a prompt at or above the context length is refused."""
    limit = backend.max_model_len
    if num_tokens >= limit:
        raise ApiError(
            400,
            f"this model's maximum context length is {limit} tokens; the prompt has {num_tokens}",
            param="prompt",
            code="context_length_exceeded",
        )


def prepare(
    backend: Backend, req: _Common, prompt: list[int], prefix: str, max_tokens: int | None
) -> Gen:
    """Check a request against the model and the cache; 400 naming the problem."""
    check_model(backend, req.model)
    if req.n != 1:
        raise ApiError(400, "only n = 1 is supported", param="n")
    if not prompt:
        raise ApiError(400, "the prompt is empty; at least one token is needed", param="prompt")
    check_prompt_length(backend, len(prompt))
    vocab = backend.token_limit
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(
            400, f"token id {short(bad)} is outside the vocabulary [0, {vocab})", param="prompt"
        )
    n = _max_tokens(backend, len(prompt), max_tokens)
    for name, value, lo, hi in (("temperature", req.temperature, 0, 2), ("top_p", req.top_p, 0, 1)):
        if value is not None and not lo <= value <= hi:
            raise ApiError(400, f"{name} must be in [{lo}, {hi}], got {value}", param=name)
    if req.top_k is not None and req.top_k < -1:
        raise ApiError(
            400, f"top_k must be -1, 0 (off) or ≥ 1, got {short(req.top_k)}", param="top_k"
        )
    stop_ids = set()
    eos = backend.tokenizer.eos_token_id
    if eos is not None and not req.ignore_eos:
        stop_ids.add(eos)
    stops = _stops(req.stop)
    sampling = make_sampling(backend, req, n, frozenset(stop_ids))
    return Gen(
        f"{prefix}-{uuid.uuid4().hex}",
        prompt,
        n,
        sampling,
        req.cache_salt,
        frozenset(stop_ids),
        stops,
    )


def _max_tokens(backend: Backend, num_prompt: int, max_tokens: int | None) -> int:
    limit = backend.max_model_len
    n = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if n < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {short(n)}", param="max_tokens")
    if num_prompt + n > limit:
        raise ApiError(
            400,
            f"this model's maximum context length is {limit} tokens; the prompt "
            f"({num_prompt}) plus max_tokens ({short(n)}) exceed it",
            param="max_tokens",
            code="context_length_exceeded",
        )
    sched = backend.scheduler  # its config and the pool's size only: both frozen
    need = sched.peak_blocks(num_prompt, n)
    if need > sched.num_usable_blocks:
        raise ApiError(
            400,
            f"the request needs {need} KV blocks at its peak; the cache has "
            f"{sched.num_usable_blocks}",
            param="max_tokens",
        )
    return n


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(
            400,
            f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters each",
            param="stop",
        )
    return tuple(s for s in stops if s)


def make_sampling(backend: Backend, req: _Common, max_tokens: int, stop: frozenset[int]) -> Any:
    top_k = req.top_k or 0
    try:
        return backend.make_sampling(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_p=1.0 if req.top_p is None else float(req.top_p),
            top_k=0 if top_k == -1 else top_k,
            seed=req.seed,
            stop_token_ids=tuple(sorted(stop)),
        )
    except (ValueError, TypeError) as exc:
        raise ApiError(400, f"invalid sampling parameters: {exc}") from None


def submit(engine: EngineLoop, gen: Gen) -> asyncio.Queue[Delta]:
    try:
        gen.out = engine.submit(
            gen.rid, gen.prompt, gen.max_tokens, gen.sampling, gen.salt, gen.stop_ids
        )
    except Overloaded as exc:
        raise ApiError(
            429,
            f"the server is overloaded: {exc}; retry later",
            type="rate_limit_exceeded",
            code="overloaded",
        ) from None
    except Unavailable as exc:
        raise ApiError(503, str(exc), type="service_unavailable") from None
    return gen.out


async def _watch_disconnect(http: HttpRequest, out: asyncio.Queue[Delta]) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            out.put_nowait(Delta([], None, "disconnect"))
            return


def delta_error(delta: Delta) -> ApiError:
    status = delta.status or 500
    kind = {400: "invalid_request_error", 503: "service_unavailable"}.get(status, "server_error")
    return ApiError(status, delta.error or "the request failed", type=kind, code=delta.code)


async def run(
    engine: EngineLoop, backend: Backend, gen: Gen, out: asyncio.Queue[Delta], http: HttpRequest
) -> AsyncGenerator[str, None]:
    """Drive `gen` (already `submit`ted, its deltas arrive in `out`) to its end, yielding text.

    A client disconnect ends the iteration with finish_reason "disconnect"; leaving early for any
    reason aborts the request in the step loop, which frees its blocks.
    """
    watcher = asyncio.ensure_future(_watch_disconnect(http, out))
    finished = False
    try:
        while gen.finish_reason is None:
            delta = await out.get()
            if delta.error is not None:
                finished = delta.finished
                raise delta_error(delta)
            if delta.finish_reason == "disconnect":
                gen.finish_reason = "disconnect"
                return
            if delta.cached_tokens is not None:
                gen.cached_tokens = delta.cached_tokens
            if delta.cached_by_medium is not None:
                gen.cached_by_medium = delta.cached_by_medium
            if delta.store_view is not None:
                gen.store_view = delta.store_view
            gen.token_ids.extend(delta.token_ids)
            finished = delta.finish_reason is not None
            text = advance(backend.tokenizer, gen.text_state, gen.token_ids, finished)
            if gen.text_state.stopped:
                gen.finish_reason = "stop"
            elif finished:
                gen.finish_reason = delta.finish_reason
            if text:
                yield text
    finally:
        watcher.cancel()
        engine.release(gen.rid, finished)
