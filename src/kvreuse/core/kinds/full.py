"""Full attention (spec §7.2): every token attends to every earlier one; the covering rule.

    accepts x  ⇔  x ≤ F,   F = the leading run of complete pages, plus the highest entry in the
                           next page (an entry at b ≥ x in page p(x) proves x)

The covering rule, page B = 4u, page 0 complete, page 1 = tokens [B, 2B) with its only entry at
boundary B + 2u (a request that stopped there published it):

    boundary x   B+u    B+2u   B+3u   2B
    accepted     yes    yes    no     no      (the entry at B+2u ≥ x proves every x up to it)

Full attention is the only kind that may be DCP-sharded (its page is block_size × dcp), and the
only one at the FULL stage: downward-closed, so the lookup's fixed points start below its F.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import cast

from kvreuse.core.kinds.base import GroupGeometry, PlainAsk, Probe, Stage
from kvreuse.core.kinds.paged import PagedGroup

_FIRST = 256  # pages probed one by one up to the first miss (longer prompts: in chunks)


@dataclass(frozen=True, slots=True, kw_only=True)
class FullAttention(PagedGroup):
    kind = "full"
    stage = Stage.FULL
    shardable = True
    wire_kind = "full_attention"

    def probe(self, keys: Container[bytes], hashes: list[bytes], u: int, nu: int) -> Probe:
        return FullProbe(self, keys, hashes, u, nu)

    def accepts_plain(self, ask: PlainAsk, x: int) -> bool:
        return ask.covered(x, 0)


def _full_run(
    keys: Container[bytes], hashes: list[bytes], step: int, num_pages: int, pages: list[int] | None
) -> int:
    """The number of leading pages whose full key is in `keys`.

    The first `_FIRST` pages are probed in one C loop that stops at the first miss
    (`iter(f, sentinel)` calls the `map` iterator's `__next__` until it yields the sentinel),
    so a run of h short of them costs h + 1 probes. Beyond them, `list(map(...))` over chunks
    that grow ×4 costs less per probe, which pays on very long hits. The run cannot be found
    by bisection: the index is not prefix-closed (a page can be evicted while a later one
    stays). With `pages` (a list to fill, for `keys` that map a key to its block), the blocks
    of the run are appended to it from the same probes, so the lookup's slots need no second
    pass over the index.
    """
    probe: Callable[[bytes], object] = keys.__contains__
    miss: object = False
    if pages is not None:
        probe = keys.get  # type: ignore[attr-defined]
        miss = None  # block ids are ≥ 1
    stop = min(_FIRST, num_pages)
    found = list(iter(map(probe, islice(hashes, step, stop * step + 1, step)).__next__, miss))
    if pages is not None:
        pages += cast(list[int], found)
    run, chunk = len(found), 4 * _FIRST
    while run == stop < num_pages:
        stop = min(run + chunk, num_pages)
        found = list(map(probe, hashes[(run + 1) * step : stop * step + 1 : step]))
        cut = found.index(miss) if miss in found else len(found)
        if pages is not None:
            pages += cast(list[int], found[:cut])
        run, chunk = run + cut, chunk * 4
    return run


class FullProbe(Probe):
    """x ≤ F, F computed in one pass. Downward-closed, so m_g(c) = min(c, F)."""

    __slots__ = ("F", "pages")

    def __init__(
        self, g: GroupGeometry, keys: Container[bytes], hashes: list[bytes], u: int, nu: int
    ) -> None:
        self.g, self.u, self.nu, self.keys, self.hashes = g, u, nu, keys, hashes
        B = g.page_size
        step = B // u
        # the blocks of the leading full pages, when `keys` maps keys to blocks (an index)
        self.pages: list[int] | None = [] if hasattr(keys, "get") else None
        base = _full_run(keys, hashes, step, nu // B, self.pages) * B  # page q starts here
        self.F = base
        # Page q, highest boundary first. Its full key at base + B was the run's miss when
        # the page is complete, so the search starts a unit below it.
        start = base + B - u if base + B <= nu else nu
        for b in range(start, base, -u):
            if hashes[b // u] in keys:
                self.F = b
                break

    def ok(self, x: int) -> bool:
        return x <= self.F

    def decisive(self) -> Sequence[bytes]:
        """Page q's boundaries: a superset of `keys` has the same leading run unless it adds
        the full key q missed on, and the same F unless it adds an entry in page q."""
        base, u = self.F // self.g.page_size * self.g.page_size, self.u
        return self.hashes[base // u + 1 : min(base + self.g.page_size, self.nu) // u + 1]

    def largest(self, c: int, margin: bool) -> int:
        return min(c, max(0, self.F - self.u)) if margin else min(c, self.F)
