"""Spec cases, part A: §16 edge cases 1–18 and the worked examples of §7.2, §7.9, §8 and §10.3.

Every number asserted here is the spec's value (docs/cache-semantics.md). Each test drives a real
`KVCacheManager` through the public cycle (add_request → lookup → allocate → seal_step → commit →
finish) with `check_invariants()` after every operation, and checks hits, reasons, junctions,
copies, planned saves, published keys, events and metrics.

Keys are checked against an independent SHA-256 implementation of spec §5 (`ref_chain`), itself
pinned to the test vectors of §5.6, so a test never trusts the library's own hasher.

Group ids of the example geometries (§4):

    Geo-P  0 full (16 × dcp 4 = 64)
    Geo-H  0 full (64)        1 recurrent (M = 16)
    Geo-D  0 full (64)        1 recurrent (16)       2 full draft (64, unsharded); mode "drop"
    Geo-L  0 full (2048 × 4 = 8192)                  1 recurrent (M = 256);  u = 256
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from kvreuse.core import (
    BlockRemoved,
    BlockStored,
    CacheConfig,
    Copy,
    GroupSpec,
    KVCacheManager,
    LookupResult,
    MultiModalItem,
    Request,
    RequestPlan,
    StepPlan,
)

OUT = 7  # the token every producer samples at the end of its prefill


# ============================================================================ reference hashing
class Tok(tuple):
    """A token array for `ref_enc` (tag 0x05), distinct from a tuple of ints."""

    __slots__ = ()


def ref_enc(v: object) -> bytes:
    """Canonical encoding of spec §5.3, written from the table."""
    if v is None:
        return b"\x00"
    if isinstance(v, Tok):
        return b"\x05" + len(v).to_bytes(8, "big") + b"".join(t.to_bytes(4, "big") for t in v)
    if isinstance(v, bool):
        raise TypeError("bool")
    if isinstance(v, int):
        return b"\x01" + v.to_bytes(8, "big", signed=True)
    if isinstance(v, bytes):
        return b"\x02" + len(v).to_bytes(8, "big") + v
    if isinstance(v, str):
        raw = v.encode()
        return b"\x03" + len(raw).to_bytes(8, "big") + raw
    if isinstance(v, tuple | list):
        return b"\x04" + len(v).to_bytes(8, "big") + b"".join(ref_enc(x) for x in v)
    raise TypeError(type(v))


def _sha(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


def ref_chain(
    tokens: Sequence[int],
    u: int,
    L: int = 0,
    *,
    salt: str | None = None,
    lora: tuple[str, str] | None = None,
    mm: Sequence[MultiModalItem] = (),
) -> list[bytes]:
    """[H[0], …, H[n]] of spec §5 with SHA-256 and no seed; n = max(0, ⌊(N − L)/u⌋)."""
    tokens = list(tokens)
    h = [_sha(ref_enc(("kvr/root", "sha256", u, L, "kvreuse/v1")))]
    items = sorted(mm, key=lambda it: (it.offset, ref_enc(it.identifier)))
    for k in range(1, max(0, (len(tokens) - L) // u) + 1):
        s, e = (k - 1) * u, k * u + L
        x: list[tuple[Any, ...]] = []
        if lora is not None:
            x.append(("lora", lora[0], lora[1]))
        x += [
            ("mm", it.identifier, it.offset - s)
            for it in items
            if it.length > 0 and it.offset < e and it.offset + it.length > s
        ]
        if k == 1 and salt:
            x.append(("salt", salt))
        unit = Tok(tokens[s : k * u])
        succ = Tok(tokens[k * u : k * u + L])
        h.append(_sha(ref_enc(("kvr/unit", h[-1], unit, succ, tuple(x)))))
    return h


def test_reference_hasher_matches_spec_vectors() -> None:
    """§5.6: the test's own hasher reproduces every vector, so key assertions are independent."""
    t16, t32 = list(range(16)), list(range(32))
    assert ref_chain([], 16)[0].hex() == (
        "06810975dc0e98888988f5277974379df65cda4c001273f7eecacfb13ba02c32"
    )
    assert ref_chain(t16, 16)[1].hex() == (
        "0aca187b1be934efe6686c5ddcf58880264377eeb8c6908e4b84fc0bd15e9c20"
    )
    assert ref_chain(t32, 16)[2].hex() == (
        "49ff12579848f665571f9acac94396ad46119a0cd47d89b0f5c347302ca699cb"
    )
    assert ref_chain(t16, 16, salt="t1")[1].hex() == (
        "1db89d88ebdfff94fc587155369fe629d7f9cde6101512ae110a570661a1a539"
    )
    assert ref_chain(t16, 16, lora=("fr", "/ad/v1"))[1].hex() == (
        "de49d23314ae5ebf8b088ac45f31ab1342a7c48e5bebe6e4a7d14f3a767bc473"
    )
    img = MultiModalItem("img-9f", 6, 10)
    assert ref_chain(t16, 16, mm=[img])[1].hex() == (
        "537bdc3ce5ef3dabed271b2ddaf4a33954d41c9719ca6dd93854ef4a32b126f8"
    )
    assert ref_chain([], 16, 1)[0].hex() == (
        "33cce15865c6941959e181dc28ef84ac1771145dbb242c9cbf9dd7ff2d4db132"
    )
    assert ref_chain(list(range(17)), 16, 1)[1].hex() == (
        "69f369894ca511e5a9f259a81593adcc8cc0f809dfe2b86351db942b3e17b8c4"
    )


# ============================================================================ geometries (§4)
def geo_p(num_blocks: int = 64, **kw: Any) -> CacheConfig:
    return CacheConfig(num_blocks=num_blocks, dcp_size=4, groups=[GroupSpec("full", 16)], **kw)


def geo_h(num_blocks: int = 64, **kw: Any) -> CacheConfig:
    groups = [GroupSpec("full", 16), GroupSpec("recurrent", 16)]
    return CacheConfig(num_blocks=num_blocks, dcp_size=4, groups=groups, **kw)


def geo_d(mode: str = "drop", L: int = 1, num_blocks: int = 64) -> CacheConfig:
    groups = [
        GroupSpec("full", 16),
        GroupSpec("recurrent", 16),
        GroupSpec("full", 64, dcp_sharded=False, role="draft"),
    ]
    return CacheConfig(
        num_blocks=num_blocks, dcp_size=4, groups=groups, spec_mode=mode, lookahead_tokens=L
    )  # type: ignore[arg-type]


def geo_l(num_blocks: int = 64) -> CacheConfig:
    groups = [GroupSpec("full", 2048), GroupSpec("recurrent", 256)]
    return CacheConfig(num_blocks=num_blocks, dcp_size=4, groups=groups)


def test_example_geometries_resolve_as_in_section_4() -> None:
    """The table of §4: page sizes after DCP scaling and the default hash unit."""
    cases = [
        (geo_p(), [64], 16),
        (geo_h(), [64, 16], 16),
        (geo_d(), [64, 16, 64], 16),
        (geo_l(), [8192, 256], 256),
    ]
    for cfg, pages, u in cases:
        geo = cfg.geometry
        assert [g.page_size for g in geo.groups] == pages
        assert geo.hash_unit == u


# ============================================================================ harness
class Checked:
    """A manager whose every method call is followed by `check_invariants()` (T10)."""

    def __init__(self, config: CacheConfig) -> None:
        self.mgr = KVCacheManager(config)
        self.mgr.check_invariants()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.mgr, name)
        if not callable(attr) or name == "check_invariants":
            return attr

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            out = attr(*args, **kwargs)
            self.mgr.check_invariants()
            return out

        return call


def toks(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


@dataclass
class Run:
    res: LookupResult
    plan: RequestPlan
    step: StepPlan


def add(m: Checked, rid: str, tokens: Sequence[int], **kw: Any) -> None:
    m.add_request(Request(rid, list(tokens), **kw))


def look(m: Checked, rid: str, tokens: Sequence[int], **kw: Any) -> LookupResult:
    """Register a consumer and look it up (it stays WAITING)."""
    add(m, rid, tokens, **kw)
    return m.lookup(rid)


def admit(m: Checked, rid: str, num_tokens: int) -> tuple[LookupResult, RequestPlan]:
    """Lookup + admission of a registered request with N = num_tokens, computing [hit, N)."""
    res = m.lookup(rid)
    before = m.metrics()
    plan = m.allocate(rid, num_tokens - res.hit, lookup=res)
    assert plan is not None
    assert plan.start == res.hit and plan.end == num_tokens
    # T6 (§12.1, §12.2): a first admission counts once, with its P, its hit and its reason.
    after = m.metrics()
    stats = m.request_stats(rid)
    assert (stats.admissions, stats.cached_tokens, stats.reason) == (1, res.hit, res.reason)
    assert (stats.last_hit, stats.last_reason) == (res.hit, res.reason)
    for name, delta in (("requests", 1), ("queries", num_tokens), ("hits", res.hit)):
        key = f"prefix_cache_{name}"
        assert after[key] - before[key] == delta, key
    reasons_before = before["prefix_cache_reason_total"]
    assert after["prefix_cache_reason_total"] == {
        **reasons_before,
        res.reason: reasons_before.get(res.reason, 0) + 1,
    }
    return res, plan


def commit1(m: Checked, rid: str, t: int, new: Sequence[int]) -> StepPlan:
    step = m.seal_step()
    m.commit(step.step_id, {rid: (t, list(new))})
    return step


def produce(m: Checked, rid: str, tokens: Sequence[int], *, finish: bool = True, **kw: Any) -> Run:
    """§16 "A finished": prompt prefilled in one step, one token sampled (T = P), released."""
    add(m, rid, tokens, **kw)
    res, plan = admit(m, rid, len(tokens))
    step = commit1(m, rid, len(tokens), [OUT])
    if finish:
        m.finish(rid)
    return Run(res, plan, step)


def decode(m: Checked, rid: str, t: int, count: int, base: int = 50_000) -> int:
    """`count` decode steps of one token each, from committed count t; returns the new T."""
    for i in range(count):
        plan = m.allocate(rid, 1)
        assert plan is not None and plan.start == t
        t += 1
        commit1(m, rid, t, [base + i])
    return t


def rows(m: Checked, g: int) -> list[tuple[int, bytes, str, int]]:
    """(boundary, hash, kind, block) of every key of group g."""
    return [(b, h, k, blk) for gg, b, h, k, blk in m.export_entries() if gg == g]


def block_of(m: Checked, g: int, key: bytes) -> int | None:
    for _, h, _, blk in rows(m, g):
        if h == key:
            return blk
    return None


def keys_on(m: Checked, blk: int) -> list[tuple[int, str]]:
    return sorted((b, k) for _, b, _, k, x in m.export_entries() if x == blk)


def evict_key(m: Checked, g: int, key: bytes) -> int:
    blk = block_of(m, g, key)
    assert blk is not None, "key not resident"
    m.evict(blk)
    return blk


def stored(events: Sequence[Any]) -> list[tuple[int, list[int], int]]:
    """(group, boundaries, token_start) of each BlockStored, in order."""
    return [
        (e.group_id, [x.boundary for x in e.entries], e.token_start)
        for e in events
        if isinstance(e, BlockStored)
    ]


def saves(plan: RequestPlan, g: int | None = None) -> list[int]:
    return sorted(s.position for s in plan.saves if g is None or s.group_id == g)


def save_block(plan: RequestPlan, g: int, pos: int) -> int:
    (blk,) = [s.block for s in plan.saves if s.group_id == g and s.position == pos]
    return blk


def assert_lookup(
    res: LookupResult,
    *,
    hit: int,
    reason: str,
    top: int | None = None,
    n: int | None = None,
    junction: int | None = None,
    bounds: tuple[int, int, int, int] | None = None,
    pending_hit: int | None = None,
) -> None:
    """The lookup's fields; `pending_hit` defaults to the hit (nothing uncommitted, §7.8)."""
    got = {"hit": res.hit, "reason": res.reason, "junction": res.junction}
    want: dict[str, Any] = {"hit": hit, "reason": reason, "junction": junction}
    got["pending_hit"], want["pending_hit"] = (
        res.pending_hit,
        (hit if pending_hit is None else pending_hit),
    )
    if top is not None:
        got["top"], want["top"] = res.top, top
    if n is not None:
        got["n"], want["n"] = res.n, n
    if bounds is not None:
        got["bounds"], want["bounds"] = tuple(res.bounds), bounds
    assert got == want, res.explain()


# ============================================================================ §7.2 worked examples
def test_7_2_geo_l_resend_2048_gives_1792() -> None:
    """A (2048) committed its prefill: entries 256 … 2048 on page 0, replay state at 1792."""
    m = Checked(geo_l())
    a = toks(2048)
    H = ref_chain([*a, OUT], 256)
    ra = produce(m, "A", a, finish=False)  # committed, still running
    assert saves(ra.plan) == [1792, 2048]  # replay ρ(2048) = 1792, rolling 2048
    a_p0 = ra.plan.tables[0][0]
    st1792 = save_block(ra.plan, 1, 1792)
    assert rows(m, 0) == [(b, H[b // 256], "partial", a_p0) for b in range(256, 2049, 256)]
    assert rows(m, 1) == [(1792, H[7], "state", st1792)]  # the rolling 2048 is held only
    assert stored(m.take_events()) == [(0, list(range(256, 2049, 256)), 0), (1, [1792], 1536)]

    res = look(m, "R", a)
    assert_lookup(res, hit=1792, reason="cap_reached", top=1792, n=8, bounds=(1792,) * 4)
    assert res.slots[0] == [a_p0] and res.copy_src[0] == a_p0 and res.state_src[1] == st1792
    _, plan = admit(m, "R", 2048)
    dst, live = plan.tables[0][0], plan.recurrent[1].live
    assert plan.copies == [Copy(0, a_p0, dst), Copy(1, st1792, live)]
    assert plan.recurrent[1].init == "copy"
    assert saves(plan) == [2048]  # only the rolling save: 1792 is already keyed
    met = m.metrics()
    assert met["prefix_cache_hits"] == 1792 and met["prefix_cache_queries"] == 4096
    assert met["prefix_cache_reason_total"] == {"no_entry": 1, "cap_reached": 1}
    assert met["kv_cow_copies_total"] == {"full": 1, "recurrent": 1}


def test_7_2_geo_l_resend_2049_gives_2048() -> None:
    m = Checked(geo_l())
    a = toks(2049)
    H = ref_chain([*a, OUT], 256)
    ra = produce(m, "A", a, finish=False)
    assert saves(ra.plan) == [2048]  # ρ(2049) = 2048 = the rolling point: one block
    a_p0 = ra.plan.tables[0][0]
    st2048 = save_block(ra.plan, 1, 2048)
    assert [r[0] for r in rows(m, 0)] == list(range(256, 2049, 256))
    assert rows(m, 1) == [(2048, H[8], "state", st2048)]
    assert stored(m.take_events()) == [(0, list(range(256, 2049, 256)), 0), (1, [2048], 1792)]

    res = look(m, "R", a)
    assert_lookup(res, hit=2048, reason="cap_reached", top=2048, n=8)
    assert res.copy_src[0] == a_p0 and res.state_src[1] == st2048
    _, plan = admit(m, "R", 2049)
    assert plan.copies == [
        Copy(0, a_p0, plan.tables[0][0]),
        Copy(1, st2048, plan.recurrent[1].live),
    ]


def test_7_2_geo_l_divergent_suffix_gives_1792_cap_reached() -> None:
    m = Checked(geo_l())
    a = toks(2048)
    ra = produce(m, "A", a, finish=False)
    c = a[:1900] + toks(148, base=90_000)
    Ha, Hc = ref_chain(a, 256), ref_chain(c, 256)
    assert Ha[7] == Hc[7] and Ha[8] != Hc[8]
    res = look(m, "C", c)
    assert_lookup(res, hit=1792, reason="cap_reached", top=1792, n=8)
    assert res.copy_src[0] == ra.plan.tables[0][0]
    assert res.state_src[1] == save_block(ra.plan, 1, 1792)


# ============================================================================ §7.9 junction example
def _geo_h_sibling_scenario() -> dict[str, Any]:
    """§7.9: A (200) finished; B (A's first 150 + 70) runs and finishes; C (150 + 80) looks up."""
    m = Checked(geo_h())
    a = toks(200)
    b = a[:150] + toks(70, base=5000)
    c = a[:150] + toks(80, base=9000)
    ra = produce(m, "A", a)
    m.take_events()
    add(m, "B", b)
    rb, pb = admit(m, "B", 220)
    commit1(m, "B", 220, [OUT])
    b_events = stored(m.take_events())
    m.finish("B")
    rc = look(m, "C", c)
    return dict(m=m, a=a, b=b, c=c, ra=ra, rb=rb, pb=pb, rc=rc, b_events=b_events)


def test_7_9_junction_worked_example() -> None:
    s = _geo_h_sibling_scenario()
    m, ra, rb, pb, rc = s["m"], s["ra"], s["rb"], s["pb"], s["rc"]
    Ha, Hb, Hc = ref_chain(s["a"], 16), ref_chain(s["b"], 16), ref_chain(s["c"], 16)
    # A published every boundary 16 … 192 (full keys at 64, 128, 192) and a state at 192.
    a_tab = ra.plan.tables[0]
    a_rows = [(b, k, x) for b, h, k, x in rows(m, 0) if b <= 192 and h == Ha[b // 16]]
    assert a_rows == [
        (b, "full" if b % 64 == 0 else "partial", a_tab[(b - 1) // 64]) for b in range(16, 193, 16)
    ]
    assert block_of(m, 1, Ha[12]) == save_block(ra.plan, 1, 192)
    # B: cap 219, n 13, top 208; F = 144; no state matches → 0, recurrent_limited, J = 144.
    assert_lookup(
        rb,
        hit=0,
        reason="recurrent_limited",
        top=208,
        n=13,
        junction=144,
        bounds=(144, 144, 144, 0),
    )
    # B saves at 144 and 128 (junction, its S floor) besides 208 and 192 (ρ(220), its S floor).
    assert saves(pb) == [128, 144, 192, 208]
    for pos in (128, 144, 192, 208):
        assert block_of(m, 1, Hb[pos // 16]) == save_block(pb, 1, pos)
    assert sorted(b for b, h, _, _ in rows(m, 1) if h == Hb[b // 16]) == [128, 144, 192, 208]
    # B's commit: attention from 160 (16 … 144 are duplicates of A's keys), states in two runs
    # of consecutive M-pages (a run continues while ⌊(b − 1)/M⌋·M is the previous boundary).
    assert s["b_events"] == [
        (0, [160, 176, 192, 208], 128),
        (1, [128, 144], 112),
        (1, [192, 208], 176),
    ]
    # C: full attention 144 (A's entry), state at 144 (B's junction) → 144, no_entry.
    assert_lookup(rc, hit=144, reason="no_entry", top=224, n=14, bounds=(144, 144, 144, 144))
    assert rc.slots[0] == [a_tab[0], a_tab[1], a_tab[2]]
    assert rc.copy_src[0] == a_tab[2]  # page 2 is copied from A's block
    assert rc.state_src[1] == save_block(pb, 1, 144) == block_of(m, 1, Hc[9])


# ============================================================================ §8 replay grid
GRID = {
    # mode, L: (P = 193, P = 200, P = 208)
    ("none", 1): (192, 192, 192),
    ("lookahead", 1): (192, 192, 192),
    ("lookahead", 2): (176, 192, 192),
    ("drop", 1): (176, 176, 192),
}


def _grid_cases() -> list[Any]:
    out = []
    for (mode, L), hits in GRID.items():
        for P, hit in zip((193, 200, 208), hits, strict=True):
            geos = ["geo_d"] if mode == "drop" else ["geo_h", "geo_d"]
            for geo in geos:
                out.append(pytest.param(geo, mode, L, P, hit, id=f"{geo}-{mode}-L{L}-P{P}"))
    return out


def _grid_cfg(geo: str, mode: str, L: int) -> CacheConfig:
    if geo == "geo_d":
        return geo_d(mode, L)
    return geo_h(spec_mode=mode, lookahead_tokens=L)


@pytest.mark.parametrize(("geo", "mode", "L", "P", "hit"), _grid_cases())
def test_8_replay_grid(geo: str, mode: str, L: int, P: int, hit: int) -> None:
    """Identical resend of a finished P-token prompt: ρ(P) per mode (§8 table, u = 16)."""
    m = Checked(_grid_cfg(geo, mode, L))
    a = toks(P)
    produce(m, "A", a)
    res = look(m, "R", a)
    lead = L if mode == "lookahead" else 0
    n = (P - lead) // 16
    top = min(P - 1, n * 16) // 16 * 16
    assert res.n == n and res.top == top
    assert res.hit == hit == m.replay_point(P), res.explain()
    assert res.reason == ("cap_reached" if hit == top else "spec_decode_rewind")


# ========================================================================= §10.3 publication table
def test_10_3_publication_table_geo_p_180() -> None:
    """Prompt 180, one token per decode step up to T = 256: exact keys and events per commit."""
    m = Checked(geo_p())
    a = toks(180)
    add(m, "A", a)
    _, plan = admit(m, "A", 180)
    tab = plan.tables[0]
    assert len(tab) == 3
    outs: list[int] = []

    def full_tokens() -> list[int]:
        return [*a, OUT, *outs]

    commit1(m, "A", 180, [OUT])
    expected = {
        180: ([list(range(16, 177, 16))], 0),
        192: ([[192]], 128),
        208: ([[208]], 192),
        224: ([[224]], 192),
        240: ([[240]], 192),
        256: ([[256]], 192),
    }
    t = 180
    attached: list[int] = []
    while True:
        evs = m.take_events()
        assert not [e for e in evs if not isinstance(e, BlockStored)]  # never a BlockRemoved
        if t in expected:
            runs, start = expected[t]
            H = ref_chain(full_tokens(), 16)
            assert [(g, bs) for g, bs, _ in stored(evs)] == [(0, r) for r in runs]
            (ev,) = evs
            assert ev.token_start == start
            assert ev.parent_hash == (H[start // 16] if start else None)
            assert ev.token_ids == tuple(full_tokens()[start : runs[0][-1]])
            assert [(x.hash, x.kind) for x in ev.entries] == [
                (H[b // 16], "full" if b % 64 == 0 else "partial") for b in runs[0]
            ]
            attached += runs[0]
        else:
            assert evs == [], f"commit to T = {t} attached something"
        # the keys of the index are exactly the boundaries attached so far, each on its page
        H = ref_chain(full_tokens(), 16)
        assert rows(m, 0) == [
            (b, H[b // 16], "full" if b % 64 == 0 else "partial", tab[(b - 1) // 64])
            for b in attached
        ]
        if t == 256:
            break
        p = m.allocate("A", 1)
        assert p is not None and p.start == t
        tab = p.tables[0]
        outs.append(60_000 + t)
        t += 1
        commit1(m, "A", t, [outs[-1]])
    assert attached == list(range(16, 257, 16))
    for page in (2, 3):  # page 2: 144, 160, 176, 192; page 3: 208, 224, 240, 256
        bs = range(64 * page + 16, 64 * page + 65, 16)
        assert keys_on(m, tab[page]) == [(b, "full" if b % 64 == 0 else "partial") for b in bs]
    m.finish("A")
    assert [r[0] for r in rows(m, 0)] == list(range(16, 257, 16))  # finish removes nothing
    assert all(isinstance(e, BlockStored) for e in m.take_events())
    met = m.metrics()
    assert met["kv_entries_published_total"] == {"full": 4, "partial": 12, "state": 0}
    assert met["kv_entries_removed_total"] == {"evicted": 0}


# ============================================================================ §16 edge cases
def test_edge_01_prompt_within_one_unit() -> None:
    m = Checked(geo_h())
    a = toks(16)
    ra = produce(m, "A", a)
    H = ref_chain(a, 16)
    assert saves(ra.plan) == [16]  # rolling only: ρ(16) = 0
    assert [(b, h, k) for b, h, k, _ in rows(m, 0)] == [(16, H[1], "partial")]
    assert [(b, h, k) for b, h, k, _ in rows(m, 1)] == [(16, H[1], "state")]  # φ(16) at finish
    res = look(m, "R", a)  # cap 15, n 1 → top 0
    assert_lookup(res, hit=0, reason="below_unit", top=0, n=1, bounds=(0, 0, 0, 0))
    assert res.slots[0] == [] and res.copy_src.get(0) is None and res.state_src.get(1) is None
    _, plan = admit(m, "R", 16)
    assert plan.copies == [] and plan.recurrent[1].init == "zero"
    res10 = look(m, "S", toks(10))
    assert_lookup(res10, hit=0, reason="below_unit", top=0, n=0)
    _, plan10 = admit(m, "S", 10)
    assert plan10.copies == []
    assert m.metrics()["prefix_cache_reason_total"] == {"below_unit": 3}


def test_edge_02_one_token_past_a_unit() -> None:
    m = Checked(geo_h())
    a = toks(17)
    ra = produce(m, "A", a)
    assert saves(ra.plan) == [16]  # ρ(17) = 16, also the rolling point
    a_p0, st16 = ra.plan.tables[0][0], save_block(ra.plan, 1, 16)
    H = ref_chain(a, 16)
    assert rows(m, 0) == [(16, H[1], "partial", a_p0)]
    assert rows(m, 1) == [(16, H[1], "state", st16)]
    res = look(m, "R", a)
    assert_lookup(res, hit=16, reason="cap_reached", top=16, n=1)
    assert res.slots[0] == [a_p0] and res.copy_src[0] == a_p0 and res.state_src[1] == st16
    _, plan = admit(m, "R", 17)
    assert plan.copies == [Copy(0, a_p0, plan.tables[0][0]), Copy(1, st16, plan.recurrent[1].live)]
    assert plan.tables[0][0] != a_p0
    assert m.metrics()["kv_cow_copies_total"] == {"full": 1, "recurrent": 1}


def test_edge_03_page_aligned_prompt() -> None:
    m = Checked(geo_p())
    a = toks(128)
    ra = produce(m, "A", a)
    p0, p1 = ra.plan.tables[0][:2]
    H = ref_chain(a, 16)
    assert rows(m, 0) == [
        (b, H[b // 16], "full" if b % 64 == 0 else "partial", p0 if b <= 64 else p1)
        for b in range(16, 129, 16)
    ]
    res = look(m, "R", a)
    assert_lookup(res, hit=112, reason="cap_reached", top=112, n=8)
    assert res.slots[0] == [p0, p1] and res.copy_src[0] == p1
    _, plan = admit(m, "R", 128)
    dst = plan.tables[0][1]
    assert plan.tables[0][0] == p0 and dst not in (p0, p1)
    assert plan.copies == [Copy(0, p1, dst)]


def test_edge_04_published_boundary_above_the_cap() -> None:
    m = Checked(geo_l())
    a = toks(2048)
    q = a[:1792]
    H = ref_chain(a, 256)
    # Q finishes first: entries 256 … 1792, states at 1536 (ρ(1792)) and 1792 (φ at finish).
    rq = produce(m, "Q", q)
    q_p0 = rq.plan.tables[0][0]
    assert saves(rq.plan) == [1536, 1792]
    assert [(b, x) for b, _, _, x in rows(m, 0)] == [(b, q_p0) for b in range(256, 1793, 256)]
    assert [(b, h) for b, h, _, _ in rows(m, 1)] == [(1536, H[6]), (1792, H[7])]
    q_st1792 = block_of(m, 1, H[7])
    m.take_events()
    # A is admitted with hit 1792, copies Q's page 0 and adds only 2048 to its copy.
    add(m, "A", a)
    ra, pa = admit(m, "A", 2048)
    assert_lookup(ra, hit=1792, reason="cap_reached", top=1792)
    a_p0 = pa.tables[0][0]
    assert pa.copies == [Copy(0, q_p0, a_p0), Copy(1, q_st1792, pa.recurrent[1].live)]
    assert saves(pa) == [2048]
    commit1(m, "A", 2048, [OUT])
    assert stored(m.take_events()) == [(0, [2048], 0)]  # the lower boundaries are duplicates
    assert keys_on(m, a_p0) == [(2048, "partial")]
    m.finish("A")
    assert stored(m.take_events()) == [(1, [2048], 1792)]  # φ(2048)
    # Both blocks match the resend in page 0: the copy source is the one holding the
    # highest-boundary entry b ≥ hit (§7.8), A's block (2048), not Q's (1792).
    r0 = look(m, "R0", a)
    assert_lookup(r0, hit=1792, reason="cap_reached", top=1792)
    assert r0.copy_src[0] == a_p0 and r0.slots[0] == [a_p0] and r0.state_src[1] == q_st1792
    m.finish("R0")
    # Evict Q's page 0: A's 2048 (above the cap 2047) must cover the resend's 1792.
    evict_key(m, 0, H[7])
    evs = m.take_events()
    assert [(e.group_id, e.boundary, e.kind, e.cause) for e in evs] == [
        (0, b, "partial", "evicted") for b in range(256, 1793, 256)
    ]
    assert all(isinstance(e, BlockRemoved) for e in evs)
    res = look(m, "R", a)
    assert_lookup(res, hit=1792, reason="cap_reached", top=1792)
    assert res.copy_src[0] == a_p0 and res.state_src[1] == q_st1792
    _, plan = admit(m, "R", 2048)
    assert plan.copies[0] == Copy(0, a_p0, plan.tables[0][0])


def test_edge_05_prompt_entries_survive_generation() -> None:
    m = Checked(geo_l())
    a = toks(2048)
    ra = produce(m, "A", a, finish=False)
    a_p0 = ra.plan.tables[0][0]
    st1792 = save_block(ra.plan, 1, 1792)
    m.take_events()
    t = decode(m, "A", 2048, 999)  # 1000 generated tokens in all: N = 3048, T = 3047
    assert t == 3047
    assert stored(m.take_events()) == [(0, [2304], 0), (0, [2560], 0), (0, [2816], 0)]
    m.finish("A")
    assert stored(m.take_events()) == [(1, [2816], 2560)]  # φ(3047) = 2816
    assert keys_on(m, a_p0) == [(b, "partial") for b in range(256, 2817, 256)]  # eleven keys
    res = look(m, "R", a)
    assert_lookup(res, hit=1792, reason="cap_reached", top=1792, n=8)
    assert res.copy_src[0] == a_p0 and res.state_src[1] == st1792


def test_edge_06_divergent_suffix_inside_a_page() -> None:
    m = Checked(geo_l())
    a = toks(2048)
    ra = produce(m, "A", a)
    c = a[:1900] + toks(148, base=90_000)
    Hc = ref_chain(c, 256)
    assert block_of(m, 0, Hc[8]) is None  # C's chain first differs from A's at 2048
    res = look(m, "C", c)
    assert_lookup(res, hit=1792, reason="cap_reached", top=1792, n=8)
    a_p0 = ra.plan.tables[0][0]
    assert res.slots[0] == [a_p0] and res.copy_src[0] == a_p0
    assert res.state_src[1] == save_block(ra.plan, 1, 1792) == block_of(m, 1, Hc[7])
    _, plan = admit(m, "C", 2048)
    assert plan.copies[0] == Copy(0, a_p0, plan.tables[0][0])


def test_edge_07_divergence_after_a_page_end() -> None:
    m = Checked(geo_p())
    a = toks(200)
    ra = produce(m, "A", a)
    tab = ra.plan.tables[0]
    b = a[:150] + toks(70, base=5000)
    res = look(m, "B", b)
    assert_lookup(res, hit=144, reason="no_entry", top=208, n=13, bounds=(144,) * 4)
    assert res.slots[0] == tab[:3] and res.copy_src[0] == tab[2]
    _, plan = admit(m, "B", 220)
    dst = plan.tables[0][2]
    assert plan.tables[0][:2] == tab[:2] and dst not in tab[:3]
    assert plan.copies == [Copy(0, tab[2], dst)]
    step = m.seal_step()
    assert step.copies == plan.copies
    m.take_events()
    m.commit(step.step_id, {"B": (220, [OUT])})
    # B publishes from the start of its copied page: 144 is a duplicate of A's key (no event),
    # 160 … 208 are new, on B's own pages 2 and 3, as one run from token 128.
    Hb = ref_chain(b, 16)
    assert stored(m.take_events()) == [(0, [160, 176, 192, 208], 128)]
    assert block_of(m, 0, Hb[9]) == tab[2]
    assert [block_of(m, 0, Hb[k]) for k in (10, 11, 12, 13)] == [dst, dst, dst, plan.tables[0][3]]
    met = m.metrics()
    assert met["prefix_cache_hits"] == 144 and met["kv_cow_copies_total"] == {"full": 1}
    assert met["prefix_cache_reason_total"] == {"no_entry": 2}


def test_edge_08_shorter_prefix_of_a_cached_prompt() -> None:
    m = Checked(geo_p())
    a = toks(200)
    ra = produce(m, "A", a)
    tab = ra.plan.tables[0]
    res = look(m, "B", a[:180])
    assert_lookup(res, hit=176, reason="cap_reached", top=176, n=11)
    assert res.slots[0] == tab[:3] and res.copy_src[0] == tab[2]
    _, plan = admit(m, "B", 180)
    assert plan.copies == [Copy(0, tab[2], plan.tables[0][2])]


def test_edge_09_recurrent_limited_sibling_and_junction() -> None:
    s = _geo_h_sibling_scenario()
    m, rb, pb, rc = s["m"], s["rb"], s["pb"], s["rc"]
    assert_lookup(rb, hit=0, reason="recurrent_limited", junction=144)
    assert {128, 144} <= set(saves(pb))
    assert_lookup(rc, hit=144, reason="no_entry")
    a_p2 = s["ra"].plan.tables[0][2]
    _, plan = admit(m, "C", 230)
    live = plan.recurrent[1].live
    # page 2 is copied from A's block; the state is copied although 144 is a multiple of M.
    assert plan.copies == [Copy(0, a_p2, plan.tables[0][2]), Copy(1, save_block(pb, 1, 144), live)]
    assert plan.recurrent[1].init == "copy"
    assert m.metrics()["prefix_cache_reason_total"] == {
        "no_entry": 2,
        "recurrent_limited": 1,
    }


def test_edge_10_no_attention_only_hit_no_rewinding() -> None:
    m = Checked(geo_h())
    a = toks(208)
    ra = produce(m, "A", a)
    assert saves(ra.plan) == [192, 208]
    H = ref_chain(a, 16)
    assert [(b, h) for b, h, _, _ in rows(m, 1)] == [(192, H[12]), (208, H[13])]
    st208 = block_of(m, 1, H[13])
    evict_key(m, 1, H[12])
    res = look(m, "B", a[:200])
    bounds = (192, 192, 192, 0)
    assert_lookup(
        res, hit=0, reason="recurrent_limited", top=192, n=12, junction=192, bounds=bounds
    )
    assert res.state_src.get(1) is None
    _, plan = admit(m, "B", 200)
    assert saves(plan) == [192]  # its junction and its replay point
    assert st208 not in [c.src for c in plan.copies] and plan.copies == []


def _isolation_hit(cfg: CacheConfig, producer: dict[str, Any], consumer: dict[str, Any]) -> Any:
    m = Checked(cfg)
    a = toks(200)
    produce(m, "A", a, **producer)
    return look(m, "R", a, **consumer)


@pytest.mark.parametrize(
    ("producer", "consumer", "hit"),
    [
        ({"cache_salt": "t1"}, {"cache_salt": "t2"}, 0),
        ({"cache_salt": "t1"}, {}, 0),
        ({"cache_salt": "t1"}, {"cache_salt": "t1"}, 192),
        ({}, {"cache_salt": "t1"}, 0),
        ({}, {"cache_salt": ""}, 192),
        ({"cache_salt": ""}, {}, 192),
    ],
    ids=["t1-t2", "t1-none", "t1-t1", "none-t1", "none-empty", "empty-none"],
)
def test_edge_11_salt_isolation_both_directions(
    producer: dict[str, Any], consumer: dict[str, Any], hit: int
) -> None:
    res = _isolation_hit(geo_p(), producer, consumer)
    assert_lookup(res, hit=hit, reason="cap_reached" if hit else "no_entry", top=192)


def test_edge_11_salt_never_appears_in_events() -> None:
    m = Checked(geo_p())
    produce(m, "A", toks(200), cache_salt="secret-salt-t1")
    evs = m.take_events()
    assert evs and all("secret-salt-t1" not in repr(e) for e in evs)
    H = ref_chain(toks(200), 16, salt="secret-salt-t1")
    assert [h for _, h, _, _ in rows(m, 0)] == [H[k] for k in range(1, 13)]


@pytest.mark.parametrize(
    ("consumer", "hit"),
    [(("fr", "/ad/v2"), 0), (None, 0), (("fr", "/ad/v1"), 192)],
    ids=["path-v2", "no-lora", "same"],
)
def test_edge_12_lora_path_change(consumer: tuple[str, str] | None, hit: int) -> None:
    res = _isolation_hit(geo_p(), {"lora": ("fr", "/ad/v1")}, {"lora": consumer})
    m = Checked(geo_p())
    produce(m, "A", toks(200), lora=("fr", "/ad/v1"))
    (ev,) = m.take_events()  # the path is part of the key, so events carry it (§13)
    assert ev.lora == ("fr", "/ad/v1")
    H = ref_chain(toks(200), 16, lora=("fr", "/ad/v1"))
    assert [h for _, h, _, _ in rows(m, 0)] == H[1:13]
    assert_lookup(res, hit=hit, reason="cap_reached" if hit else "no_entry", top=192)


@pytest.mark.parametrize(
    ("item", "hit"),
    [
        (MultiModalItem("img-9f", 36, 40), 16),
        (MultiModalItem("img-00", 20, 40), 16),
        (MultiModalItem("img-9f", 20, 40), 192),
    ],
    ids=["offset-36", "other-identifier", "identical"],
)
def test_edge_13_multimodal_offset_change(item: MultiModalItem, hit: int) -> None:
    m = Checked(geo_p())
    a = toks(200)
    a_img = MultiModalItem("img-9f", 20, 40)
    ra = produce(m, "A", a, mm_items=[a_img])
    Ha, Hb = ref_chain(a, 16, mm=[a_img]), ref_chain(a, 16, mm=[item])
    assert [h for _, h, _, _ in rows(m, 0)] == Ha[1:13]
    (ev,) = m.take_events()  # §13: per unit of [0, 192), that unit's ("mm", …) keys
    img = [(("mm", "img-9f", 20 - s),) for s in (16, 32, 48)]
    assert ev.extra_keys == ((), *img, *[()] * 8) and ev.lora is None
    if hit == 16:
        assert Ha[1] == Hb[1] and Ha[2] != Hb[2]  # unit 1 holds no image in either request
    res = look(m, "B", a, mm_items=[item])
    assert_lookup(res, hit=hit, reason="cap_reached" if hit == 192 else "no_entry", top=192)
    tab = ra.plan.tables[0]
    if hit == 16:  # page 0 is copied from A's block
        assert res.slots[0] == [tab[0]] and res.copy_src[0] == tab[0]
    else:  # page-aligned: shared pages, no copy
        assert res.slots[0] == tab[:3] and res.copy_src.get(0) is None


TYPED_VARIANTS: dict[str, dict[str, Any]] = {
    "salt x": {"cache_salt": "x"},
    "lora name x": {"lora": ("x", "")},
    "lora ab/c": {"lora": ("ab", "c")},
    "lora a/bc": {"lora": ("a", "bc")},
    "image 'salt'": {"mm_items": [MultiModalItem("salt", 0, 16)]},
    "salt 'salt'": {"cache_salt": "salt"},
}


def _ref_kw(kw: dict[str, Any]) -> dict[str, Any]:
    return {
        "salt": kw.get("cache_salt"),
        "lora": kw.get("lora"),
        "mm": kw.get("mm_items", ()),
    }


def test_edge_14_typed_keys_do_not_collide() -> None:
    m = Checked(geo_p())
    a = toks(32)
    h1 = {}
    for i, (name, kw) in enumerate(TYPED_VARIANTS.items()):
        produce(m, f"P{i}", a, **kw)
        h1[name] = ref_chain(a, 16, **_ref_kw(kw))[1]
    assert len(set(h1.values())) == len(TYPED_VARIANTS)  # all different H[1]
    assert sorted(h for b, h, _, _ in rows(m, 0) if b == 16) == sorted(h1.values())
    for i, (name, kw) in enumerate(TYPED_VARIANTS.items()):
        res = look(m, f"C{i}", a, **kw)  # each finds exactly its own producer's entry
        assert_lookup(res, hit=16, reason="cap_reached", top=16)
        assert res.copy_src[0] == block_of(m, 0, h1[name])


@pytest.mark.parametrize(
    ("x", "y"),
    [("salt x", "lora name x"), ("lora ab/c", "lora a/bc"), ("image 'salt'", "salt 'salt'")],
)
@pytest.mark.parametrize("swap", [False, True], ids=["fwd", "rev"])
def test_edge_14_typed_keys_never_share_entries(x: str, y: str, swap: bool) -> None:
    if swap:
        x, y = y, x
    m = Checked(geo_p())
    a = toks(32)
    produce(m, "P", a, **TYPED_VARIANTS[x])
    res = look(m, "C", a, **TYPED_VARIANTS[y])
    assert_lookup(res, hit=0, reason="no_entry", top=16)


REPRO_SCRIPT = r"""
import sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from kvreuse.core import CacheConfig, GroupSpec, KVCacheManager, Request
    algo, seed = sys.argv[1], (sys.argv[2] or None)
    cfg = CacheConfig(num_blocks=8, groups=[GroupSpec("full", 16)], hash_algo=algo,
                      hash_seed=seed)
    m = KVCacheManager(cfg)
    m.add_request(Request("a", list(range(100, 148))))
    res = m.lookup("a")
    m.allocate("a", 48, lookup=res)
    step = m.seal_step()
    m.commit(step.step_id, {"a": (48, [1])})
print(len(caught))
print(" ".join(f"{b}:{h.hex()}" for _, b, h, _, _ in m.export_entries()))
"""


def _repro(algo: str, seed: str = "") -> tuple[int, str]:
    out = subprocess.run(
        [sys.executable, "-c", REPRO_SCRIPT, algo, seed],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split("\n")
    return int(out[0]), out[1]


def _in_process(algo: str, seed: str) -> str:
    groups = [GroupSpec("full", 16)]
    m = Checked(CacheConfig(num_blocks=8, groups=groups, hash_algo=algo, hash_seed=seed))  # type: ignore[arg-type]
    produce(m, "a", list(range(100, 148)), finish=False)
    return " ".join(f"{b}:{h.hex()}" for _, b, h, _, _ in m.export_entries())


def test_edge_15_reproducibility_sha256_across_managers_and_processes() -> None:
    H = ref_chain(list(range(100, 148)), 16)
    want = " ".join(f"{16 * k}:{H[k].hex()}" for k in (1, 2, 3))
    m1, m2 = Checked(geo_p()), Checked(geo_p())
    produce(m1, "a", toks(100))
    produce(m2, "b", toks(100))
    assert [r[:3] for r in rows(m1, 0)] == [r[:3] for r in rows(m2, 0)]
    w1, p1 = _repro("sha256")
    w2, p2 = _repro("sha256")
    assert (w1, w2) == (0, 0)
    assert p1 == p2 == want


@pytest.mark.parametrize("algo", ["xxh3_128", "blake3"])
def test_edge_15_reproducibility_fast_digests(algo: str) -> None:
    w1, p1 = _repro(algo)
    w2, p2 = _repro(algo)
    assert w1 >= 1 and w2 >= 1  # the per-process random seed is announced
    assert p1 != p2  # … and the processes do not share keys
    b1 = [x.split(":")[0] for x in p1.split()]
    assert b1 == ["16", "32", "48"]
    s1, q1 = _repro(algo, "shared-seed")
    s2, q2 = _repro(algo, "shared-seed")
    assert (s1, s2) == (0, 0)
    assert q1 == q2 == _in_process(algo, "shared-seed")
    _, other = _repro(algo, "other-seed")
    assert other != q1


@pytest.mark.parametrize(
    ("L", "P", "hit"),
    [(1, 193, 192), (1, 200, 192), (1, 208, 192), (2, 193, 176)],
)
def test_edge_16_lookahead_grid_geo_h(L: int, P: int, hit: int) -> None:
    m = Checked(geo_h(spec_mode="lookahead", lookahead_tokens=L))
    a = toks(P)
    produce(m, "A", a)
    res = look(m, "R", a)
    assert_lookup(res, hit=hit, reason="cap_reached", top=hit, n=(P - L) // 16)
    H = ref_chain(a, 16, L)
    assert res.state_src[1] == block_of(m, 1, H[hit // 16])


def test_edge_17_drop_versus_lookahead_200() -> None:
    m = Checked(geo_d("drop"))
    a = toks(200)
    ra = produce(m, "A", a)
    H = ref_chain(a, 16)
    assert saves(ra.plan) == [128, 176, 192]  # ρ = 176 and its S floor; rolling 176, 192
    assert [b for b, *_ in rows(m, 1)] == [128, 176]  # φ(200) = 176 in drop mode
    assert [b for b, *_ in rows(m, 2)] == list(range(16, 193, 16))
    assert stored(m.take_events()) == [
        (0, list(range(16, 193, 16)), 0),
        (1, [128], 112),
        (1, [176], 160),
        (2, list(range(16, 193, 16)), 0),
    ]
    res = look(m, "R", a)
    # the draft group would need an entry at 208 > n·u = 192: one unit lost, never a page
    assert_lookup(
        res, hit=176, reason="spec_decode_rewind", top=192, n=12, bounds=(192, 176, 176, 176)
    )
    t0, t2 = ra.plan.tables[0], ra.plan.tables[2]
    assert res.copy_src[0] == t0[2] and res.copy_src[2] == t2[2]
    assert res.state_src[1] == block_of(m, 1, H[11])
    _, plan = admit(m, "R", 200)
    assert {(c.group_id, c.src) for c in plan.copies} == {
        (0, t0[2]),
        (1, block_of(m, 1, H[11])),
        (2, t2[2]),
    }
    ml = Checked(geo_d("lookahead", 1))
    produce(ml, "A", a)
    assert_lookup(look(ml, "R", a), hit=192, reason="cap_reached", top=192, n=12)


@pytest.mark.parametrize(("mode", "n"), [("drop", 13), ("lookahead", 12)])
def test_edge_17_drop_versus_lookahead_208(mode: str, n: int) -> None:
    m = Checked(geo_d(mode, 1))
    a = toks(208)
    produce(m, "A", a)
    assert_lookup(look(m, "R", a), hit=192, reason="cap_reached", top=192, n=n)


def test_edge_18_drop_mode_continuation() -> None:
    m = Checked(geo_d("drop"))
    a = toks(200)
    ra = produce(m, "A", a, finish=False)
    t = decode(m, "A", 200, 39)  # 40 generated tokens in all
    assert t == 239
    # held keeps the states at 208 and 224 (κ + 1 = 2), plus the live block
    assert m.metrics()["kv_blocks_in_use"]["recurrent"] == 3
    m.take_events()
    m.finish("A")
    full = [*a, OUT, *(50_000 + i for i in range(39))]
    assert len(full) == 240
    H = ref_chain(full, 16)
    assert stored(m.take_events()) == [(1, [208], 192)]  # φ(239) = 224 − 16 = 208
    assert [(b, h) for b, h, _, _ in rows(m, 1)] == [(128, H[8]), (176, H[11]), (208, H[13])]
    assert saves(ra.plan) == [128, 176, 192]
    turn2 = full + toks(60, base=70_000)
    res = look(m, "T2", turn2)
    # target attention accepts 224, the draft group 224 − 16; the state at 208 exists
    assert_lookup(
        res, hit=208, reason="spec_decode_rewind", top=288, n=18, bounds=(224, 208, 208, 208)
    )
    assert res.state_src[1] == block_of(m, 1, H[13])
