"""The routable mode: the attention group as a router that reads only that group should see it.

A router that indexes one attention group predicts, for a request, the longest run of leading
blocks it has seen published. On a hybrid that over-predicts whenever the attention KV is
resident but the rest of the model cannot resume there (no recurrent state at that boundary,
a sliding window not covered, a drafter's margin). This filter keeps its own exact copy of
every group's index, fed by the core's events, and publishes the attention entry at boundary k
while it, or an entry below it, is `routable`: a request sharing the prefix up to k would reuse
all k tokens (the core's lookup says so), so the router's contiguous match can reach every
routable boundary. It retracts an entry with `BlockRemoved` as soon as neither holds any more
(the state was evicted, for example).

What an unmodified router then predicts: for a request whose deepest routable boundary on its
path is r, and which matches published blocks up to m ≥ r, it predicts m. It is exact when m = r
(dense recurrent retention, pure attention, every boundary routable) and over-predicts by m − r
when the request diverges between two routable boundaries of a longer published chain. In drop
mode a drafter proves k only together with k + u, so k is judged for a request that continues
along a resident child; a request that diverges right after k is over-predicted by one unit.

How it stays cheap (the state is described in `routable_tree`). Outside drop mode the lookup's
answer for a prefix ending at k reduces to: the entry at k is in every group that needs a key
there (full, sliding, recurrent); every page end on the path up to k is in every full-attention
group (the parent is covered, a flag moved only below a page-end key that changed); and every
page a window still needs is complete (a short walk, sliding and chunked groups only). So a
unit is judged only when something it depends on changed. A new run hangs below units nothing
else names: each of its units gets its index entry and one dict entry, and it is covered,
judged, published and put on the wire as slices of its own chain and flags, in C, with no
Python step per unit. The cache evicts a chain from its end, one unit with no child at a time:
that unit is retracted and forgotten in a few steps, and the unit above it stays published
while it is routable. Drop mode, rare and not on the hot path, asks the core's lookup itself
for each unit that passes those conditions. Removals take effect at once, stores are judged
once per batch, and a batch goes out as its net change: removals (deepest first), then stores
(every parent before its child).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from itertools import compress, pairwise, repeat
from operator import itemgetter

from kvreuse.core import AllBlocksCleared as CoreCleared
from kvreuse.core import BlockRemoved as CoreRemoved
from kvreuse.core import BlockStored as CoreStored
from kvreuse.core import Event, Geometry, GroupGeometry
from kvreuse.core.spi import Stage
from kvreuse.events.routable_tree import CAME, COV, PUB, ROUT, SET_PUB_CAME, Run, UnitTree
from kvreuse.events.routable_wire import emit_removed, emit_stored
from kvreuse.events.wire import AllBlocksCleared, WireEvent

_HASH_AND_BOUNDARY = itemgetter(0, 1)  # a StoredEntry's (hash, boundary)
_HASH = itemgetter(0)


def _pieces(ev: CoreStored, hash_unit: int) -> list[CoreStored]:
    """A run cut where its entries stop being one unit apart (the core sends attention runs
    whole, so this is only a safeguard); each piece keeps the run's tokens and chain."""
    entries = ev.entries
    cuts = [
        0,
        *(
            i
            for i in range(1, len(entries))
            if entries[i].boundary - entries[i - 1].boundary != hash_unit
        ),
    ]
    cuts.append(len(entries))
    return [
        replace(ev, entries=entries[a:b], successor_token_ids=ev.successor_token_ids[a:b])
        for a, b in pairwise(cuts)
    ]


class RoutableFilter(UnitTree):
    """Core events in, the routable attention group's wire events out."""

    def __init__(self, geo: Geometry) -> None:
        super().__init__(geo)
        # a new run is judged at once, in C, unless windows or the drafter's margin need more
        self.judge_runs = geo.caching_enabled and not self.drop and not self.windowed
        self.att_page = self.groups[self.gid].page_size

    def convert(self, events: Iterable[Event]) -> list[WireEvent]:
        out: list[WireEvent] = []
        gid, groups = self.gid, self.groups
        for ev in events:
            if isinstance(ev, CoreRemoved):
                if ev.group_id == gid:
                    self._removed_attention(ev.hash)
                elif ev.group_id in groups:
                    self.index[ev.group_id].pop(ev.hash, None)
                    if ev.hash in self.node:
                        self._judge_after_removal(ev.group_id, ev.hash)
            elif isinstance(ev, CoreStored):
                if ev.group_id == gid:
                    self._stored_attention(ev)
                elif ev.group_id in groups:
                    self._stored_other(ev)
            elif isinstance(ev, CoreCleared):
                self.reset()
                out.append(AllBlocksCleared())
        self._settle()
        if self.gone:
            emit_removed(out, gid, self.gone)
            self.gone.clear()
        if self.touched:
            emit_stored(out, self, self.came())
        return out

    # ------------------------------------------------------------------ stores
    def _stored_attention(self, ev: CoreStored) -> None:
        u, entries = self.hash_unit, ev.entries
        first, last = entries[0].boundary, entries[-1].boundary
        if last - first != (len(entries) - 1) * u:
            for piece in _pieces(ev, u):
                self._stored_attention(piece)
            return
        r = Run(ev, u)
        hs = r.chain[r.i0 :]  # the entries' hashes: the run's chain from its first entry
        self.att.update(zip(hs, self.bounds(first, last), strict=True))
        parent = None if first == u else r.chain[r.i0 - 1]
        node = self.node
        if node.keys().isdisjoint(hs) and self.extra.keys().isdisjoint(hs):
            # new units that nothing hangs below yet: the whole chain at once
            node.update(zip(hs, repeat(r)))
            r.owned = True
            self.link(parent, hs[0])
            if self.flag(parent, COV):
                self._cover_run(r, hs, parent)
        else:
            new = 0
            for h, p in zip(hs, (parent, *hs), strict=False):
                if h in node:
                    self.holes.pop(h, None)  # back in the index
                else:
                    node[h] = r
                    self.link(p, h)
                    new += 1
                self.dirty.add(h)
                self.cover(h)
            r.owned = new == len(hs)
        if self.drop and parent is not None:
            self.dirty.add(parent)  # a new resident child: the parent is judged through it

    def _cover_run(self, r: Run, hs: Sequence[bytes], parent: bytes | None) -> None:
        """A new chain below a covered parent: covered if every page end on it has its key in
        the other full groups too (its own were just stored), and then judged at once."""
        for page, idx in self.full_pages:
            ends = hs[(-r.first) % page // self.hash_unit :: page // self.hash_unit]
            if idx is not self.att and not all(map(idx.__contains__, ends)):
                self.dirty.update(hs)  # some page end is missing: unit by unit
                self.cover(hs[0])
                return
        if not self.judge_runs:
            r.flags[:] = bytes((COV,)) * r.num_entries
            self.dirty.update(hs)
            return
        # routable where every other group that needs a key at the boundary has one
        good: Sequence[int] = range(r.num_entries)
        for idx in self.keyed_others:
            good = list(compress(good, map(idx.__contains__, hs)))
        if len(good) == r.num_entries:
            r.flags[:] = bytes((COV | ROUT,)) * r.num_entries
        else:
            r.flags[:] = bytes((COV,)) * r.num_entries
            for j in good:
                r.flags[j] |= ROUT
        if good:  # publish up to the deepest routable unit
            deepest = good[-1] + 1
            r.flags[:deepest] = r.flags[:deepest].translate(SET_PUB_CAME)
            self.touched.add(r)
            if parent is not None and not self.flag(parent, PUB):
                self.publish_path(parent)

    def _stored_other(self, ev: CoreStored) -> None:
        g = self.groups[ev.group_id]
        self.index[g.group_id].update(map(_HASH_AND_BOUNDARY, ev.entries))
        node = self.node
        known = list(filter(node.__contains__, map(_HASH, ev.entries)))
        if not known:
            return
        self.dirty.update(known)
        if self.drop:
            self.dirty.update(p for p in map(self.parent, known) if p is not None)
        if not g.is_attention:
            return  # a state moves only its own boundary
        for e in ev.entries:
            if e.boundary % g.page_size == 0 and e.hash in node:
                if g.stage is Stage.FULL:
                    self.cover(e.hash)
                else:
                    self._mark_below(e.hash, _reach(g))

    def _mark_below(self, h: bytes, reach: int) -> None:
        """Judge the known units below `h` down to `reach` tokens (a window page changed)."""
        limit = self.boundary(h) + reach
        stack = self.kids_of(h)
        while stack:
            x = stack.pop()
            if self.boundary(x) <= limit:
                self.dirty.add(x)
                if self.drop and (p := self.parent(x)) is not None:
                    self.dirty.add(p)
                stack.extend(self.kids_of(x))

    # ------------------------------------------------------------------ removals
    def _removed_attention(self, h: bytes) -> None:
        b = self.att.pop(h, None)
        if b is None:
            return  # not in the index (every unit there is known)
        r = self.node[h]
        j = (b - r.first) // self.hash_unit
        k = r.i0 + j + 1
        if h in self.extra or (k < len(r.chain) and r.chain[k] in self.node):
            self.holes[h] = b  # children name it: it stays known, out of the index
            if self.drop or b % self.att_page == 0:
                self._judge_after_removal(self.gid, h)
            elif r.flags[j] & ROUT:  # (only h itself needed that key)
                r.flags[j] &= ~ROUT
                self.unpublish(h)
            return
        if self.drop:
            self.holes[h] = b
            self._judge_after_removal(self.gid, h)
            self.forget(h)
            return
        # The common case (the cache evicts a chain from its end): a unit no known unit names
        # as parent. Nothing below it to judge again; it is no longer routable, and forgotten.
        f = r.flags[j]
        if f & PUB and not f & CAME:
            self.gone[h] = b
        r.flags[j] = 0
        del self.node[h]
        self.dirty.discard(h)
        if r.owned:
            if j == r.num_entries - 1:
                r.num_entries = j  # the run just gets shorter
            else:
                r.owned = False
        if b == self.hash_unit:
            return
        p = r.chain[k - 2]
        if p in self.extra:
            self.unlink(p, h)
        fp = r.flags[j - 1] if j and self.node.get(p) is r else self.flag(p, PUB | ROUT)
        if fp & PUB and not fp & ROUT:
            self.unpublish(p)
        if p not in self.att:
            self.forget(p)

    def _judge_after_removal(self, gid: int, h: bytes) -> None:
        """A key of the known unit `h` left group `gid`: judge again every routable unit whose
        answer can depend on it."""
        g = self.groups[gid]
        hit = [h]
        if self.drop and (p := self.parent(h)) is not None:
            hit.append(p)
        if self.boundary(h) % g.page_size == 0:
            if g.stage is Stage.FULL:
                hit += self.uncover(h)
            elif g.is_attention:
                hit += self._published_below(h, _reach(g))
        for x in hit:
            if self.flag(x, ROUT) and not self.judge(x):
                r, j = self.at(x)
                r.flags[j] &= ~ROUT
                self.unpublish(x)

    def _published_below(self, h: bytes, reach: int) -> list[bytes]:
        """The published units below `h` down to `reach` tokens: every routable one among them
        (a routable unit's ancestors are all published)."""
        found: list[bytes] = []
        if not self.flag(h, PUB):
            return found
        limit = self.boundary(h) + reach
        stack = [h]
        while stack:
            for c in self.kids_of(stack.pop()):
                if self.flag(c, PUB) and self.boundary(c) <= limit:
                    found.append(c)
                    stack.append(c)
        return found

    # ------------------------------------------------------------------ the batch's end
    def _settle(self) -> None:
        """Judge the units the batch's stores touched; publish what became routable."""
        dirty = self.dirty
        if not dirty:
            return
        good: list[bytes] = []
        if self.geo.caching_enabled:
            good = list(filter(self.att.__contains__, dirty))
            for idx in self.keyed_others:
                good = list(filter(idx.__contains__, good))
            good = [h for h in good if self.flag(self.parent(h), COV)]
            if self.drop or self.windowed:
                good = list(filter(self.judge_rest, good))
        for h in dirty.difference(good):  # (removals judge at once: never, in practice)
            if h in self.node and self.flag(h, ROUT):
                r, j = self.at(h)
                r.flags[j] &= ~ROUT
                self.unpublish(h)
        dirty.clear()
        for h in good:
            r, j = self.at(h)
            if not r.flags[j] & ROUT:
                r.flags[j] |= ROUT
                self.publish_path(h)


def _reach(g: GroupGeometry) -> int:
    """How far below a window group's page end a change of its key can move `routable`."""
    return g.reach() + 2 * g.page_size
