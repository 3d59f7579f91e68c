"""The workload's requests on their way to the router.

A request is ready once it has arrived and every request it depends on (`after`, `history`)
has finished, on whichever replica that ran. Its tokens are resolved then (a history quotes the
finished request's prompt and output), because the router needs them to choose a replica; a
history is forgotten once its last reader has resolved it.
"""

from __future__ import annotations

import array
import heapq
from collections.abc import Iterator

from kvreuse.sched import Seq
from kvreuse.sim.feed import static_length
from kvreuse.sim.workload import WorkloadError, WorkloadRequest, tokens_of


class FleetFeeder:
    def __init__(self, workload: list[WorkloadRequest], max_model_len: int | None) -> None:
        self.workload = workload
        self.max_model_len = max_model_len
        self.index = {w.request_id: i for i, w in enumerate(workload)}
        self.missing = [0] * len(workload)  # dependencies not finished yet
        self.dependents: dict[int, list[int]] = {}
        self.quotes: dict[str, int] = {}  # history id -> requests that have yet to quote it
        for i, w in enumerate(workload):
            self.check_length(w, static_length(w.prompt))
            deps = w.dependencies()
            self.missing[i] = len(deps)
            for dep in deps:
                self.dependents.setdefault(self.index[dep], []).append(i)
            for h in w.histories():
                self.quotes[h] = self.quotes.get(h, 0) + 1
        # (arrival, index) of requests whose dependencies have finished
        self.timed = [(w.arrival, i) for i, w in enumerate(workload) if not self.missing[i]]
        heapq.heapify(self.timed)
        self.resolved_at: dict[int, float] = {}  # when the last dependency finished
        self.history: dict[str, array.array[int]] = {}
        self.num_released = 0

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

    @property
    def done(self) -> bool:
        """Every request was released to the router."""
        return self.num_released == len(self.workload)

    def next_arrival(self) -> float | None:
        """When the next request whose dependencies finished arrives (None: none waits)."""
        return self.timed[0][0] if self.timed else None

    def release(self, clock: float) -> Iterator[tuple[int, float, array.array[int]]]:
        """(workload index, ready since, tokens) of each request ready at `clock`, in workload
        order."""
        timed, now = self.timed, []
        while timed and timed[0][0] <= clock:
            now.append(heapq.heappop(timed)[1])
        for i in sorted(now):
            w = self.workload[i]
            since = max(w.arrival, self.resolved_at.pop(i, 0.0))
            tokens = tokens_of(w.prompt, self.history)
            for h in w.histories():  # forget a history once its last reader has it
                self.quotes[h] -= 1
                if not self.quotes[h]:
                    del self.quotes[h], self.history[h]
            self.check_length(w, len(tokens))
            self.num_released += 1
            yield i, since, tokens

    def finished(self, seq: Seq, clock: float) -> None:
        """`seq` finished at `clock`: keep its tokens if a later prompt quotes them, and make the
        requests that waited for it ready."""
        rid = seq.request_id
        if self.quotes.get(rid):
            self.history[rid] = tokens_of({"tokens": seq.request.prompt_token_ids}, {})
            self.history[rid].extend(seq.output)
        for j in self.dependents.pop(self.index[rid], ()):
            self.missing[j] -= 1
            if not self.missing[j]:
                self.resolved_at[j] = clock
                heapq.heappush(self.timed, (self.workload[j].arrival, j))
