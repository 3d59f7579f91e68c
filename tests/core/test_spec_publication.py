"""Spec cases on commit and publication (§10): which keys appear at which commit, and their events.

* §10.3 per commit on Geo-P, the 180-token sequence of §16 case 31 (prompt prefilled, then one
  token per decode step to T = 256): exact keys, kinds, blocks and `BlockStored` events; the §10.3
  table shows the same rules on a 100-token prompt.
* §16 case 19 (§9.4, §10.1, §10.4): a decode step with drafts; one accepted holds the rolling save
  and publishes the page's full key, none accepted releases the save unkeyed.
* §16 case 30 (§12.1): prompt logprobs (`skip_read`) reads nothing, still publishes.
* §16 case 31 (§10.3 promotion): a page becoming full adds its full key beside the partial ones.
"""

from __future__ import annotations

from kvreuse.core import BlockStored, RequestPlan
from spec_harness import (
    A200,
    OUT,
    Checked,
    Harness,
    add,
    admit,
    commit1,
    geo_h,
    geo_p,
    keys_on,
    reason_total,
    ref_chain,
    rows,
    save_block,
    saves,
    stored,
    stored_events,
    stored_runs,
    toks,
)


# ================================================================================= §10.3 per commit
def test_10_3_publication_per_commit_geo_p_180_to_256() -> None:
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


# ====================================================================================== §16 case 19
def _case19_setup() -> tuple[Harness, RequestPlan, RequestPlan]:
    h = Harness(geo_h())
    _, prefill = h.prefill("R", toks(190))  # T = 190, N = 191
    # prefill [0, 190): saves at 176 (rolling + replay ρ(190)) and 128 (S floor of 176)
    assert saves(prefill, 1) == [128, 176]
    h.events()
    plan = h.grow("R", 4)  # decode: start 190 = N − 1, positions 190–193, three drafts
    assert (plan.start, plan.end) == (190, 194)
    assert saves(plan, 1) == [192]  # the rolling save at 192 (9.4, decode step)
    return h, prefill, plan


def test_case19_one_draft_accepted_holds_save_and_publishes_full_key() -> None:
    h, prefill, plan = _case19_setup()
    page2 = plan.tables[0][2]
    s192 = save_block(plan, 1, 192)
    s176 = save_block(prefill, 1, 176)
    held0 = h.counter("kv_checkpoint_saves_total")["held"]
    step = h.seal()
    # one draft accepted: T′ = 192 = start + 1 + 1; the accepted draft plus one bonus token
    h.commit(step, {"R": (192, h.sample(2))})
    assert h.ref(s192) == 1 and s192 not in h.order()  # held (10.1 step 3)
    assert h.keys_of(s192) == []  # a rolling save is held, not published
    assert h.counter("kv_checkpoint_saves_total")["held"] == held0 + 1
    assert (0, 192, "full") in h.keys_of(page2)
    assert h.keys_of(page2) == [
        (0, 144, "partial"),
        (0, 160, "partial"),
        (0, 176, "partial"),
        (0, 192, "full"),
    ]
    # the state at 176 left [φ(192), 192] = [192, 192]: released, keyed, to the tail
    assert h.ref(s176) == 0 and h.order()[-1] == s176
    ev = h.events()
    assert stored_runs(ev) == [(0, [192])]
    assert stored_events(ev)[0].token_start == 128
    h.finish("R")  # φ(192) = 192: the held state is published at the release (10.4)
    assert stored_runs(h.events()) == [(1, [192])]
    assert h.keys_of(s192) == [(1, 192, "state")]


def test_case19_no_draft_accepted_releases_save_without_key() -> None:
    h, prefill, plan = _case19_setup()
    s192 = save_block(plan, 1, 192)
    s176 = save_block(prefill, 1, 176)
    before = h.boundaries(0)
    disc0 = h.counter("kv_checkpoint_saves_total")["discarded"]
    step = h.seal()
    h.commit(step, {"R": (191, h.sample(1))})  # none accepted: T′ = 191, one corrected token
    assert h.boundaries(0) == before and max(before) == 176  # R's entries still end at 176
    assert h.keys_of(s192) == [] and h.ref(s192) == 0
    assert h.order()[0] == s192  # released without a key: queue head (11.2)
    assert h.counter("kv_checkpoint_saves_total")["discarded"] == disc0 + 1
    assert all(b != 192 for g, b, *_ in h.entries(1))
    assert h.ref(s176) == 1  # still held: φ(191) = 176
    assert h.events() == []
    # the next step reuses the page allocated for the rejected drafts (9.6)
    again = h.grow("R", 4)  # start 191 = N̂ − 1 (N = 192), end 195 → still 4 pages
    assert again.new_blocks[0] == []
    assert again.tables[0] == plan.tables[0]


# ====================================================================================== §16 case 30
def test_case30_prompt_logprobs_skip_read() -> None:
    h = Harness(geo_p())
    h.finished("A", A200)
    entries = h.entries()
    m0 = h.mgr.metrics()
    h.add("B", A200, skip_read=True)
    res = h.lookup("B")
    assert (res.hit, res.pending_hit, res.reason) == (0, 0, "skip_read")
    h.admit("B", res=res)
    m1 = h.mgr.metrics()
    assert m1["prefix_cache_queries"] - m0["prefix_cache_queries"] == 200
    assert m1["prefix_cache_hits"] - m0["prefix_cache_hits"] == 0
    assert m1["prefix_cache_requests"] - m0["prefix_cache_requests"] == 1
    assert reason_total(h).get("skip_read", 0) == 1
    h.events()
    h.commit(h.seal(), {"B": (200, h.sample())})
    assert h.events() == []  # all of B's entries are duplicates
    assert h.entries() == entries
    stats = h.finish("B")
    assert (stats.cached_tokens, stats.reason) == (0, "skip_read")


def test_case30_skip_read_still_publishes_new_entries() -> None:
    h = Harness(geo_p())
    h.add("B", A200, skip_read=True)
    res = h.lookup("B")
    assert res.reason == "skip_read"
    h.admit("B", res=res)
    h.commit(h.seal(), {"B": (200, h.sample())})
    assert h.boundaries(0) == list(range(16, 193, 16))


# ====================================================================================== §16 case 31
def test_case31_promotion_keeps_partial_entries() -> None:
    h = Harness(geo_p())
    a180 = toks(180)
    _, pa = h.prefill("A", a180)
    first = h.events()
    assert stored_runs(first) == [(0, list(range(16, 177, 16)))]
    ev0 = stored_events(first)[0]
    assert ev0.token_start == 0 and ev0.parent_hash is None
    assert [x.kind for x in ev0.entries] == [
        "full" if b % 64 == 0 else "partial" for b in range(16, 177, 16)
    ]
    assert ev0.token_ids == tuple(a180[:176])
    assert (ev0.block_size, ev0.hash_unit) == (64, 16)
    seen: list[tuple[int, int, int, str]] = []  # (T, boundary, token_start, kind)
    plans: list[RequestPlan] = []
    for t in range(181, 257):
        plans += h.decode("A")
        for e in h.events():
            assert isinstance(e, BlockStored), e
            for x in e.entries:
                seen.append((t, x.boundary, e.token_start, x.kind))
            assert e.token_ids == tuple(h.tokens["A"][e.token_start : e.entries[-1].boundary])
    assert seen == [
        (192, 192, 128, "full"),
        (208, 208, 192, "partial"),
        (224, 224, 192, "partial"),
        (240, 240, 192, "partial"),
        (256, 256, 192, "full"),
    ]
    b = h.boundaries(0)
    assert b == list(range(16, 257, 16))  # each boundary exactly once
    page2, page3 = pa.tables[0][2], plans[-1].tables[0][3]
    assert h.events() == []
    assert [x[1] for x in h.keys_of(page2)] == [144, 160, 176, 192]
    assert h.keys_of(page3) == [
        (0, 208, "partial"),
        (0, 224, "partial"),
        (0, 240, "partial"),
        (0, 256, "full"),
    ]
