"""Lookup (spec §7): per-kind acceptance rules, the coordinator's fixed point, reasons, slots.

Every group answers one question, "do you accept a hit of x tokens?", over the candidates
X = {0, u, 2u, …, top}. The hit is the largest x all prefix-cacheable groups accept:

    full       x ≤ F_g                 (covering rule: an entry at b ≥ x in page p(x) proves x)
    sliding    pages of [x−W+1, x) have full keys, page p(x) has an entry at b ≥ x
    chunked    like sliding over [⌊x/C⌋·C, x); a chunk start needs nothing
    recurrent  a state at exactly x

Bounds (12.3) are computed as a chain of restricted fixed points, each started from the
previous bound, which is valid because every later bound is at most the earlier one.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from itertools import compress

from kvreuse.core.config import Geometry, GroupGeometry
from kvreuse.core.pool import NULL, BlockPool
from kvreuse.core.request import RequestState


@dataclass(frozen=True, slots=True)
class LookupResult:
    """What a lookup found (spec §7.8). Pure: computing it changed nothing."""

    request_id: str
    hit: int
    pending_hit: int
    top: int
    n: int
    epoch: int
    reason: str
    junction: int | None
    bounds: tuple[int, int, int, int]
    slots: Mapping[int, list[int]] = field(default_factory=dict)
    copy_src: Mapping[int, int | None] = field(default_factory=dict)
    state_src: Mapping[int, int | None] = field(default_factory=dict)
    group_limits: Mapping[int, int] = field(default_factory=dict)  # m_g(top), for explain()
    # A1…A4 over the index plus the pending keys (D15): pending_bounds[3] is pending_hit, and
    # pending_bounds[2] > bounds[2] says another request is computing more of this prefix in the
    # non-recurrent groups, even when no state will be saved there.
    pending_bounds: tuple[int, int, int, int] = (0, 0, 0, 0)

    def explain(self) -> str:
        """Human-readable account of the hit (format not normative)."""
        a1, a2, a3, a4 = self.bounds
        lines = [
            f"request {self.request_id}: hit {self.hit} of top {self.top} "
            f"(n = {self.n} units), reason {self.reason}",
            f"  bounds: A1 full={a1}  A2 +margin={a2}  A3 non-recurrent={a3}  A4 all={a4}",
        ]
        for g, m in sorted(self.group_limits.items()):
            limiting = "  <- limits the hit" if m == self.hit and m < self.top else ""
            lines.append(f"  group {g}: largest accepted candidate ≤ top = {m}{limiting}")
        if self.junction is not None:
            lines.append(f"  junction {self.junction}: states will be saved there")
        for g, src in sorted(self.copy_src.items()):
            if src is not None:
                lines.append(
                    f"  group {g}: the page holding token {self.hit - 1} is copied from block {src}"
                )
        for g, src in sorted(self.state_src.items()):
            if src is not None:
                lines.append(f"  group {g}: state at {self.hit} copied from block {src}")
        if self.pending_hit > self.hit:
            lines.append(f"  pending_hit {self.pending_hit}: another request is computing more")
        return "\n".join(lines)


def _full_run(keys: Container[bytes], hashes: list[bytes], step: int, num_pages: int) -> int:
    """The number of leading pages whose full key is in `keys`.

    Probed in C (`map` over a strided slice) in chunks that grow ×4, so a long hit costs a few
    C loops and a miss on the first page costs one small one.
    """
    contains = keys.__contains__
    run, chunk = 0, 64
    while run < num_pages:
        stop = min(run + chunk, num_pages)
        flags = list(map(contains, hashes[(run + 1) * step : stop * step + 1 : step]))
        if not all(flags):
            return run + flags.index(False)
        run, chunk = stop, chunk * 4
    return run


class _Probe:
    """Acceptance of one group for one request over one key set (index, maybe plus pending)."""

    __slots__ = ("F", "_present", "flags", "full", "g", "has", "hashes", "keys", "nu", "u")

    def __init__(
        self, g: GroupGeometry, keys: Container[bytes], hashes: list[bytes], u: int, nu: int
    ) -> None:
        self.g, self.u, self.nu = g, u, nu
        self.keys, self.hashes = keys, hashes
        self._present: list[int] | None = None  # recurrent: units with a state, built on demand

        def has(b: int) -> bool:
            return 0 < b <= nu and hashes[b // u] in keys

        self.has: Callable[[int], bool] = has
        self.F = 0
        B = g.page_size
        if g.kind == "full":
            step = B // u
            q_end = _full_run(keys, hashes, step, nu // B) * step  # units of the last full page
            self.F = q_end * u
            for b in range(min(q_end * u + B, nu), q_end * u, -u):  # page q, highest first
                if hashes[b // u] in keys:
                    self.F = b
                    break
        elif g.kind != "recurrent":
            # Sliding / chunked: one membership flag per boundary, probed in C.
            #   flags[k - 1]  <=>  the boundary k·u has an entry
            #   full[j]       <=>  page j's last boundary (j + 1)·B has one (page j complete)
            self.flags = list(map(keys.__contains__, hashes[1 : nu // u + 1]))
            self.full = self.flags[B // u - 1 :: B // u]

    def ok(self, x: int) -> bool:
        if x == 0:
            return True
        g = self.g
        kind = g.kind
        if kind == "full":
            return x <= self.F
        if kind == "recurrent":
            return self.has(x)
        lo = max(0, x - g.window + 1) if kind == "sliding" else x // g.chunk * g.chunk
        if kind == "chunked" and lo == x:
            return True
        B, u = g.page_size, self.u
        p = (x - 1) // B
        if x > self.nu:
            return False
        # x's own page holds an entry at some boundary in [x, end of the page]
        if not any(self.flags[-(-x // u) - 1 : min((p + 1) * B, self.nu) // u]):
            return False
        need = p - lo // B  # complete pages below x's page that the window still covers
        return need == 0 or (p >= need and all(self.full[p - need : p]))

    def accepts(self, x: int, margin: bool) -> bool:
        if margin and x > 0:
            # Drop-mode margin (7.6). For sliding/chunked drafters we also require x itself:
            # unlike full attention they are not downward-closed (docs/decisions.md, D2).
            return x + self.u <= self.nu and self.ok(x + self.u) and self.ok(x)
        return self.ok(x)

    def largest(self, c: int, margin: bool) -> int:
        """m_g(c): the largest candidate ≤ c this group accepts."""
        if self.g.kind == "full":
            return min(c, max(0, self.F - self.u)) if margin else min(c, self.F)
        if not margin and c % self.u == 0:
            if self.g.kind == "recurrent":
                return self._largest_state(c)
            if self.g.kind == "sliding":
                return self._largest_window(c)
        x = c
        while x > 0 and not self.accepts(x, margin):
            x -= self.u
        return x

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

    def _largest_state(self, c: int) -> int:
        """The largest x ≤ c with a state in `keys`, by bisection over the units that have one
        (found once per probe, in C), instead of a descent of one unit per step."""
        if self._present is None:
            n = self.nu // self.u
            flags = map(self.keys.__contains__, self.hashes[1 : n + 1])
            self._present = list(compress(range(1, n + 1), flags))
        i = bisect_right(self._present, c // self.u)
        return self._present[i - 1] * self.u if i else 0


def _fixed_point(probes: list[tuple[_Probe, bool]], start: int) -> int:
    x = start
    changed = True
    while changed and x > 0:
        changed = False
        for probe, margin in probes:
            y = probe.largest(x, margin)
            if y < x:
                x, changed = y, True
    return x


def _bounds(geo: Geometry, probes: dict[int, _Probe], top: int) -> tuple[int, int, int, int]:
    if geo.only_full:  # full attention is downward-closed: the fixed point is min(top, F_g)
        a = min(top, *(p.F for p in probes.values()))
        return a, a, a, a
    drop = geo.spec_mode == "drop"
    full = [p for p in probes.values() if p.g.kind == "full"]
    nonrec = [p for p in probes.values() if p.g.kind != "recurrent"]
    a1 = _fixed_point([(p, False) for p in full], top)
    a2 = _fixed_point([(p, drop and p.g.is_draft) for p in full], a1)
    a3 = _fixed_point([(p, drop and p.g.is_draft) for p in nonrec], a2)
    a4 = _fixed_point([(p, drop and p.g.is_draft) for p in probes.values()], a3)
    return a1, a2, a3, a4


def _reason(
    geo: Geometry,
    pool: BlockPool,
    req: RequestState,
    probes: dict[int, _Probe],
    top: int,
    bounds: tuple[int, int, int, int],
) -> str:
    a1, a2, a3, a4 = bounds
    if top == 0:
        return "below_unit"
    if a4 == top:
        return "cap_reached"
    if a4 < a3:
        return "recurrent_limited"
    if a3 < a2:
        return "window_limited"
    if a2 < a1:
        return "spec_decode_rewind"
    full = [p for p in probes.values() if p.g.kind == "full"]
    star = min(full, key=lambda p: (min(top, p.F), p.g.group_id))
    u, nu, B = geo.hash_unit, star.nu, star.g.page_size
    x1 = a1 + u
    p1 = (x1 - 1) // B
    hashes = req.chain.hashes
    gid = star.g.group_id
    for b in range(x1, min((p1 + 1) * B, nu) + 1, u):
        if pool.in_ghost(gid, hashes[b // u]):
            return "evicted"
    return "no_entry"


class _Union:
    """The index plus the pending keys of uncommitted plans (for `pending_hit`)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Container[bytes], b: Container[bytes]) -> None:
        self.a, self.b = a, b

    def __contains__(self, key: object) -> bool:
        return key in self.a or key in self.b


def _probes(
    geo: Geometry, keysets: list[Container[bytes]], req: RequestState, nu: int
) -> dict[int, _Probe]:
    hashes = req.chain.hashes
    u = geo.hash_unit
    return {g.group_id: _Probe(g, keysets[g.group_id], hashes, u, nu) for g in geo.cacheable}


def compute_lookup(
    geo: Geometry, pool: BlockPool, req: RequestState, pending: list[set[bytes]] | None, epoch: int
) -> LookupResult:
    """The lookup of spec §7 for a request that is not running."""
    u = geo.hash_unit
    n = req.chain.num_units
    nu = n * u
    top = min(len(req.tokens) - 1, nu) // u * u
    rid = req.request_id
    if not geo.caching_enabled or req.skip_read:
        reason = "disabled" if not geo.caching_enabled else "skip_read"
        return LookupResult(rid, 0, 0, top, n, epoch, reason, None, (0, 0, 0, 0))
    probes = _probes(geo, pool.index, req, nu)
    bounds = _bounds(geo, probes, top)
    hit = bounds[3]
    junction = bounds[2] if geo.has_junction and bounds[2] > hit else None
    reason = _reason(geo, pool, req, probes, top, bounds)
    pending_bounds = bounds
    hashes = req.chain.hashes
    if pending is not None and not all(
        pending[g.group_id].isdisjoint(hashes) for g in geo.cacheable
    ):  # only this request's own keys are ever probed: with none pending, pending_hit = hit
        merged: list[Container[bytes]] = [
            _Union(idx, pend) for idx, pend in zip(pool.index, pending, strict=True)
        ]
        pending_bounds = _bounds(geo, _probes(geo, merged, req, nu), top)
    slots, copy_src, state_src = _slots(geo, pool, req, hit, nu)
    limits = {
        gid: p.largest(top, geo.spec_mode == "drop" and p.g.is_draft) for gid, p in probes.items()
    }
    return LookupResult(
        rid,
        hit,
        pending_bounds[3],
        top,
        n,
        epoch,
        reason,
        junction,
        bounds,
        slots,
        copy_src,
        state_src,
        limits,
        pending_bounds,
    )


def needed_from(g: GroupGeometry, hit: int) -> int:
    """First page of an attention group that a request resuming at `hit` needs (7.8)."""
    if not g.cacheable or hit == 0:
        return -(-hit // g.page_size)
    if g.kind == "sliding":
        return max(0, hit - g.window + 1) // g.page_size
    if g.kind == "chunked":
        lo = hit // g.chunk * g.chunk
        return -(-hit // g.page_size) if lo == hit else lo // g.page_size
    return 0


def _slots(
    geo: Geometry, pool: BlockPool, req: RequestState, hit: int, nu: int
) -> tuple[dict[int, list[int]], dict[int, int | None], dict[int, int | None]]:
    u = geo.hash_unit
    hashes = req.chain.hashes
    slots: dict[int, list[int]] = {}
    copy_src: dict[int, int | None] = {}
    state_src: dict[int, int | None] = {}
    for g in geo.cacheable:
        idx = pool.index[g.group_id]
        if g.kind == "recurrent":
            state_src[g.group_id] = idx[hashes[hit // u]] if hit else None
            continue
        B = g.page_size
        first = needed_from(g, hit)
        full_pages = hit // B
        row = [NULL] * first
        k = B // u  # units per page: the full key of page j is H[(j + 1)·k]
        row.extend(map(idx.__getitem__, hashes[(first + 1) * k : full_pages * k + 1 : k]))
        src = None
        if hit % B and first <= full_pages:
            for b in range(min((full_pages + 1) * B, nu), hit - 1, -u):
                blk = idx.get(hashes[b // u])
                if blk is not None:
                    src = blk
                    break
            row.append(src if src is not None else NULL)
        slots[g.group_id] = row
        copy_src[g.group_id] = src
    return slots, copy_src, state_src
