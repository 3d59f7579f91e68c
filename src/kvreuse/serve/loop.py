"""The step loop: one thread owns the scheduler and the cache manager (spec §3, concurrency).

The asyncio side never touches them. It posts commands (add, abort, or any function of the
backend, e.g. a metrics snapshot or a reset) into a thread-safe inbox; the thread runs them
between steps, steps while there is work, and blocks on the inbox when there is none. After each
step it pushes each request's new tokens to that request's asyncio.Queue with
`loop.call_soon_threadsafe`.

One request never stops the loop:

* a command that raises fails only its own caller (a 400 for a request the core refuses);
* a step that raises (in the engine, the core or the scheduler) is discarded through the core's
  `discard`, and only the requests planned in it fail (500); the loop goes on;
* only when that recovery itself fails (or the manager's invariants no longer hold) is the loop
  truly broken: then every queued command and every open request fails at once, `alive` turns
  false (`/health` answers 503) and `on_fatal` tells the server to exit non-zero.

KV events: with an `events` sink (a `kvreuse.events.Publisher`), the thread hands it the
manager's events after every step, before the step's tokens reach their requests (so a router
has them queued by the time a client sees its answer), and after every command (a finish, an
abort, a reset). Without one the manager's event log is switched off, so it costs nothing. A
publish that fails is logged and counted; it never stops the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from kvreuse.core import Event, Request, StepPlan
from kvreuse.serve.backend import Backend
from kvreuse.serve.defaults import MAX_PENDING

log = logging.getLogger("kvreuse.serve")

T = TypeVar("T")


class EventSink(Protocol):
    """Where the step loop sends the manager's events (`kvreuse.events.Publisher`)."""

    def publish(self, events: Sequence[Event]) -> None: ...

    def close(self, timeout: float = ...) -> None: ...


class Overloaded(RuntimeError):
    """Too many requests in flight (HTTP 429)."""


class Unavailable(RuntimeError):
    """The step loop is stopped or failed (HTTP 503)."""


@dataclass(slots=True)
class Delta:
    """New output of one request since the previous delta."""

    token_ids: list[int]
    cached_tokens: int | None = None  # set once the request is admitted
    finish_reason: str | None = None  # "length" | "stop" | "error" | "disconnect"
    error: str | None = None
    status: int = 0  # with `error`: the HTTP status to answer (400, 500, 503)
    code: str | None = None
    finished: bool = True  # with `error`: the loop has already forgotten the request
    # with tiers below the cache, once admitted: the cached tokens by where they came from
    cached_by_medium: dict[str, int] | None = None
    # with a shared store, once admitted: the store's view it was admitted on (Backend.store_view)
    store_view: str | None = None


@dataclass(slots=True)
class _Active:
    rid: str
    out: asyncio.Queue[Delta]
    sent: int = 0
    cached_sent: bool = False


@dataclass(slots=True)
class _Command:
    run: Callable[[], None]
    fail: Callable[[str], None]  # the loop cannot run it: tell whoever waits


@dataclass(slots=True)
class LoopStats:
    """Counters only the loop thread writes (read through `EngineLoop.call`)."""

    steps: int = 0
    preemptions: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)
    aborted: int = 0
    failed_steps: int = 0
    failed_publishes: int = 0  # event batches the sink refused (logged; the loop goes on)


class _EngineGuard:
    """Wraps the scheduler's engine to remember the step it was handed (to discard it)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.step: StepPlan | None = None

    def __call__(self, step: StepPlan, seqs: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
        self.step = step
        return self.inner(step, seqs)


class EngineLoop:
    """Runs `backend.scheduler` in a background thread; bounded by `max_pending` requests."""

    def __init__(
        self, backend: Backend, max_pending: int = MAX_PENDING, events: EventSink | None = None
    ) -> None:
        self.backend = backend
        self.max_pending = max_pending
        self.events = events
        self.stats = LoopStats()
        self._inbox: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders puts against closing the inbox
        self._closed = False
        self._active: dict[str, _Active] = {}  # loop thread only
        self._pending = 0  # event-loop side: requests submitted and not yet released
        self._aio: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.failure: str | None = None
        self.on_fatal: Callable[[str], None] | None = None  # called on the event loop

    # ------------------------------------------------------------------ lifecycle
    def start(self, aio: asyncio.AbstractEventLoop) -> None:
        self._aio = aio
        self._thread = threading.Thread(target=self._run, name="kvreuse-step-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    @property
    def pending(self) -> int:
        return self._pending

    # ------------------------------------------------------------------ event-loop side
    def _put(self, cmd: _Command) -> None:
        with self._lock:
            if self._closed or not self.alive:
                raise Unavailable(self.failure or "the step loop is not running")
            self._inbox.put(cmd)

    def submit(
        self,
        rid: str,
        prompt: list[int],
        max_tokens: int,
        sampling: Any,
        cache_salt: str | None = None,
        stop_ids: frozenset[int] = frozenset(),
    ) -> asyncio.Queue[Delta]:
        if self._pending >= self.max_pending:
            raise Overloaded(f"{self._pending} requests are in flight (limit {self.max_pending})")
        out: asyncio.Queue[Delta] = asyncio.Queue()
        req = Request(rid, prompt_token_ids=prompt, cache_salt=cache_salt or None)

        def add() -> None:
            try:
                self.backend.scheduler.add(
                    req, max_tokens, sampling=sampling, stop_token_ids=stop_ids
                )
            except (ValueError, TypeError) as exc:  # the handler validated; this is a backstop
                self._post(out.put_nowait, Delta([], 0, "error", str(exc), 400))
            else:
                self._active[rid] = _Active(rid, out)

        def fail(why: str) -> None:
            self._post(out.put_nowait, Delta([], None, "error", why, 503))

        self._put(_Command(add, fail))
        self._pending += 1
        return out

    def release(self, rid: str, finished: bool) -> None:
        """The handler is done with `rid`: abort it unless it finished (client went away)."""
        self._pending -= 1
        if not finished:
            with contextlib.suppress(Unavailable):
                self._put(_Command(lambda: self._abort(rid), lambda _: None))

    async def call(self, fn: Callable[[Backend], T]) -> T:
        """Run `fn(backend)` on the loop thread between steps and return its result."""
        assert self._aio is not None
        fut: asyncio.Future[T] = self._aio.create_future()

        def run() -> None:
            try:
                result = fn(self.backend)
            except BaseException as exc:  # handed to the awaiting coroutine
                self._post(_set_exception, fut, exc)
            else:
                self._post(_set_result, fut, result)

        def fail(why: str) -> None:
            self._post(_set_exception, fut, Unavailable(why))

        self._put(_Command(run, fail))
        return await fut

    def shed_waiting(self, why: str) -> None:
        """Fail every request not yet admitted (a draining server starts nothing new)."""
        with contextlib.suppress(Unavailable):
            self._put(_Command(lambda: self._shed(why), lambda _: None))

    # ------------------------------------------------------------------ loop thread
    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._aio is not None
        # RuntimeError: the event loop is closed, nobody is listening any more
        with contextlib.suppress(RuntimeError):
            self._aio.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        sched = self.backend.scheduler
        if not isinstance(sched.engine, _EngineGuard):
            sched.engine = _EngineGuard(sched.engine)
        # record events only for a sink; what was recorded before (the cache's history since
        # the manager was made) goes out with the first batch
        self.backend.mgr.set_event_log(self.events is not None)
        try:
            while True:
                block = not sched.has_work()
                try:
                    cmd = self._inbox.get(block=block)
                    while True:
                        if cmd is None:
                            return
                        self._run_command(cmd)
                        cmd = self._inbox.get_nowait()
                except queue.Empty:
                    pass
                if sched.has_work():
                    self._step()
        except BaseException as exc:  # recovery failed: the manager cannot be trusted
            self._fatal(f"the step loop failed: {type(exc).__name__}: {exc}")
        finally:
            for act in self._active.values():
                self._post(act.out.put_nowait, _shutting_down())
            self._active.clear()

    def _run_command(self, cmd: _Command) -> None:
        try:
            cmd.run()
        except Exception as exc:  # a command's own failure is its caller's alone
            log.error("a step-loop command failed: %s: %s", type(exc).__name__, exc)
            cmd.fail(f"internal error: {type(exc).__name__}: {exc}")
            self.backend.mgr.check_invariants()  # raises into _run when the core is hurt
        self._publish()

    def _publish(self) -> None:
        """Hand the manager's pending events to the sink; a failure is logged, never raised."""
        if self.events is None:
            return
        try:
            events = self.backend.mgr.take_events()
            if events:
                self.events.publish(events)
        except Exception as exc:  # the events are lost; the requests are not
            self.stats.failed_publishes += 1
            log.error("KV events could not be published: %s: %s", type(exc).__name__, exc)

    def _fatal(self, why: str) -> None:
        with self._lock:
            self.failure = why
            self._closed = True
        log.critical("%s; failing every request and stopping the server", why)
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd is not None:
                cmd.fail(why)
        for act in self._active.values():
            self._post(act.out.put_nowait, Delta([], None, "error", why, 503))
        self._active.clear()
        if self.on_fatal is not None:
            self._post(self.on_fatal, why)

    def _step(self) -> None:
        sched = self.backend.scheduler
        guard = sched.engine
        if isinstance(guard, _EngineGuard):
            guard.step = None
        try:
            st = sched.step()
        except Exception as exc:
            self._recover(exc, guard.step if isinstance(guard, _EngineGuard) else None)
            self._publish()
            return
        self._publish()
        self.stats.steps += 1
        self.stats.preemptions += len(st.preempted)
        for act in list(self._active.values()):
            try:
                self._emit(act)
            except Exception as exc:
                self._fail_requests([act.rid], f"{type(exc).__name__}: {exc}")

    def _recover(self, exc: Exception, step: StepPlan | None) -> None:
        """Discard the failed step and fail its requests; raises when that is impossible."""
        why = f"{type(exc).__name__}: {exc}"
        log.error("a step failed (%s); failing its requests, the server goes on", why)
        self.stats.failed_steps += 1
        mgr = self.backend.mgr
        if step is None:  # failed before the engine ran: seal what was planned so far
            step = mgr.seal_step()
        if step.requests:
            # ValueError: the step was already settled (the failure came after its commit)
            with contextlib.suppress(ValueError):
                mgr.discard(step.step_id)
        culprits = [p.request_id for p in step.requests]
        if not culprits:
            raise RuntimeError(f"a step failed with no request to blame ({why})") from exc
        self._fail_requests(culprits, why)
        mgr.check_invariants()

    def _fail_requests(self, rids: list[str], why: str) -> None:
        sched = self.backend.scheduler
        for rid in rids:
            seq = sched.seqs.get(rid)
            if seq is not None and seq.finished and seq.running:
                seq.finished = False  # ended by the failed step, not yet finished in the core
            if seq is not None and not seq.finished:
                sched.abort(rid)
            act = self._active.get(rid)
            self._forget(rid, "error")
            if act is not None:
                msg = f"the request failed in the step loop: {why}"
                self._post(act.out.put_nowait, Delta([], None, "error", msg, 500, "step_failed"))

    def _shed(self, why: str) -> None:
        sched = self.backend.scheduler
        for seq in list(sched.waiting):
            act = self._active.get(seq.request_id)
            if seq.cached_tokens is None and act is not None:  # never admitted
                sched.abort(seq.request_id)
                self._forget(seq.request_id, "abort")
                self._post(act.out.put_nowait, Delta([], None, "error", why, 503, "shutting_down"))

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
            msg = "the request exceeds the cache"
            self._post(act.out.put_nowait, Delta([], 0, "error", msg, 400))
            return
        cached = by_medium = view = None
        if seq.cached_tokens is not None and not act.cached_sent:
            cached, act.cached_sent = seq.cached_tokens, True
            by_medium = self.backend.cached_by_medium(act.rid, cached)
            view = self.backend.store_view()  # the step just run admitted it
        if not new and reason is None and cached is None:
            return
        act.sent += len(new)
        if reason is not None:
            self._forget(act.rid, reason)
            cached = seq.cached_tokens or 0
        delta = Delta(new, cached, reason, cached_by_medium=by_medium, store_view=view)
        self._post(act.out.put_nowait, delta)

    def _abort(self, rid: str) -> None:
        sched = self.backend.scheduler
        if rid in self._active:
            sched.abort(rid)  # a no-op for a request that has just finished
            self._forget(rid, "abort")
            self.stats.aborted += 1

    def _forget(self, rid: str, reason: str) -> None:
        self._active.pop(rid, None)
        sched = self.backend.scheduler
        seq = sched.seqs.get(rid)
        if seq is not None and seq.finished:
            sched.pop_finished(rid)  # bounded memory on a long-running server
        done = self.stats.requests_finished
        done[reason] = done.get(reason, 0) + 1


def _shutting_down() -> Delta:
    return Delta([], None, "error", "the server is shutting down", 503, "shutting_down")


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
