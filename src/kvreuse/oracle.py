"""Brute-force reference model of a lookup (spec §15): slow, plain, obviously correct.

Nothing here hashes. A key is represented by its *ident* (spec 15.1): the exact token prefix (with
its L successor tokens) and the extra keys of every unit, so two keys are equal iff their idents
are. Property tests compare the library's lookups with `oracle()` on the same entries, mapped from
hashes to idents by an `IdentBook`; the oracle therefore also checks the hashing.

    has(g, b)  ⇔  0 < b ≤ n·u,  b mod u = 0,  (g, b, ident(req, b)) ∈ E
    hit        =  the largest candidate x ∈ {0, u, …, top} accepted by every cacheable group
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvreuse.core import Geometry, GroupGeometry
from kvreuse.core.spi import Stage

ExtraKeys = tuple[tuple[Any, ...], ...]  # X_k: typed tuples ("lora", …), ("mm", …), ("salt", …)
Ident = tuple[tuple[int, ...], tuple[ExtraKeys, ...]]  # (tok[0 : b+L], (X_1, …, X_{b/u}))
Entry = tuple[int, int, Ident]  # (group id, boundary b, ident)


@dataclass(frozen=True)
class OracleRequest:
    """What the oracle needs to know about a request (spec 15.1)."""

    tokens: tuple[int, ...]  # tok[0:N]: prompt plus committed output tokens, never drafts
    prompt_len: int  # P
    lora: tuple[str, str] | None = None  # (name, path)
    mm_items: tuple[tuple[str | bytes, int, int], ...] = ()  # (identifier, offset, length)
    cache_salt: str | None = None
    skip_read: bool = False


@dataclass(frozen=True)
class OracleResult:
    """Ground truth of one lookup: the hit, its reason code, junction and bounds (spec 12.3)."""

    hit: int
    reason: str
    junction: int | None
    bounds: tuple[int, int, int, int]  # (A1, A2, A3, A4); all 0 when no group is searched
    top: int
    n: int


# ----------------------------------------------------------------------------- idents (5.2, 15.1)
def num_units(geo: Geometry, req: OracleRequest) -> int:
    """n = max(0, ⌊(N − L)/u⌋): the request's hashed units (spec §2)."""
    return max(0, (len(req.tokens) - geo.lookahead) // geo.hash_unit)


def _enc_order(identifier: str | bytes) -> tuple[int, int, bytes]:
    """Sort key equal to the byte order of enc(identifier): tag, u64be length, raw bytes (5.3)."""
    if isinstance(identifier, bytes):
        return (0x02, len(identifier), identifier)
    raw = identifier.encode("utf-8")
    return (0x03, len(raw), raw)


def extra_keys(geo: Geometry, req: OracleRequest, k: int) -> ExtraKeys:
    """X_k, the extra keys of unit k ≥ 1, by the three rules of spec 5.2, in that order."""
    u, lookahead = geo.hash_unit, geo.lookahead
    keys: list[tuple[Any, ...]] = []
    if req.lora is not None:
        keys.append(("lora", req.lora[0], req.lora[1]))
    start, end = (k - 1) * u, k * u + lookahead  # the unit's window [s_k, e_k)
    items = [
        (identifier, offset)
        for identifier, offset, length in req.mm_items
        if max(offset, start) < min(offset + length, end)  # [offset, offset+length) meets it
    ]
    items.sort(key=lambda item: (item[1], _enc_order(item[0])))
    keys.extend(("mm", identifier, offset - start) for identifier, offset in items)
    if k == 1 and req.cache_salt:  # an empty salt means no salt
        keys.append(("salt", req.cache_salt))
    return tuple(keys)


def ident(geo: Geometry, req: OracleRequest, b: int) -> Ident:
    """The ident of boundary b (spec 15.1): (tok[0 : b+L], (X_1, …, X_{b/u}))."""
    u = geo.hash_unit
    if b <= 0 or b % u or b + geo.lookahead > len(req.tokens):
        raise ValueError(f"{b} is not a hashed boundary of a {len(req.tokens)}-token request")
    units = tuple(extra_keys(geo, req, k) for k in range(1, b // u + 1))
    return (tuple(req.tokens[: b + geo.lookahead]), units)


# ----------------------------------------------------------------------------- ground truth (15.2)
class _Lookup:
    """One request against one entry set: the predicates of spec §7, written as in 15.2."""

    def __init__(self, geo: Geometry, req: OracleRequest, entries: Collection[Entry]) -> None:
        self.geo, self.req, self.entries = geo, req, set(entries)
        u, n = geo.hash_unit, num_units(geo, req)
        self.hash_unit, self.num_units = u, n
        self.top = min(len(req.tokens) - 1, n * u) // u * u
        self.groups = [g for g in geo.groups if g.cacheable]
        self._idents: dict[int, Ident] = {}

    def ident(self, b: int) -> Ident:
        if b not in self._idents:
            self._idents[b] = ident(self.geo, self.req, b)
        return self._idents[b]

    def has(self, g: GroupGeometry, b: int, keys: set[Entry] | None = None) -> bool:
        """has(g, b) of spec 7.1 (against `keys`, the entries by default)."""
        keys = self.entries if keys is None else keys
        u, n = self.hash_unit, self.num_units
        ok_boundary = 0 < b <= n * u and b % u == 0
        return ok_boundary and (g.group_id, b, self.ident(b)) in keys

    def page_entries(self, g: GroupGeometry, x: int) -> range:
        """Boundaries b of page p(x) with x ≤ b ≤ min((p+1)·B, n·u), ascending (F2)."""
        p, u, n = (x - 1) // g.page_size, self.hash_unit, self.num_units
        return range(x, min((p + 1) * g.page_size, n * u) + 1, u)

    def covered(self, g: GroupGeometry, x: int, lo: int) -> bool:
        """x > 0: full keys for the pages of [lo, x) before p(x), and (F2) for page p(x)."""
        p = (x - 1) // g.page_size
        earlier = range(lo // g.page_size, p)
        return all(self.has(g, (j + 1) * g.page_size) for j in earlier) and any(
            self.has(g, b) for b in self.page_entries(g, x)
        )

    def copy_boundary(self, g: GroupGeometry, x: int) -> int | None:
        """The highest b of page p(x) with x ≤ b and has(g, b), or None (the copy source, 7.8)."""
        found = [b for b in self.page_entries(g, x) if self.has(g, b)]
        return max(found) if found else None

    def ok(self, g: GroupGeometry, x: int) -> bool:
        """The group's own predicate (7.2 – 7.5), without the drop-mode margin: its kind's
        rule as the spec writes it (`accepts_plain`, kvreuse.core.kinds), asked through the
        predicates above."""
        return x == 0 or g.accepts_plain(_Ask(self, g), x)

    def accepts(self, g: GroupGeometry, x: int, margin: bool = True) -> bool:
        """ok(), plus the margin of 7.6 for draft groups in spec mode drop.

        The margin also requires ok(x) itself (docs/decisions.md D2): a sliding or chunked
        drafter is not downward-closed, and the pages a hit at x needs are those of x's window,
        not of x + u's. For full attention ok(x + u) implies ok(x), so 15.2 is unchanged there.
        """
        if margin and self.geo.spec_mode == "drop" and g.role == "draft" and x > 0:
            u, n = self.hash_unit, self.num_units
            return x + u <= n * u and self.ok(g, x + u) and self.ok(g, x)
        return self.ok(g, x)

    def best(self, groups: Iterable[GroupGeometry], margin: bool = True) -> int:
        """The largest candidate accepted by every group in `groups`, enumerated from top down."""
        groups = list(groups)
        for x in range(self.top, 0, -self.hash_unit):
            if all(self.accepts(g, x, margin) for g in groups):
                return x
        return 0


class _Ask:
    """The predicates of one group, as a kind's plain rule reads them (`PlainAsk`)."""

    def __init__(self, look: _Lookup, g: GroupGeometry) -> None:
        self.look, self.g, self.u = look, g, look.hash_unit

    def has(self, b: int) -> bool:
        return self.look.has(self.g, b)

    def covered(self, x: int, lo: int) -> bool:
        return self.look.covered(self.g, x, lo)


def oracle(
    geo: Geometry,
    req: OracleRequest,
    entries: Collection[Entry],
    ghost: Collection[Entry] = (),
) -> OracleResult:
    """What a lookup must return on the resident `entries` and the `ghost` record (spec 15.2).

    Only prefix-cacheable groups take part (spec §4). When nothing is searched (`disabled`,
    `skip_read`) the hit is 0, the bounds are all 0 and `top`, `n` are still reported (7.1).
    """
    look = _Lookup(geo, req, entries)
    top, n, u = look.top, look.num_units, look.hash_unit
    if not geo.caching_enabled or req.skip_read:
        reason = "disabled" if not geo.caching_enabled else "skip_read"
        return OracleResult(0, reason, None, (0, 0, 0, 0), top, n)
    full = [g for g in look.groups if g.stage is Stage.FULL]
    nonrec = [g for g in look.groups if g.stage is not Stage.STATE]
    a1, a2 = look.best(full, margin=False), look.best(full)
    a3, a4 = look.best(nonrec), look.best(look.groups)
    has_recurrent = len(nonrec) < len(look.groups)
    junction = a3 if nonrec and has_recurrent and a3 > a4 else None
    if top == 0:
        reason = "below_unit"
    elif a4 == top:
        reason = "cap_reached"
    elif a4 < a3:
        reason = "recurrent_limited"
    elif a3 < a2:
        reason = "window_limited"
    elif a2 < a1:
        reason = "spec_decode_rewind"
    else:  # a1 < top, so `full` is not empty
        g = min(full, key=lambda f: (look.best([f], margin=False), f.group_id))
        gone = set(ghost)
        evicted = any(look.has(g, b, gone) for b in look.page_entries(g, a1 + u))
        reason = "evicted" if evicted else "no_entry"
    return OracleResult(a4, reason, junction, (a1, a2, a3, a4), top, n)


def expected_slots(
    geo: Geometry, req: OracleRequest, entries: Collection[Entry], hit: int
) -> dict[int, list[str]]:
    """The slot markers of a lookup with this hit (spec 7.8), per attention group id.

    Each group gets ⌈hit/B⌉ markers: "null" for a page its predicate does not need at `hit`
    (sliding: before ⌊lo/B⌋, lo = max(0, hit − W + 1); chunked: before ⌊lo/B⌋, lo = ⌊hit/C⌋·C),
    "full" for a needed page with (j+1)·B ≤ hit, "copy" for the needed page p(hit) when
    hit mod B ≠ 0. A group that is not prefix-cacheable needs no page of a hit: all "null" (§4).
    Recurrent groups are not included. `entries` are not consulted for the markers; use
    `copy_boundary` for the entry a "copy" page is copied from.
    """
    slots: dict[int, list[str]] = {}
    for g in geo.groups:
        if not g.is_attention:
            continue
        B, pages = g.page_size, -(-hit // g.page_size)
        first_needed = g.attend_from(hit) // B if g.cacheable and hit > 0 else pages
        marks = ["null"] * min(first_needed, pages)
        marks += ["full" if (j + 1) * B <= hit else "copy" for j in range(len(marks), pages)]
        slots[g.group_id] = marks
    return slots


def copy_boundary(
    geo: Geometry, req: OracleRequest, entries: Collection[Entry], group_id: int, hit: int
) -> int | None:
    """The boundary of the copy source of 7.8: the highest b ≥ hit in page p(hit) with has()."""
    if hit <= 0:
        return None
    return _Lookup(geo, req, entries).copy_boundary(geo.groups[group_id], hit)


# ----------------------------------------------------------------------------- harness (15.1)
class IdentBook:
    """Maps hashes to idents for the harness (spec 15.1 'To obtain E from an implementation').

    `hasher_factory(req)` must return the library's chain [H[0], H[1], …, H[n]] for the request.
    """

    def __init__(
        self, geo: Geometry, hasher_factory: Callable[[OracleRequest], Sequence[bytes]]
    ) -> None:
        self.geo = geo
        self.hasher_factory = hasher_factory
        self.by_hash: dict[bytes, Ident] = {}
        self.by_ident: dict[Ident, bytes] = {}

    def add(self, req: OracleRequest) -> None:
        """Hashes `req` at every boundary and records hash ↔ ident, which must be one-to-one."""
        chain = list(self.hasher_factory(req))
        n = num_units(self.geo, req)
        assert len(chain) == n + 1, f"the hasher gave {len(chain) - 1} units, expected n = {n}"
        for k in range(1, n + 1):
            new = ident(self.geo, req, k * self.geo.hash_unit)
            digest = bytes(chain[k])
            old = self.by_hash.setdefault(digest, new)
            assert old == new, f"hash {digest.hex()} names two different prefixes"
            same = self.by_ident.setdefault(new, digest)
            assert same == digest, f"boundary {k * self.geo.hash_unit} hashed two ways"

    def _lookup(self, row: Sequence[Any]) -> Entry:
        group_id, boundary, digest = row[0], row[1], bytes(row[2])
        assert digest in self.by_hash, f"unmapped hash in exported row {tuple(row)!r}"
        found = self.by_hash[digest]
        units = len(found[1])
        assert units * self.geo.hash_unit == boundary, (
            f"exported row {tuple(row)!r}: its hash is the chain after {units} units"
        )
        return (group_id, boundary, found)

    def entries(self, exported: Iterable[Sequence[Any]]) -> set[Entry]:
        """E from export_entries() rows (group_id, boundary, hash, kind, block_id)."""
        return {self._lookup(row) for row in exported}

    def ghost(self, exported: Iterable[Sequence[Any]]) -> set[Entry]:
        """The ghost set from export_ghost() rows (group_id, boundary, hash)."""
        return {self._lookup(row) for row in exported}
