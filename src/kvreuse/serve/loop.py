"""The step loop: one thread owns the scheduler and the cache manager (spec §3, concurrency).

The asyncio side never touches them. It posts commands (add, abort, or any function of the
backend, e.g. a metrics snapshot or a reset) into a thread-safe inbox; the thread runs them
between steps, steps while there is work, and blocks on the inbox when there is none. After each
step it pushes each request's new tokens to that request's asyncio.Queue with
`loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvreuse.core import Request
from kvreuse.serve.backend import Backend

log = logging.getLogger("kvreuse.serve")

T = TypeVar("T")


class Overloaded(RuntimeError):
    """Too many requests in flight (HTTP 429)."""


class Unavailable(RuntimeError):
    """The step loop is stopped or failed (HTTP 503)."""


@dataclass(slots=True)
class Delta:
    """New output of one request since the previous delta."""

    token_ids: list[int]
    cached_tokens: int | None = None  # set once the request is admitted
    finish_reason: str | None = None  # "length" | "stop" | "error"
    error: str | None = None


@dataclass(slots=True)
class _Active:
    rid: str
    out: asyncio.Queue[Delta]
    sent: int = 0
    cached_sent: bool = False


@dataclass(slots=True)
class LoopStats:
    """Counters only the loop thread writes (read through `EngineLoop.call`)."""

    steps: int = 0
    preemptions: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)
    aborted: int = 0


class EngineLoop:
    """Runs `backend.scheduler` in a background thread; bounded by `max_pending` requests."""

    def __init__(self, backend: Backend, max_pending: int = 256) -> None:
        self.backend = backend
        self.max_pending = max_pending
        self.stats = LoopStats()
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._active: dict[str, _Active] = {}  # loop thread only
        self._pending = 0  # event-loop side: requests submitted and not yet released
        self._aio: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.failure: str | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, aio: asyncio.AbstractEventLoop) -> None:
        self._aio = aio
        self._thread = threading.Thread(target=self._run, name="kvreuse-step-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join()
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    # ------------------------------------------------------------------ event-loop side
    def submit(
        self,
        rid: str,
        prompt: list[int],
        max_tokens: int,
        sampling: Any,
        cache_salt: str | None = None,
        stop_ids: frozenset[int] = frozenset(),
    ) -> asyncio.Queue[Delta]:
        if not self.alive:
            raise Unavailable(self.failure or "the step loop is not running")
        if self._pending >= self.max_pending:
            raise Overloaded(f"{self._pending} requests are in flight (limit {self.max_pending})")
        self._pending += 1
        out: asyncio.Queue[Delta] = asyncio.Queue()
        req = Request(rid, prompt_token_ids=prompt, cache_salt=cache_salt or None)
        act = _Active(rid, out)

        def add() -> None:
            try:
                self.backend.scheduler.add(
                    req, max_tokens, sampling=sampling, stop_token_ids=stop_ids
                )
            except (ValueError, TypeError) as exc:  # the handler validated; this is a backstop
                self._post(out.put_nowait, Delta([], 0, "error", str(exc)))
            else:
                self._active[rid] = act

        self._inbox.put(add)
        return out

    def release(self, rid: str, finished: bool) -> None:
        """The handler is done with `rid`: abort it unless it finished (client went away)."""
        self._pending -= 1
        if not finished:
            self._inbox.put(lambda: self._abort(rid))

    async def call(self, fn: Callable[[Backend], T]) -> T:
        """Run `fn(backend)` on the loop thread between steps and return its result."""
        if not self.alive:
            raise Unavailable(self.failure or "the step loop is not running")
        assert self._aio is not None
        fut: asyncio.Future[T] = self._aio.create_future()

        def run() -> None:
            try:
                result = fn(self.backend)
            except BaseException as exc:  # handed to the awaiting coroutine
                self._post(_set_exception, fut, exc)
            else:
                self._post(_set_result, fut, result)

        self._inbox.put(run)
        return await fut

    # ------------------------------------------------------------------ loop thread
    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._aio is not None
        # RuntimeError: the event loop is closed, nobody is listening any more
        with contextlib.suppress(RuntimeError):
            self._aio.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        sched = self.backend.scheduler
        try:
            while True:
                block = not sched.has_work()
                try:
                    cmd = self._inbox.get(block=block)
                    while True:
                        if cmd is None:
                            return
                        cmd()
                        cmd = self._inbox.get_nowait()
                except queue.Empty:
                    pass
                if sched.has_work():
                    self._step()
        except BaseException as exc:  # a failed step leaves the manager unusable: fail loudly
            self.failure = f"the step loop failed: {type(exc).__name__}: {exc}"
            log.exception("%s; the server now answers 503", self.failure)
            for act in self._active.values():
                self._post(act.out.put_nowait, Delta([], None, "error", self.failure))
            self._active.clear()
        finally:
            for act in self._active.values():
                self._post(act.out.put_nowait, Delta([], None, "error", "server shutting down"))
            self._active.clear()

    def _step(self) -> None:
        sched = self.backend.scheduler
        st = sched.step()
        self.stats.steps += 1
        self.stats.preemptions += len(st.preempted)
        for act in list(self._active.values()):
            self._emit(act)

    def _emit(self, act: _Active) -> None:
        sched = self.backend.scheduler
        seq = sched.seqs[act.rid]
        # The scheduler ends a request at max_tokens or right after its first stop token (kept
        # in `output`, left out of the answer), and clips drafts accepted past either.
        new = seq.output[act.sent :]
        reason = seq.finish_reason if seq.finished else None
        if reason == "stop":
            new = new[:-1]
        elif reason == "too_large":  # the handler checks the cache size first: a backstop
            self._forget(act.rid, "error")
            self._post(act.out.put_nowait, Delta([], 0, "error", "the request exceeds the cache"))
            return
        cached = None
        if seq.cached_tokens is not None and not act.cached_sent:
            cached, act.cached_sent = seq.cached_tokens, True
        if not new and reason is None and cached is None:
            return
        act.sent += len(new)
        if reason is not None:
            self._forget(act.rid, reason)
            cached = seq.cached_tokens or 0
        self._post(act.out.put_nowait, Delta(new, cached, reason))

    def _abort(self, rid: str) -> None:
        sched = self.backend.scheduler
        if rid in self._active:
            sched.abort(rid)  # a no-op for a request that has just finished
            self._forget(rid, "abort")
            self.stats.aborted += 1

    def _forget(self, rid: str, reason: str) -> None:
        self._active.pop(rid, None)
        sched = self.backend.scheduler
        if rid in sched.seqs:
            sched.pop_finished(rid)  # bounded memory on a long-running server
        done = self.stats.requests_finished
        done[reason] = done.get(reason, 0) + 1


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
