"""Per-kind acceptance (spec §7.2–7.6): does group g accept a hit of x tokens?

    full       x ≤ F_g                 (covering rule: an entry at b ≥ x in page p(x) proves x)
    sliding    pages of [x−W+1, x) have full keys, page p(x) has an entry at b ≥ x
    chunked    like sliding over [⌊x/C⌋·C, x); a chunk start needs nothing
    recurrent  a state at exactly x

The covering rule, full attention, page B = 4u, page 0 complete, page 1 = tokens [B, 2B) with
its only entry at boundary B + 2u (a request that stopped there published it):

    boundary x   B+u    B+2u   B+3u   2B
    accepted     yes    yes    no     no      (the entry at B+2u ≥ x proves every x up to it)

A `Probe` answers for one group, one request and one key set (the index, or the index plus
the keys uncommitted plans would publish); the coordinator in `lookup` combines them.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Container, Sequence
from itertools import compress, islice
from typing import cast

from kvreuse.core.config import GroupGeometry

_FIRST = 256  # pages probed one by one up to the first miss (longer prompts: in chunks)


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


class Probe:
    """Acceptance of one group for one request over one key set (the index, maybe plus the
    pending keys). Subclasses hold one kind's rule; this base adds the drop-mode margin and
    the generic descent."""

    __slots__ = ("g", "hashes", "keys", "nu", "u")
    F = 0  # full attention's covering limit (FullProbe sets it)

    def __init__(
        self, g: GroupGeometry, keys: Container[bytes], hashes: list[bytes], u: int, nu: int
    ) -> None:
        self.g, self.u, self.nu = g, u, nu
        self.keys, self.hashes = keys, hashes

    def ok(self, x: int) -> bool:
        """Whether the group accepts a hit of x tokens (x a multiple of u)."""
        raise NotImplementedError

    def accepts(self, x: int, margin: bool) -> bool:
        if margin and x > 0:
            # Drop-mode margin (7.6). For sliding/chunked drafters we also require x itself:
            # unlike full attention they are not downward-closed (docs/decisions.md, D2).
            return x + self.u <= self.nu and self.ok(x + self.u) and self.ok(x)
        return self.ok(x)

    def decisive(self) -> Sequence[bytes]:
        """The keys whose membership could change this probe's answers: a key set that adds
        none of them (the pending keys of other plans, say) answers exactly as `keys` does."""
        return self.hashes

    def largest(self, c: int, margin: bool) -> int:
        """m_g(c): the largest candidate ≤ c this group accepts (a descent of one unit a step;
        subclasses answer the common cases faster)."""
        x = c
        while x > 0 and not self.accepts(x, margin):
            x -= self.u
        return x


class FullProbe(Probe):
    """Full attention: x ≤ F, where F is the leading run of complete pages plus the highest
    entry in the next page (the covering rule). Downward-closed, so m_g(c) = min(c, F)."""

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


class WindowProbe(Probe):
    """Sliding window and chunked attention: x's own page has an entry at some boundary ≥ x,
    and every page the window (or chunk) of token x still covers below it is complete."""

    __slots__ = ("flags", "full")

    def __init__(
        self, g: GroupGeometry, keys: Container[bytes], hashes: list[bytes], u: int, nu: int
    ) -> None:
        super().__init__(g, keys, hashes, u, nu)
        B = g.page_size
        # One membership flag per boundary, probed in C:
        #   flags[k - 1]  <=>  the boundary k·u has an entry
        #   full[j]       <=>  page j's last boundary (j + 1)·B has one (page j complete)
        self.flags = list(map(keys.__contains__, hashes[1 : nu // u + 1]))
        self.full = self.flags[B // u - 1 :: B // u]

    def ok(self, x: int) -> bool:
        if x == 0:
            return True
        g = self.g
        lo = g.attend_from(x)
        if g.kind == "chunked" and lo == x:
            return True  # a chunk starts at x: nothing before it is attended to
        B, u = g.page_size, self.u
        p = (x - 1) // B
        if x > self.nu:
            return False
        # x's own page holds an entry at some boundary in [x, end of the page]
        if not any(self.flags[-(-x // u) - 1 : min((p + 1) * B, self.nu) // u]):
            return False
        need = p - lo // B  # complete pages below x's page that the window still covers
        return need == 0 or (p >= need and all(self.full[p - need : p]))

    def largest(self, c: int, margin: bool) -> int:
        if margin or c % self.u or self.g.kind != "sliding":
            return super().largest(c, margin)
        return self._largest_window(c)

    def _largest_window(self, c: int) -> int:
        """m_g(c) for a sliding group, a page at a time instead of a unit at a time.

        Within x's page, ok(x) needs an entry at some boundary in [x, page end] and complete
        pages back to the window's start. The best x ≤ c of page p is min(c, top entry of p);
        if the window test fails there it fails for every lower x of that page too (a lower x
        reaches further back), so the search moves on to page p − 1.
        """
        B, u, flags = self.g.page_size, self.u, self.flags
        x = min(c, self.nu)
        while x > 0:
            p = (x - 1) // B
            first = p * B // u  # flags[first:] are the boundaries of page p
            seg = flags[first : min((p + 1) * B, self.nu) // u]
            if True in seg:
                top = (first + len(seg) - seg[::-1].index(True)) * u
                y = min(x, top)
                if self.ok(y):
                    return y
            x = p * B
        return 0


class StateProbe(Probe):
    """A recurrent group: a state saved at exactly x."""

    __slots__ = ("_present",)

    def __init__(
        self, g: GroupGeometry, keys: Container[bytes], hashes: list[bytes], u: int, nu: int
    ) -> None:
        super().__init__(g, keys, hashes, u, nu)
        self._present: list[int] | None = None  # units with a state, found on first use

    def ok(self, x: int) -> bool:
        return x == 0 or (x <= self.nu and self.hashes[x // self.u] in self.keys)

    def largest(self, c: int, margin: bool) -> int:
        if margin or c % self.u:
            return super().largest(c, margin)
        return self._largest_state(c)

    def _largest_state(self, c: int) -> int:
        """The largest x ≤ c with a state in `keys`, by bisection over the units that have one
        (found once per probe, in C), instead of a descent of one unit per step."""
        if self._present is None:
            n = self.nu // self.u
            flags = map(self.keys.__contains__, self.hashes[1 : n + 1])
            self._present = list(compress(range(1, n + 1), flags))
        i = bisect_right(self._present, c // self.u)
        return self._present[i - 1] * self.u if i else 0


_PROBES: dict[str, type[Probe]] = {
    "full": FullProbe,
    "sliding": WindowProbe,
    "chunked": WindowProbe,
    "recurrent": StateProbe,
}


def make_probe(
    g: GroupGeometry, keys: Container[bytes], hashes: list[bytes], u: int, nu: int
) -> Probe:
    """The acceptance test of group `g` for one request's chain over one key set."""
    return _PROBES[g.kind](g, keys, hashes, u, nu)
