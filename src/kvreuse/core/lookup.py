"""Lookup (spec §7): per-kind acceptance rules, the coordinator's fixed point, reasons, slots.

Every group answers one question, "do you accept a hit of x tokens?" (its kind's probe:
kvreuse.core.kinds), over the candidates X = {0, u, 2u, …, top}. The hit is the largest x all
prefix-cacheable groups accept. Bounds (12.3) are computed as a chain of restricted fixed
points, each started from the previous bound, which is valid because every later bound is at
most the earlier one.

The rules read the cache only through `IndexView` (per group, chain hash → block id, and whether
an evicted key is remembered), so they run unchanged on the manager's pool or on a mirror of
another replica's cache built from its events.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from kvreuse.core.config import Geometry
from kvreuse.core.kinds import Probe, Stage
from kvreuse.core.pool import NULL


class Reason(StrEnum):
    """Why a lookup stopped where it did (spec §12.3), in the order they are decided."""

    DISABLED = "disabled"  # prefix caching is off
    SKIP_READ = "skip_read"  # the request asked not to read the cache
    BELOW_UNIT = "below_unit"  # the prompt has no complete unit before its last token
    CAP_REACHED = "cap_reached"  # everything that may be reused is reused
    RECURRENT_LIMITED = "recurrent_limited"  # a recurrent group has no state far enough
    WINDOW_LIMITED = "window_limited"  # a sliding / chunked window is not covered
    SPEC_DECODE_REWIND = "spec_decode_rewind"  # the drafter's margin (drop mode)
    EVICTED = "evicted"  # the next entry was in the cache and has been evicted
    NO_ENTRY = "no_entry"  # the next entry was never published


class IndexView(Protocol):
    """What the lookup rules read: the index of each group and the ghost record."""

    @property
    def index(self) -> Sequence[Mapping[bytes, int]]:
        """Per group id: chain hash → block id of every resident entry."""
        ...

    def in_ghost(self, group_id: int, key: bytes) -> bool:
        """Whether `key` was evicted from the group and is still remembered (for reasons)."""
        ...


class ChainView(Protocol):
    """What the lookup rules read of a request's hash chain (a `Chain` is one)."""

    @property
    def hashes(self) -> list[bytes]:
        """H[0] … H[n]: H[k] names the prefix [0, k·u) and its extra keys."""
        ...

    @property
    def num_units(self) -> int: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupResult:
    """What a lookup found (spec §7.8). Pure: computing it changed nothing."""

    request_id: str
    hit: int
    pending_hit: int
    top: int
    n: int
    epoch: int
    reason: Reason
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
    # (group id, tier, slot) of each block of the hit held only in a tier below the pool: the
    # load plan (kvreuse.core.tiers.view). Such a block's slot entry is a virtual id below 0.
    loads: tuple[tuple[int, int, int], ...] = ()

    def explain(self) -> str:
        """Human-readable account of the hit (format not normative)."""
        a1, a2, a3, a4 = self.bounds
        lines = [
            f"request {self.request_id}: hit {self.hit} of top {self.top} "
            f"(n = {self.n} units), reason {self.reason}",
            f"  bounds: A1 full={a1}  A2 +margin={a2}  A3 non-recurrent={a3}  A4 all={a4}",
        ]
        for gid, m in sorted(self.group_limits.items()):
            limiting = "  <- limits the hit" if m == self.hit and m < self.top else ""
            lines.append(f"  group {gid}: largest accepted candidate ≤ top = {m}{limiting}")
        if self.junction is not None:
            lines.append(f"  junction {self.junction}: states will be saved there")
        for gid, src in sorted(self.copy_src.items()):
            if src is not None:
                page = f"the page holding token {self.hit - 1}"
                lines.append(f"  group {gid}: {page} is copied from block {src}")
        for gid, src in sorted(self.state_src.items()):
            if src is not None:
                lines.append(f"  group {gid}: state at {self.hit} copied from block {src}")
        if self.loads:
            lines.append(f"  {len(self.loads)} block(s) of the hit are loaded from a tier")
        if self.pending_hit > self.hit:
            lines.append(f"  pending_hit {self.pending_hit}: another request is computing more")
        return "\n".join(lines)


def _fixed_point(probes: list[tuple[Probe, bool]], start: int) -> int:
    x = start
    changed = True
    while changed and x > 0:
        changed = False
        for probe, margin in probes:
            y = probe.largest(x, margin)
            if y < x:
                x, changed = y, True
    return x


def _bounds(geo: Geometry, probes: dict[int, Probe], top: int) -> tuple[int, int, int, int]:
    """A1…A4 (12.3). Full attention is downward-closed (m_g(c) = min(c, a bound of its own)),
    so the fixed point over full groups alone is a minimum, and once x is at or below every
    full group's bound those groups accept every lower x: the later fixed points iterate only
    the other kinds, and a bound whose probe set adds nothing equals the one before it."""
    if geo.only_full:
        a = min(top, *(p.F for p in probes.values()))
        return a, a, a, a
    drop = geo.spec_mode == "drop"
    a1 = a2 = top
    window: list[tuple[Probe, bool]] = []
    state: list[tuple[Probe, bool]] = []
    for p in probes.values():
        stage, margin = p.g.stage, drop and p.g.is_draft
        if stage is Stage.FULL:
            a1 = min(a1, p.F)
            a2 = min(a2, p.largest(top, margin))
        else:
            (state if stage is Stage.STATE else window).append((p, margin))
    a2 = min(a1, a2)
    a3 = _fixed_point(window, a2) if window else a2
    a4 = _fixed_point(window + state, a3) if state else a3
    return a1, a2, a3, a4


def _reason(
    geo: Geometry,
    index: IndexView,
    hashes: list[bytes],
    probes: dict[int, Probe],
    top: int,
    bounds: tuple[int, int, int, int],
) -> Reason:
    a1, a2, a3, a4 = bounds
    if top == 0:
        return Reason.BELOW_UNIT
    if a4 == top:
        return Reason.CAP_REACHED
    if a4 < a3:
        return Reason.RECURRENT_LIMITED
    if a3 < a2:
        return Reason.WINDOW_LIMITED
    if a2 < a1:
        return Reason.SPEC_DECODE_REWIND
    star: Probe | None = None  # the full group with the lowest min(top, F), lowest gid first
    for p in probes.values():
        if p.g.stage is Stage.FULL and (
            star is None or (min(top, p.F), p.g.group_id) < (min(top, star.F), star.g.group_id)
        ):
            star = p
    assert star is not None  # a full group limits the hit here: A1 < top
    u, nu, B = geo.hash_unit, star.nu, star.g.page_size
    x1 = a1 + u
    p1 = (x1 - 1) // B
    gid = star.g.group_id
    for b in range(x1, min((p1 + 1) * B, nu) + 1, u):
        if index.in_ghost(gid, hashes[b // u]):
            return Reason.EVICTED
    return Reason.NO_ENTRY


class _Union:
    """The index plus the pending keys of uncommitted plans (for `pending_hit`)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Container[bytes], b: Container[bytes]) -> None:
        self.a, self.b = a, b

    def __contains__(self, key: object) -> bool:
        return key in self.a or key in self.b


def _probes(
    geo: Geometry, keysets: Sequence[Container[bytes]], hashes: list[bytes], nu: int
) -> dict[int, Probe]:
    u = geo.hash_unit
    return {g.group_id: g.probe(keysets[g.group_id], hashes, u, nu) for g in geo.cacheable}


def compute_lookup(
    geo: Geometry,
    index: IndexView,
    request_id: str,
    chain: ChainView,
    num_tokens: int,
    *,
    skip_read: bool = False,
    pending: Sequence[set[bytes]] | None = None,
    epoch: int = 0,
) -> LookupResult:
    """The lookup of spec §7 for a request of `num_tokens` tokens that is not running.

    `pending` holds, per group, the keys uncommitted plans would publish (for `pending_hit`).
    """
    u = geo.hash_unit
    n = chain.num_units
    nu = n * u
    top = min(num_tokens - 1, nu) // u * u
    if not geo.caching_enabled or skip_read:
        reason = Reason.DISABLED if not geo.caching_enabled else Reason.SKIP_READ
        return LookupResult(
            request_id=request_id, hit=0, pending_hit=0, top=top, n=n, epoch=epoch,
            reason=reason, junction=None, bounds=(0, 0, 0, 0),
        )  # fmt: skip
    hashes = chain.hashes
    keysets = index.index
    probes = _probes(geo, keysets, hashes, nu)
    bounds = _bounds(geo, probes, top)
    hit = bounds[3]
    junction = bounds[2] if geo.has_junction and bounds[2] > hit else None
    reason = _reason(geo, index, hashes, probes, top, bounds)
    pending_bounds = bounds
    if pending is not None and not all(
        pending[gid].isdisjoint(p.decisive()) for gid, p in probes.items()
    ):  # pending keys the probes would not read leave every bound as it is: pending_hit = hit
        merged = [_Union(idx, pend) for idx, pend in zip(keysets, pending, strict=True)]
        pending_bounds = _bounds(geo, _probes(geo, merged, hashes, nu), top)
    slots, copy_src, state_src = _slots(geo, keysets, hashes, hit, nu, probes)
    drop = geo.spec_mode == "drop"
    limits = {gid: p.largest(top, drop and p.g.is_draft) for gid, p in probes.items()}
    return LookupResult(
        request_id=request_id,
        hit=hit,
        pending_hit=pending_bounds[3],
        top=top,
        n=n,
        epoch=epoch,
        reason=reason,
        junction=junction,
        bounds=bounds,
        slots=slots,
        copy_src=copy_src,
        state_src=state_src,
        group_limits=limits,
        pending_bounds=pending_bounds,
    )


def _slots(
    geo: Geometry,
    keysets: Sequence[Mapping[bytes, int]],
    hashes: list[bytes],
    hit: int,
    nu: int,
    probes: Mapping[int, Probe],
) -> tuple[dict[int, list[int]], dict[int, int | None], dict[int, int | None]]:
    u = geo.hash_unit
    slots: dict[int, list[int]] = {}
    copy_src: dict[int, int | None] = {}
    state_src: dict[int, int | None] = {}
    for g in geo.cacheable:
        idx = keysets[g.group_id]
        if not g.is_attention:
            state_src[g.group_id] = idx[hashes[hit // u]] if hit else None
            continue
        B = g.page_size
        first = g.needed_from(hit)
        full_pages = hit // B
        k = B // u  # units per page: the full key of page j is H[(j + 1)·k]
        pages = getattr(probes[g.group_id], "pages", None)  # a full group's probe read them
        if pages is not None and first == 0 and full_pages <= len(pages):
            del pages[full_pages:]  # the probe is done with it: the row takes it over
            row = pages
        else:
            row = [NULL] * first
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
