"""Spec cases on lookup: hits, reasons, junctions, slots and copies, against the rules of §7–§8.

* §7.2 (the covering rule) on Geo-L: identical resends of 2,048 and 2,049 tokens (the rows of the
  §7.2 table) and a suffix diverging inside page 0 (the situation of §16 case 6).
* §7.9 (the junction) on the situation of §16 case 9: A(200) finished, B = A[:150] + 70 runs and
  finishes, C = A[:150] + 80; B's junction saves and events, C's hit through B's state.
* §8 replay grid: ρ(P) of an identical resend per spec mode at P = 193, 200, 208 (the §8 table's
  three residues mod u, one page up from its P = 161, 170, 176).
* §16 cases 1–10: hits within and past one unit, page-aligned prompts, an entry above the cap
  covering a hit (case 4), prompt entries surviving generation, divergence inside and after a
  page, shorter prefixes, `recurrent_limited` with a junction, no attention-only fallback.
* §16 cases 16–18: lookahead, drop versus lookahead, drop's continuation (§7.6, §8).
* §16 cases 32–35: three groups (sliding, recurrent), chunked starts and copies, a junction over
  every attention group, three groups with a drafter in drop mode (§7.3, §7.4, §7.7).

Every test drives a real `KVCacheManager` through the public cycle with `check_invariants()` after
every operation, and checks keys against the reference chain (`spec_harness.ref_chain`).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvreuse.core import BlockRemoved, CacheConfig, Copy
from spec_harness import (
    A200,
    B_SIBLING,
    DRAFT64,
    NULL,
    OUT,
    Checked,
    G,
    Harness,
    add,
    admit,
    assert_lookup,
    block_of,
    commit1,
    decode,
    evict_key,
    geo_3,
    geo_c,
    geo_d,
    geo_h,
    geo_l,
    geo_p,
    keys_on,
    look,
    produce,
    ref_chain,
    rows,
    save_block,
    saves,
    stored,
    toks,
)


# ============================================================================= §7.2 worked examples
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


# =========================================================================== §7.9 junction (case 9)
def _geo_h_sibling_scenario() -> dict[str, Any]:
    """Case 9 (§7.9): A (200) finished; B (A's first 150 + 70) runs and finishes; C (150 + 80)."""
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


def test_7_9_junction_on_case09_siblings() -> None:
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


# =================================================================================== §8 replay grid
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
    """Identical resend of a finished P-token prompt: ρ(P) per mode (§8 replay grid, u = 16)."""
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


# =================================================================================== §16 cases 1–10
def test_case01_prompt_within_one_unit() -> None:
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


def test_case02_one_token_past_a_unit() -> None:
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


def test_case03_page_aligned_prompt() -> None:
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


def test_case04_published_boundary_above_the_cap() -> None:
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


def test_case05_prompt_entries_survive_generation() -> None:
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


def test_case06_divergent_suffix_inside_a_page() -> None:
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


def test_case07_divergence_after_a_page_end() -> None:
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


def test_case08_shorter_prefix_of_a_cached_prompt() -> None:
    m = Checked(geo_p())
    a = toks(200)
    ra = produce(m, "A", a)
    tab = ra.plan.tables[0]
    res = look(m, "B", a[:180])
    assert_lookup(res, hit=176, reason="cap_reached", top=176, n=11)
    assert res.slots[0] == tab[:3] and res.copy_src[0] == tab[2]
    _, plan = admit(m, "B", 180)
    assert plan.copies == [Copy(0, tab[2], plan.tables[0][2])]


def test_case09_recurrent_limited_sibling_and_junction() -> None:
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


def test_case10_no_attention_only_hit_no_rewinding() -> None:
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


# ===================================================================== §16 cases 16–18 (spec modes)
@pytest.mark.parametrize(
    ("L", "P", "hit"),
    [(1, 193, 192), (1, 200, 192), (1, 208, 192), (2, 193, 176)],
)
def test_case16_lookahead_grid_geo_h(L: int, P: int, hit: int) -> None:
    m = Checked(geo_h(spec_mode="lookahead", lookahead_tokens=L))
    a = toks(P)
    produce(m, "A", a)
    res = look(m, "R", a)
    assert_lookup(res, hit=hit, reason="cap_reached", top=hit, n=(P - L) // 16)
    H = ref_chain(a, 16, L)
    assert res.state_src[1] == block_of(m, 1, H[hit // 16])


def test_case17_drop_versus_lookahead_200() -> None:
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
def test_case17_drop_versus_lookahead_208(mode: str, n: int) -> None:
    m = Checked(geo_d(mode, 1))
    a = toks(208)
    produce(m, "A", a)
    assert_lookup(look(m, "R", a), hit=192, reason="cap_reached", top=192, n=n)


def test_case18_drop_mode_continuation() -> None:
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


# ====================================================================================== §16 case 32
def test_case32_three_groups_resend_and_sibling() -> None:
    h = Harness(geo_3())
    _, pa = h.finished("A", A200)
    sl = pa.tables[1]
    h.add("R", A200)
    res = h.lookup("R")
    assert (res.hit, res.reason) == (192, "cap_reached")
    assert res.slots[0] == pa.tables[0][:3]
    assert res.slots[1] == [NULL, NULL, NULL, NULL, sl[4], sl[5]]  # sliding pages 160 and 192
    assert res.copy_src[0] is None and res.copy_src[1] is None
    assert res.state_src[2] == save_block(pa, 2, 192)
    h.add("B", B_SIBLING)
    rb = h.lookup("B")
    assert (rb.hit, rb.reason, rb.junction) == (0, "recurrent_limited", 144)
    assert rb.bounds == (144, 144, 144, 0)
    pb = h.admit("B", res=rb)
    # junction 144 and its floors 128 (M = 32, S = 64); replay ρ(220) = 208 and floor 192
    assert saves(pb, 2) == [128, 144, 192, 208]


def test_case32_three_groups_dense_with_evicted_sliding_page() -> None:
    h = Harness(geo_3(recurrent_retention="dense"))
    _, pa = h.finished("A", A200)
    assert [b for g, b, *_ in h.entries(2)] == list(range(32, 193, 32))
    h.evict(pa.tables[1][3])  # sliding page [96, 128)
    h.add("B", B_SIBLING)
    rb = h.lookup("B")
    assert (rb.hit, rb.reason) == (96, "window_limited")
    assert rb.bounds[0] == 144  # full attention still accepts 144
    assert rb.junction is None


# ====================================================================================== §16 case 33
def test_case33_chunked_start_needs_no_entry() -> None:
    h = Harness(geo_c())
    _, pa = h.finished("A", A200)
    h.add("B", A200 + toks(100, 90_000))
    rb = h.lookup("B")
    assert (rb.top, rb.hit, rb.reason) == (288, 192, "no_entry")
    assert rb.slots[1] == [NULL] * 6
    assert rb.copy_src[1] is None and rb.copy_src[0] is None
    assert rb.slots[0] == pa.tables[0][:3]
    pb = h.admit("B", res=rb)
    assert pb.tables[1][:6] == [NULL] * 6
    assert pb.copies == []


def test_case33_chunked_resend_inside_chunk_copies_both_groups() -> None:
    h = Harness(geo_c())
    q150 = toks(150)
    _, pq = h.finished("Q", q150)
    assert max(h.boundaries(1)) == 144
    h.add("R", q150)
    res = h.lookup("R")
    assert (res.hit, res.reason) == (144, "cap_reached")
    assert res.copy_src[0] == pq.tables[0][2]
    assert res.copy_src[1] == pq.tables[1][4]
    assert res.slots[1] == [NULL, NULL, NULL, NULL, pq.tables[1][4]]
    plan = h.admit("R", res=res)
    assert sorted((c.group_id, c.src) for c in plan.copies) == [
        (0, pq.tables[0][2]),
        (1, pq.tables[1][4]),
    ]


# ====================================================================================== §16 case 34
def test_case34_junction_over_all_attention_groups() -> None:
    cfg = CacheConfig(
        num_blocks=64, dcp_size=4, groups=[G("full", 16), G("recurrent", 16), G("full", 16)]
    )
    h = Harness(cfg)
    _, pa = h.finished("A", A200)
    h.evict(pa.tables[2][1])  # the second full group's page 1
    h.add("B", B_SIBLING)
    rb = h.lookup("B")
    assert (rb.hit, rb.reason, rb.junction) == (0, "recurrent_limited", 64)
    assert rb.bounds == (64, 64, 64, 0)
    pb = h.admit("B", res=rb)
    positions = saves(pb, 1)
    assert 64 in positions and 144 not in positions


# ====================================================================================== §16 case 35
def test_case35_three_groups_with_drop() -> None:
    h = Harness(geo_3(extra=[DRAFT64], spec_mode="drop"))
    _, pa = h.finished("A", A200)
    # drop: ρ(200) = 176, its floors 160 (M = 32) and 128 (S = 64); φ(200) = 176
    assert [b for g, b, *_ in h.entries(2)] == [128, 160, 176]
    h.add("R", A200)
    res = h.lookup("R")
    assert (res.top, res.hit, res.reason) == (192, 176, "spec_decode_rewind")
    assert res.bounds == (192, 176, 176, 176)
    assert res.copy_src[1] == pa.tables[1][5]  # sliding entry at 176
    assert res.state_src[2] == save_block(pa, 2, 176)
