"""The workload's requests on their way into the scheduler.

A request is ready once it has arrived and every request it depends on (`after`, `history`)
has finished. Ready requests are handed to the scheduler only while its queue holds fewer than
`max_num_seqs`, and their tokens are resolved then: a burst of 20,000 requests costs memory for
the few hundred the scheduler can look at, not for all of them. The scheduler's decisions do not
change: one step looks at no more than `max_num_seqs` waiting requests, and the queue always
holds that many when there are that many ready.
"""

from __future__ import annotations

import array
import heapq
from collections import deque
from typing import Any

from kvreuse.core import Request
from kvreuse.sched import Scheduler, Seq
from kvreuse.sim.blockchains import BlockChains
from kvreuse.sim.workload import WorkloadError, WorkloadRequest, tokens_of


def static_length(prompt: Any) -> int | None:
    """The prompt's length when it quotes no history (known before the run), else None."""
    kind, value = next(iter(prompt.items()))
    if kind == "tokens":
        return len(value)
    if kind in ("random", "blocks"):
        return int(value["len"])
    if kind == "concat":
        parts = [static_length(p) for p in value]
        return None if None in parts else sum(p for p in parts if p is not None)
    return None


class Arrivals:
    """The workload's requests in arrival order, each due once every request it depends on has
    finished: the part of feeding that the single simulator and the fleet's share.

    With `chains`, a prompt of trace blocks comes with the digests of its complete blocks
    (`prefix`), each block path hashed once for the whole run (`kvreuse.sim.blockchains`)."""

    def __init__(
        self,
        workload: list[WorkloadRequest],
        max_model_len: int | None,
        chains: BlockChains | None = None,
    ) -> None:
        self.workload = workload
        self.max_model_len = max_model_len
        self.chains = chains
        index = {w.request_id: i for i, w in enumerate(workload)}
        self.index = index
        self.missing = [0] * len(workload)  # dependencies not finished yet
        self.dependents: dict[int, list[int]] = {}
        self.quotes: dict[str, int] = {}  # history id -> requests that have yet to quote it
        for i, w in enumerate(workload):
            self.check_length(w, static_length(w.prompt))
            deps = w.dependencies()
            self.missing[i] = len(deps)
            for dep in deps:
                self.dependents.setdefault(index[dep], []).append(i)
            for h in w.histories():
                self.quotes[h] = self.quotes.get(h, 0) + 1
        # (arrival, index) of requests whose dependencies have finished
        self.timed = [(w.arrival, i) for i, w in enumerate(workload) if not self.missing[i]]
        heapq.heapify(self.timed)
        self.resolved_at: dict[int, float] = {}  # when the last dependency finished
        self.history: dict[str, array.array[int]] = {}

    def check_length(self, w: WorkloadRequest, num_tokens: int | None) -> None:
        if num_tokens is None:
            return
        if num_tokens == 0:
            raise WorkloadError(f"request {w.request_id!r}: its prompt resolves to no tokens")
        limit = self.max_model_len
        if limit is not None and num_tokens + w.max_tokens > limit:
            raise WorkloadError(
                f"request {w.request_id!r}: {num_tokens:,} prompt tokens + "
                f"{w.max_tokens:,} max_tokens exceed max_model_len {limit:,}"
            )

    def next_arrival(self) -> float | None:
        """When the next request whose dependencies finished arrives (None: none waits)."""
        return self.timed[0][0] if self.timed else None

    def due(self, clock: float) -> list[tuple[int, float]]:
        """(workload index, ready since) of the requests ready at `clock`, in workload order."""
        timed, now = self.timed, []
        while timed and timed[0][0] <= clock:
            now.append(heapq.heappop(timed)[1])
        arrival, resolved = self.workload, self.resolved_at
        return [(i, max(arrival[i].arrival, resolved.pop(i, 0.0))) for i in sorted(now)]

    def tokens(self, i: int) -> array.array[int]:
        """Request i's prompt, resolved now; a history is forgotten once its last reader has it."""
        w = self.workload[i]
        tokens = tokens_of(w.prompt, self.history)
        for h in w.histories():
            self.quotes[h] -= 1
            if not self.quotes[h]:
                del self.quotes[h], self.history[h]
        self.check_length(w, len(tokens))
        return tokens

    def prefix(self, i: int, tokens: array.array[int]) -> list[bytes]:
        """The chain digests request i's prompt `tokens` starts with, from its trace blocks
        (empty without `chains`); asked once per request."""
        if self.chains is None:
            return []
        return self.chains.prefix(self.workload[i], tokens)

    def finished(self, seq: Seq, clock: float) -> None:
        """`seq` finished at `clock`: keep its tokens if a later prompt quotes them, and make the
        requests that waited for it due."""
        rid = seq.request_id
        if self.quotes.get(rid):
            self.history[rid] = tokens_of({"tokens": seq.request.prompt_token_ids}, {})
            self.history[rid].extend(seq.output)
        for j in self.dependents.pop(self.index[rid], ()):
            self.missing[j] -= 1
            if not self.missing[j]:
                self.resolved_at[j] = clock
                heapq.heappush(self.timed, (self.workload[j].arrival, j))


class Feeder(Arrivals):
    """Hands ready requests to one scheduler while its queue is short (the module docstring)."""

    def __init__(
        self,
        workload: list[WorkloadRequest],
        max_model_len: int | None,
        chains: BlockChains | None = None,
    ) -> None:
        super().__init__(workload, max_model_len, chains)
        self.ready: deque[tuple[int, float]] = deque()  # (index, ready since), workload order
        self.arrived: dict[str, float] = {}  # handed-over requests: ready since (their arrival)
        self.num_handed = 0

    @property
    def done(self) -> bool:
        """Every request was handed to the scheduler."""
        return self.num_handed == len(self.workload)

    def release(self, clock: float) -> None:
        """Move the requests that are ready at `clock` to the ready queue, in workload order."""
        self.ready.extend(self.due(clock))

    def feed(self, sched: Scheduler, limit: int) -> None:
        """Hand ready requests to `sched` while its queue is shorter than `limit`."""
        while self.ready and len(sched.waiting) < limit:
            i, since = self.ready.popleft()
            w = self.workload[i]
            tokens = self.tokens(i)
            request = Request(
                w.request_id,
                tokens,
                lora=w.lora,
                cache_salt=w.cache_salt,
                prefix_hashes=self.prefix(i, tokens),
            )
            sched.add(request, w.max_tokens)
            self.arrived[w.request_id] = since
            self.num_handed += 1
