"""The spec's worked examples, with the numbers docs/semantics.md prints.

The topic modules pin the rules on their own scenarios; this one checks that each example the
spec prints comes out as printed, so a change to either the code or the spec's prose that makes
them disagree fails here:

* §7.2 the Geo-L table (P = 2,047 / 2,048 / 2,049: the producer's entries and states, the warm
  resend and the appended resend) and the covering rule at work on Geo-H;
* §7.9 the junction example on Geo-H (A of 100 tokens, B of 120, C of 130);
* §8 the replay grid at P = 161, 170 and 176 in every mode;
* §10.3 the publication table of a 100-token prompt on Geo-P, decoded to T = 128.

Every manager call is followed by `check_invariants()` (`Checked`).
"""

from __future__ import annotations

import pytest

from spec_harness import (
    OUT,
    Checked,
    add,
    admit,
    assert_lookup,
    commit1,
    geo_d,
    geo_h,
    geo_l,
    geo_p,
    keys_on,
    look,
    produce,
    rows,
    save_block,
    saves,
    stored,
    toks,
)


# ================================================================================ §7.2 Geo-L table
@pytest.mark.parametrize(
    ("P", "entries", "states", "warm", "appended"),
    [
        (2047, range(256, 1793, 256), [1792], (1792, "cap_reached"), (1792, "no_entry")),
        (2048, range(256, 2049, 256), [1792, 2048], (1792, "cap_reached"), (2048, "cap_reached")),
        (2049, range(256, 2049, 256), [2048], (2048, "cap_reached"), (2048, "cap_reached")),
    ],
)
def test_7_2_geo_l_table(
    P: int, entries: range, states: list[int], warm: tuple[int, str], appended: tuple[int, str]
) -> None:
    """A producer of P tokens prefills, samples one token and finishes; then the same prompt
    ("warm") and the prompt with 8 tokens appended are looked up."""
    m = Checked(geo_l())
    a = toks(P)
    produce(m, "A", a)
    page0 = rows(m, 0)
    assert [b for b, *_ in page0] == list(entries)
    if P == 2047:  # "all partial in page 0"
        assert {kind for _, _, kind, _ in page0} == {"partial"}
    assert [b for b, *_ in rows(m, 1)] == states
    assert_lookup(look(m, "W", a), hit=warm[0], reason=warm[1])
    assert_lookup(look(m, "X", a + toks(8, base=90_000)), hit=appended[0], reason=appended[1])


def test_7_2_warm_2048_copies_page_and_state() -> None:
    """Warm 2,048: cap 2,047, n = 8, top = 1,792; the hit ends inside the 8,192-token page, so
    both the page and the state at 1,792 are copied."""
    m = Checked(geo_l())
    a = toks(2048)
    run = produce(m, "A", a)
    res = look(m, "W", a)
    assert_lookup(res, hit=1792, reason="cap_reached", top=1792, n=8)
    assert res.copy_src[0] == run.plan.tables[0][0]
    assert res.state_src[1] == save_block(run.plan, 1, 1792)


def test_7_2_covering_rule_at_work_geo_h() -> None:
    """Q (32 tokens) finishes; A (48) is admitted with hit 32 and adds only the entry at 48; Q's
    page block is evicted; a resend of A still gets 32, from A's entry at 48 in the same page."""
    m = Checked(geo_h())
    a = toks(48)
    q = produce(m, "Q", a[:32])
    q_page = q.plan.tables[0][0]
    assert keys_on(m, q_page) == [(16, "partial"), (32, "partial")]
    assert [b for b, *_ in rows(m, 1)] == [16, 32]
    add(m, "A", a)
    res_a, plan_a = admit(m, "A", 48)
    assert res_a.hit == 32
    commit1(m, "A", 48, [OUT])
    m.finish("A")
    a_page = plan_a.tables[0][0]
    assert keys_on(m, a_page) == [(48, "partial")]  # 16 and 32 were duplicates
    assert 48 in [b for b, *_ in rows(m, 1)]
    m.evict(q_page)
    res = look(m, "R", a)
    assert (res.hit, res.top) == (32, 32), res.explain()
    assert res.copy_src[0] == a_page


# =================================================================================== §7.9 junction
def test_7_9_junction_example_geo_h() -> None:
    """A (100) finishes; B shares A's first 90 tokens (120 in all): hit 64, recurrent_limited,
    junction 80, bounds 80/80/80/64, states planned at 80 and 112; C (the same 90 tokens, 130 in
    all) then gets 80, no_entry."""
    m = Checked(geo_h())
    a = toks(100)
    run_a = produce(m, "A", a)
    assert [b for b, *_ in rows(m, 0)] == list(range(16, 97, 16))
    assert [kind for b, _, kind, _ in rows(m, 0) if b == 64] == ["full"]
    assert [b for b, *_ in rows(m, 1)] == [64, 96]
    b = a[:90] + toks(30, base=5000)
    add(m, "B", b)
    res_b, plan_b = admit(m, "B", 120)
    assert_lookup(
        res_b,
        hit=64,
        reason="recurrent_limited",
        top=112,
        n=7,
        junction=80,
        bounds=(80, 80, 80, 64),
    )
    assert res_b.state_src[1] == save_block(run_a.plan, 1, 64)
    assert saves(plan_b, 1) == [80, 112]
    commit1(m, "B", 120, [OUT])
    m.finish("B")
    c = a[:90] + toks(40, base=9000)
    assert_lookup(look(m, "C", c), hit=80, reason="no_entry")


# =================================================================================== §8 replay grid
@pytest.mark.parametrize(
    ("mode", "L", "hits"),
    [
        ("none", 1, (160, 160, 160)),
        ("lookahead", 1, (160, 160, 160)),
        ("lookahead", 2, (144, 160, 160)),
        ("drop", 1, (144, 144, 160)),
    ],
)
def test_8_replay_grid_as_printed(mode: str, L: int, hits: tuple[int, int, int]) -> None:
    """Identical resends of P = 161, 170, 176 (Geo-H for none and lookahead, Geo-D for drop);
    drop reports spec_decode_rewind where P is not a multiple of u, and P = 176 cap_reached."""
    for P, hit in zip((161, 170, 176), hits, strict=True):
        m = Checked(geo_d(mode, L) if mode == "drop" else geo_h(spec_mode=mode, lookahead_tokens=L))
        a = toks(P)
        produce(m, "A", a)
        res = look(m, "R", a)
        assert res.hit == hit == m.replay_point(P), (mode, L, P, res.explain())
        if mode == "drop":
            assert res.reason == ("cap_reached" if P % 16 == 0 else "spec_decode_rewind")


# ========================================================================= §10.3 publication table
def test_10_3_publication_table_geo_p_100_to_128() -> None:
    """Prefill of 100 tokens, then one token per decode step to T = 128: Stored [16 … 96] at the
    prefill, [112] at T = 112 and [128] at T = 128 (both token_start 64), nothing in between;
    page 1's block ends with 80, 96, 112 (partial) and 128 (full)."""
    m = Checked(geo_p())
    add(m, "A", toks(100))
    _, plan = admit(m, "A", 100)
    commit1(m, "A", 100, [OUT])
    published = {100: stored(m.take_events())}
    t = 100
    while t < 128:
        m.allocate("A", 1)
        t += 1
        commit1(m, "A", t, [60_000 + t])
        events = stored(m.take_events())
        if events:
            published[t] = events
    assert published == {
        100: [(0, [16, 32, 48, 64, 80, 96], 0)],
        112: [(0, [112], 64)],
        128: [(0, [128], 64)],
    }
    page1 = plan.tables[0][1]
    assert keys_on(m, page1) == [(80, "partial"), (96, "partial"), (112, "partial"), (128, "full")]
