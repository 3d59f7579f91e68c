"""The workload's requests on their way to the router.

A request is ready once it has arrived and every request it depends on (`after`, `history`)
has finished, on whichever replica that ran. Its tokens are resolved then (a history quotes the
finished request's prompt and output), because the router needs them to choose a replica; a
history is forgotten once its last reader has resolved it. A prompt of trace blocks comes with
the chain digests of its complete blocks (`Arrivals.prefix`), so the router hashes only the rest.
"""

from __future__ import annotations

import array
from collections.abc import Iterator

from kvreuse.sim.blockchains import BlockChains
from kvreuse.sim.feed import Arrivals
from kvreuse.sim.workload import WorkloadRequest


class FleetFeeder(Arrivals):
    """Releases each request to the router as soon as it is ready, with its tokens."""

    def __init__(
        self,
        workload: list[WorkloadRequest],
        max_model_len: int | None,
        chains: BlockChains | None = None,
    ) -> None:
        super().__init__(workload, max_model_len, chains)
        self.num_released = 0

    @property
    def done(self) -> bool:
        """Every request was released to the router."""
        return self.num_released == len(self.workload)

    def release(self, clock: float) -> Iterator[tuple[int, float, array.array[int], list[bytes]]]:
        """(workload index, ready since, tokens, the digests they start with) of each request
        ready at `clock`, in workload order."""
        for i, since in self.due(clock):
            tokens = self.tokens(i)
            self.num_released += 1
            yield i, since, tokens, self.prefix(i, tokens)
