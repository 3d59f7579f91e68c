"""The routable filter's state: the attention units it knows, kept per core run.

A unit is the attention entry at one boundary k, named by its chain hash H[k/u]. The filter
knows a unit from the attention `BlockStored` that first carried it until the unit has left the
index and no known unit names it as parent. Per unit it keeps, besides its index entry, one
dict entry, `node[hash]`: the `Run` (that core event) that carried it first. Everything else is
derived or kept per run:

* the boundary is the index's value (`att`), or `holes` for a unit that left the index but is
  still named by a child; the parent is the unit before it on its run's chain (`unit_hashes`);
  the children are the next unit on that chain when known, plus `extra[hash]` for the others
  (another branch, or a child whose parent is not known yet);
* one flag byte per entry of the run (`Run.flags`): COV (covered: the path is known and every
  page end on it, up to the unit, has its key in every full-attention group), ROUT (routable),
  PUB (published: on the path to a routable unit, what a consumer holds) and CAME (published in
  this batch and not before it). Covered and published units are closed under taking the
  parent, so along one run they are a prefix: a run whose entries are all its own (`owned`) is
  covered, judged and published with a few C-level steps (`translate`, `rfind`) over its flags.
"""

from __future__ import annotations

from itertools import compress
from operator import itemgetter
from typing import Final

from kvreuse.core import BlockStored as CoreStored
from kvreuse.core import Geometry, GroupGeometry, compute_lookup
from kvreuse.core.spi import Stage
from kvreuse.events.convert import attention_group
from kvreuse.events.mirror import HashChain

COV: Final = 1
ROUT: Final = 2
PUB: Final = 4
CAME: Final = 8
ALL_BUT_CAME = bytes(x & ~CAME for x in range(256))  # translate tables over flag bytes
SET_PUB_CAME = bytes(x | PUB | CAME for x in range(256))
IS_PUB = bytes(int(bool(x & PUB)) for x in range(256))
IS_CAME = bytes(int(bool(x & CAME)) for x in range(256))
IS_ROUT = bytes(int(bool(x & ROUT)) for x in range(256))
PUB_NOT_CAME = bytes(int(x & (PUB | CAME) == PUB) for x in range(256))
ALL_BUT_PUB_CAME = bytes(x & ~(PUB | CAME) for x in range(256))
_BOUNDARY_AND_HASH = itemgetter(0, 1)


class Run:
    """An attention `BlockStored` (one chain of units) and the flags of the units it owns."""

    __slots__ = ("chain", "ev", "first", "flags", "i0", "num_entries", "owned")

    def __init__(self, ev: CoreStored, hash_unit: int) -> None:
        self.ev = ev
        self.chain = ev.unit_hashes  # H[token_start/u] … H[last/u]
        self.first = ev.entries[0].boundary
        self.i0 = (self.first - ev.token_start) // hash_unit  # chain[i0 + j] is entry j
        # entries [0, num_entries) are all this run's own while `owned`
        self.num_entries = len(ev.entries)
        self.owned = False
        self.flags = bytearray(self.num_entries)


class UnitTree:
    """The known attention units, every group's index, and what is covered and published."""

    def __init__(self, geo: Geometry) -> None:
        self.geo = geo
        self.hash_unit = geo.hash_unit
        self.gid = attention_group(geo).group_id
        self.drop = geo.spec_mode == "drop"
        self.groups = {g.group_id: g for g in geo.cacheable}
        # per group: key -> boundary of every resident entry (an IndexView for the lookup)
        self.index: list[dict[bytes, int]] = [{} for _ in geo.groups]
        self.att = self.index[self.gid]
        self.full_pages = [
            (g.page_size, self.index[g.group_id]) for g in geo.cacheable if g.stage is Stage.FULL
        ]
        # Outside drop mode a prefix ending at k is accepted only with an entry at k, unless
        # the kind accepts some x with nothing (a chunk start); in drop mode a full or window
        # group may take the one at k + u instead, so only the attention group and the states
        # are required there.
        self.keyed_others = [
            self.index[g.group_id]
            for g in geo.cacheable
            if g.group_id != self.gid
            and (g.stage is Stage.STATE or (not self.drop and not g.fresh_starts))
        ]
        self.windowed = [g for g in geo.cacheable if g.stage is Stage.WINDOW]
        self.boundaries: list[int] = [0]  # k·u at k: shared ints, none made per unit
        self.node: dict[bytes, Run] = {}
        self.holes: dict[bytes, int] = {}  # known unit out of the index -> its boundary
        self.extra: dict[bytes, bytes | list[bytes]] = {}  # parent -> children off its chain
        self.dirty: set[bytes] = set()  # to judge at the end of the batch
        self.touched: set[Run] = set()  # runs with CAME flags
        self.gone: dict[bytes, int] = {}  # retracted during this batch -> boundary

    def in_ghost(self, group_id: int, key: bytes) -> bool:
        return False  # (IndexView) the lookup's reasons are not needed here

    def reset(self) -> None:
        for idx in self.index:
            idx.clear()
        self.node.clear()
        self.holes.clear()
        self.extra.clear()
        self.gone.clear()
        self.dirty.clear()
        self.touched.clear()

    def bounds(self, first: int, last: int) -> list[int]:
        """[first, first + u, …, last] as shared int objects."""
        u, have = self.hash_unit, self.boundaries
        if len(have) <= last // u:
            have.extend(range(len(have) * u, last + u, u))
        return have[first // u : last // u + 1]

    # ------------------------------------------------------------------ one unit
    def boundary(self, h: bytes) -> int:
        b = self.att.get(h)
        return self.holes[h] if b is None else b

    def at(self, h: bytes) -> tuple[Run, int]:
        """A known unit's run and its entry there."""
        r = self.node[h]
        return r, (self.boundary(h) - r.first) // self.hash_unit

    def flag(self, h: bytes | None, bit: int) -> int:
        """`bit` of a unit (0 for an unknown one; COV for None, the empty prefix)."""
        if h is None:
            return bit & COV
        if h not in self.node:
            return 0
        r, j = self.at(h)
        return r.flags[j] & bit

    def parent(self, h: bytes) -> bytes | None:
        r, j = self.at(h)
        return None if r.first + j * self.hash_unit == self.hash_unit else r.chain[r.i0 + j - 1]

    def on_chain(self, h: bytes) -> bytes | None:
        """The unit after `h` on its run's chain (known or not)."""
        r, j = self.at(h)
        k = r.i0 + j + 1
        return r.chain[k] if k < len(r.chain) else None

    def kids_of(self, h: bytes) -> list[bytes]:
        nxt = self.on_chain(h)
        out = [nxt] if nxt is not None and nxt in self.node else []
        more = self.extra.get(h)
        if more is not None:
            out += [c for c in ((more,) if isinstance(more, bytes) else more) if c != nxt]
        return out

    def has_kids(self, h: bytes) -> bool:
        nxt = self.on_chain(h)
        return (nxt is not None and nxt in self.node) or h in self.extra

    def link(self, p: bytes | None, h: bytes) -> None:
        """Record a new unit `h` as a child of `p` (not known yet, maybe)."""
        if p is None or (p in self.node and self.on_chain(p) == h):
            return
        k = self.extra.get(p)
        if k is None:
            self.extra[p] = h
        elif isinstance(k, bytes):
            if k != h:
                self.extra[p] = [k, h]
        elif h not in k:
            k.append(h)

    def unlink(self, p: bytes, h: bytes) -> None:
        k = self.extra.get(p)
        if k == h:
            del self.extra[p]
        elif isinstance(k, list) and h in k:
            k.remove(h)
            if len(k) == 1:
                self.extra[p] = k[0]

    def drop_unit(self, h: bytes, r: Run, j: int) -> None:
        """Forget one unit whose flags say nothing any more (its entry is cleared)."""
        r.flags[j] = 0
        if r.owned and j != r.num_entries - 1:
            r.owned = False  # a hole in the middle: the run's bulk steps stop
        elif r.owned:
            r.num_entries = j  # the cache evicts chains from their end: the run just gets shorter
        del self.node[h]
        self.holes.pop(h, None)
        self.dirty.discard(h)

    def forget(self, h: bytes | None) -> None:
        """Drop units out of the index that no known unit names any more, walking up: along a
        run that owns its entries, up to the first one still in the index or named, at once."""
        while h is not None and h in self.node and h not in self.att and not self.has_kids(h):
            r, j = self.at(h)
            if r.flags[j] & PUB:  # never: an unroutable leaf is retracted before this
                r.flags[j] &= ~ROUT
                self.unpublish(h)
            if r.owned and j == r.num_entries - 1:
                above = r.chain[r.i0 : r.i0 + j]
                keep = bytes(map(self.att.__contains__, above)).rfind(1)
                for x in filter(self.extra.__contains__, above[keep + 1 :]):
                    keep = max(keep, (self.holes[x] - r.first) // self.hash_unit)
                if r.flags[keep + 1 : j].translate(IS_PUB).find(1) < 0:
                    for x in r.chain[r.i0 + keep + 1 : r.i0 + j + 1]:
                        del self.node[x]
                        self.holes.pop(x, None)
                        self.dirty.discard(x)
                    r.flags[keep + 1 : j + 1] = bytes(j - keep)
                    r.num_entries = keep + 1
                    if keep >= 0:
                        return
                    h, p = r.chain[r.i0], None if r.first == self.hash_unit else r.chain[r.i0 - 1]
                    if p is not None:
                        self.unlink(p, h)
                    h = p
                    continue
            p = self.parent(h)
            self.drop_unit(h, r, j)
            if p is not None:
                self.unlink(p, h)
            h = p

    # ------------------------------------------------------------------ covering
    def page_ok(self, h: bytes) -> bool:
        b = self.boundary(h)
        return all(h in idx for page, idx in self.full_pages if b % page == 0)

    def cover(self, h: bytes) -> None:
        """Cover `h` if its parent is covered and its page-end keys are all there, and then its
        descendants the same way; every unit whose parent became covered is to be judged."""
        stack = [h]
        while stack:
            x = stack.pop()
            if x not in self.node:
                continue
            r, j = self.at(x)
            if r.flags[j] & COV or not self.flag(self.parent(x), COV) or not self.page_ok(x):
                continue
            r.flags[j] |= COV
            if self.drop:
                self.dirty.add(x)  # judged through its children's page ends too
            below = self.kids_of(x)
            self.dirty.update(below)
            stack.extend(below)

    def uncover(self, h: bytes) -> list[bytes]:
        """`h` lost a page-end key: it and its covered descendants are no longer covered.
        Returns them and their children (whose parents they are)."""
        hit, stack = [], [h]
        while stack:
            x = stack.pop()
            r, j = self.at(x)
            if not r.flags[j] & COV:
                continue
            r.flags[j] &= ~COV
            below = self.kids_of(x)
            hit.append(x)
            hit.extend(below)
            stack.extend(below)
        return hit

    # ------------------------------------------------------------------ judging
    def judge(self, h: bytes) -> bool:
        """Whether a request sharing the prefix up to `h` would reuse all of it."""
        if not self.geo.caching_enabled or h not in self.att:
            return False
        if not self.flag(self.parent(h), COV):
            return False
        return all(h in idx for idx in self.keyed_others) and self.judge_rest(h)

    def judge_rest(self, h: bytes) -> bool:
        """The part of `judge` that is not a key lookup: windows, or drop mode's lookup."""
        if self.drop:
            return self._drop_ok(h)
        return all(self._window_ok(h, g) for g in self.windowed)

    def _window_ok(self, h: bytes, g: GroupGeometry) -> bool:
        """A window group accepts the prefix ending at `h`: an entry at its boundary b, and a
        key at the end of every page that the window of b still needs (the paged layout's
        rule, from the kind's `attend_from` and `starts_fresh`)."""
        b = self.boundary(h)
        if g.starts_fresh(b):
            return True  # (a chunk starts at b) nothing before it is attended to
        lo = g.attend_from(b)
        idx = self.index[g.group_id]
        if h not in idx:
            return False
        page = g.page_size
        lowest = (lo // page + 1) * page  # the first needed page end; the last is below b
        x, y = self.parent(h), b - self.hash_unit
        while y >= lowest and x is not None:
            if y % page == 0 and x not in idx:
                return False
            x, y = self.parent(x), y - self.hash_unit
        return True

    def _drop_ok(self, h: bytes) -> bool:
        """A drafter in drop mode proves x only together with x + u, so a chain that ends at
        x never reuses x: judge x for a request continuing along a resident child."""
        path: list[bytes] = []
        x: bytes | None = h
        while x is not None:
            path.append(x)
            x = self.parent(x)
        path.append(b"")  # H[0] is never looked up
        path.reverse()
        num_tokens, b = len(path) * self.hash_unit + 1, self.boundary(h)
        for c in self.kids_of(h):
            if c in self.att:
                chain = HashChain([*path, c])
                if compute_lookup(self.geo, self, "routable", chain, num_tokens).hit >= b:
                    return True
        return False

    # ------------------------------------------------------------------ publication
    def publish_path(self, x: bytes | None) -> None:
        """Publish `x` and its ancestors up to the first published one: along a run that owns
        its entries, the whole unpublished stretch at once."""
        while x is not None:
            r, j = self.at(x)
            if r.flags[j] & PUB:
                return
            gone = self.gone
            if r.owned and not (gone and any(map(gone.__contains__, r.chain[r.i0 : r.i0 + j + 1]))):
                k = r.flags[: j + 1].translate(IS_PUB).rfind(1)  # the published part above
                r.flags[k + 1 : j + 1] = r.flags[k + 1 : j + 1].translate(SET_PUB_CAME)
                self.touched.add(r)
                if k >= 0:
                    return
                x = None if r.first == self.hash_unit else r.chain[r.i0 - 1]
            else:
                if gone.pop(x, None) is None:
                    r.flags[j] |= PUB | CAME
                    self.touched.add(r)
                else:  # retracted earlier in this batch: the consumer still holds it
                    r.flags[j] |= PUB
                x = self.parent(x)

    def unpublish(self, h: bytes | None) -> None:
        """Retract `h` and its ancestors while none is routable or has a published child:
        along a run that owns its entries, up to the first unit that stays, at once."""
        while h is not None:
            r, j = self.at(h)
            f = r.flags[j]
            if not f & PUB or f & ROUT or any(self.flag(c, PUB) for c in self.kids_of(h)):
                return
            if not r.owned:
                r.flags[j] = f & ~(PUB | CAME)
                if not f & CAME:
                    self.gone[h] = self.boundary(h)
                h = self.parent(h)
                continue
            # above h on this run every unit is published; the first routable one stays, and
            # so does one with a published child off the run
            stop = r.flags[:j].translate(IS_ROUT).rfind(1)
            for x in filter(self.extra.__contains__, r.chain[r.i0 + stop + 1 : r.i0 + j]):
                i = (self.boundary(x) - r.first) // self.hash_unit
                # (kids_of(x)[0] is x's next unit on this run, the one just retracted)
                if i > stop and any(self.flag(c, PUB) for c in self.kids_of(x)[1:]):
                    stop = i
            self._retract(r, stop + 1, j + 1)
            if stop >= 0:
                return
            h = None if r.first == self.hash_unit else r.chain[r.i0 - 1]

    def _retract(self, r: Run, a: int, b: int) -> None:
        """Unpublish the entries [a, b) of a run that owns them; those published before this
        batch go to `gone`."""
        flags = r.flags[a:b]
        before = compress(range(a, b), flags.translate(PUB_NOT_CAME))
        first = r.first + a * self.hash_unit
        bounds = self.bounds(first, r.first + (b - 1) * self.hash_unit)
        self.gone.update((r.chain[r.i0 + i], bounds[i - a]) for i in before)
        r.flags[a:b] = flags.translate(ALL_BUT_PUB_CAME)

    def came(self) -> list[tuple[int, bytes, Run, int, int]]:
        """This batch's published stretches, (boundary, first hash, run, a, b) for the entries
        [a, b) of a run, CAME flags cleared."""
        out = []
        for r in self.touched:
            mask = r.flags.translate(IS_CAME)
            a = mask.find(1)
            while a >= 0:
                b = mask.find(0, a)
                b = len(mask) if b < 0 else b
                out.append((r.first + a * self.hash_unit, r.chain[r.i0 + a], r, a, b))
                a = mask.find(1, b)
            r.flags[:] = r.flags.translate(ALL_BUT_CAME)
        self.touched.clear()
        out.sort(key=_BOUNDARY_AND_HASH)
        return out
