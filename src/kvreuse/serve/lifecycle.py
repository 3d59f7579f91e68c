"""Graceful shutdown: which generations are open, and how a draining server ends them.

On SIGTERM (or any stop of `kvreuse.serve.server.Server`) the server stops accepting
connections, then `drain`:

1. refuses new generations with 503 (`shutting_down`) and fails every request still waiting
   for admission with the same clear error: none of it was computed, another instance can
   serve it;
2. lets running requests finish, up to `drain_timeout` seconds;
3. then stops the rest: each gets an error event and `data: [DONE]` (a stream) or a 503 body,
   never a truncated response; their blocks are freed;
4. waits up to `grace` seconds for those answers to be written.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvreuse.serve.generate import Gen
from kvreuse.serve.loop import Delta, EngineLoop
from kvreuse.serve.protocol import ApiError

log = logging.getLogger("kvreuse.serve")

NOT_STARTED = (
    "the server is shutting down; this request was not started (retry it on another instance)"
)


class Lifecycle:
    def __init__(self, engine: EngineLoop) -> None:
        self.engine = engine
        self.draining = False
        self.open: dict[str, Gen] = {}  # event-loop side only

    def enter(self, gen: Gen) -> None:
        if self.draining:
            raise ApiError(503, NOT_STARTED, type="service_unavailable", code="shutting_down")
        self.open[gen.rid] = gen

    def leave(self, gen: Gen) -> None:
        self.open.pop(gen.rid, None)

    async def _wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.open and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self.open

    async def drain(self, timeout: float, grace: float = 5.0) -> None:
        self.draining = True
        if not self.open:
            return
        log.info("draining: %d open request(s), up to %g s", len(self.open), timeout)
        self.engine.shed_waiting(NOT_STARTED)
        if await self._wait_idle(timeout):
            return
        log.warning("drain timeout: stopping %d request(s)", len(self.open))
        for gen in list(self.open.values()):
            why = (
                f"the server is shutting down: the request was stopped after "
                f"{len(gen.token_ids)} generated tokens (drain timeout {timeout:g} s)"
            )
            if gen.out is not None:
                gen.out.put_nowait(Delta([], None, "error", why, 503, "shutting_down", False))
        await self._wait_idle(grace)
