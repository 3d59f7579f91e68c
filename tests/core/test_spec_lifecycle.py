"""Spec cases on a request's life: pending hits, aborts, discards, reset, preemption, statistics.

* §16 case 20 (§7.8): identical requests in one step; `pending_hit` sees the other's plan, and
  ignores plans whose release is deferred (§10.6).
* §16 case 21 (§10.6, §11.2): an abort before the only commit publishes nothing; after a first
  chunk it publishes the held state.
* §16 case 22 (§10.6): a discarded step releases copies and saves, finishes the deferred finish,
  preempts the rest, withdraws later overlapped plans.
* §16 case 28 (§11.6): reset refused while a block is in use, then clears everything.
* §16 case 29 (§11.5, §12.1): preemption publishes the held state; re-admission moves only the
  `preempted_*` counters.
* §12.2: the statistics identities over a window of operations (T6).
* Staleness (§3): a lookup goes stale when the manager's state changes, and only then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvreuse.core import AllBlocksCleared, StaleLookupError, UnknownRequestError
from spec_harness import A200, Harness, geo_h, geo_p, save_block, stored_events, stored_runs, toks


# ====================================================================================== §16 case 20
def test_case20_identical_requests_in_one_step_pending_hit() -> None:
    h = Harness(geo_p())
    h.add("A", A200)
    h.add("B", A200)
    ra = h.lookup("A")
    assert (ra.hit, ra.pending_hit) == (0, 0)
    h.admit("A", res=ra)
    rb = h.lookup("B")  # after A's allocation
    assert rb.hit == 0  # nothing is published before commit
    assert rb.pending_hit == 192  # A's pending entries 16 … 192 (7.8)
    assert rb.reason == "no_entry"
    h.admit("B", res=rb)
    step = h.seal()
    h.events()
    h.commit(step, {"A": (200, h.sample()), "B": (200, h.sample())})
    ev = h.events()
    # A publishes one run 16 … 192; B's keys all exist already: nothing, no event
    assert stored_runs(ev) == [(0, list(range(16, 193, 16)))]
    assert len(ev) == 1
    # every key sits on A's blocks (pages 0–2)
    assert {blk for *_, blk in h.entries(0)} == set(step.requests[0].tables[0][:3])
    h.add("C", A200)
    rc = h.lookup("C")
    assert (rc.hit, rc.pending_hit, rc.reason) == (192, 192, "cap_reached")


# ====================================================================================== §16 case 21
@pytest.mark.parametrize("when", ["open", "sealed"])
def test_case21_abort_before_commit_publishes_nothing(when: str) -> None:
    h = Harness(geo_h())
    h.add("A", A200)
    plan = h.admit("A")
    assert plan.tables[0] == [1, 2, 3, 4]
    assert plan.recurrent[1].live == 5
    assert [(s.position, s.block) for s in plan.saves] == [(192, 6)]
    h.add("P", A200)
    assert h.lookup("P").pending_hit == 192  # A's pending entries and replay state at 192
    if when == "sealed":
        step = h.seal()
        h.finish("A")  # deferred to the step
        h.commit(step, {})  # A's outcome may be omitted
    else:
        h.finish("A")  # withdrawn from the open step
    assert h.lookup("P").pending_hit == 0
    assert h.counter("prefix_cache_requests") == 1  # a withdrawn admission stays counted
    assert h.entries() == []
    assert stored_events(h.events()) == []
    # one batch, all unkeyed: group 0 by descending table position, then save target, live
    assert h.order() == [4, 3, 2, 1, 6, 5, *range(7, 64)]
    h.add("A2", A200)
    res = h.lookup("A2")
    assert (res.hit, res.reason) == (0, "no_entry")


@pytest.mark.parametrize("when", ["open", "sealed"])
def test_case21_abort_after_first_chunk_publishes_held_state(when: str) -> None:
    h = Harness(geo_h())
    h.add("A", A200)
    p1 = h.admit("A", 128)
    assert p1.tables[0] == [1, 2] and p1.recurrent[1].live == 3
    assert [(s.position, s.block) for s in p1.saves] == [(128, 4)]  # rolling save at 128
    h.commit(h.seal(), {"A": (128, [])})
    p2 = h.grow("A", 72)
    assert p2.tables[0] == [1, 2, 5, 6]
    assert [(s.position, s.block) for s in p2.saves] == [(192, 7)]
    h.events()
    if when == "sealed":
        step = h.seal()
        h.finish("A")
        h.commit(step, {})
    else:
        h.finish("A")
    # the held state at φ(128) = 128 is published at the release; nothing of step 2
    assert stored_runs(h.events()) == [(1, [128])]
    assert h.boundaries(0) == list(range(16, 129, 16))
    assert [(g, b, k) for g, b, _, k, _ in h.entries(1)] == [(1, 128, "state")]
    assert h.keys_of(4) == [(1, 128, "state")]
    # unkeyed run: pages 3, 2 (group 0, descending), save target 7, live 3; keyed to the tail
    # by decreasing highest boundary, ties by group: 2 (128, g0), 4 (128, g1), 1 (64)
    assert h.order() == [6, 5, 7, 3, *range(8, 64), 2, 4, 1]
    h.add("A2", A200)
    res = h.lookup("A2")
    assert res.hit == 128


@pytest.mark.parametrize("op", ["finish", "preempt"])
def test_pending_hit_ignores_plans_with_deferred_release(op: str) -> None:
    h = Harness(geo_p())
    h.add("A", A200)
    h.admit("A")
    h.add("P", A200)
    assert h.lookup("P").pending_hit == 192
    step = h.seal()
    assert h.lookup("P").pending_hit == 192  # sealed, not deferred: still pending
    getattr(h, op)("A")  # deferred to the step (10.6): its commit will publish nothing
    res = h.lookup("P")
    assert (res.hit, res.pending_hit) == (0, 0)
    h.commit(step, {})
    assert h.entries() == []


# ====================================================================================== §16 case 22
def test_case22_discarded_step_releases_and_preempts() -> None:
    h = Harness(geo_h())
    a185 = toks(185)
    _, pa = h.finished("A", a185)  # states at 176 (replay) and 128 (S floor)
    s176 = save_block(pa, 1, 176)
    h.add("B", a185)
    h.add("E", toks(40, 7000))
    rb = h.lookup("B")
    assert rb.hit == 176
    assert rb.copy_src[0] == pa.tables[0][2] and rb.state_src[1] == s176
    entries_before = h.entries()
    h.events()
    m0 = h.mgr.metrics()
    pb = h.admit("B", res=rb)
    pe = h.admit("E")
    assert len(pb.copies) == 2
    step = h.seal()
    h.finish("E")  # deferred to step s
    epoch = h.mgr.epoch
    h.discard(step)
    assert h.mgr.epoch > epoch
    assert h.entries() == entries_before  # nothing published
    assert stored_events(h.events()) == []
    assert h.mgr.num_free_blocks == h.cfg.num_blocks - 1  # copy sources, saves, slots released
    assert h.ref(rb.copy_src[0]) == 0 and h.ref(s176) == 0
    # discard: one batch per request in plan order. B's keyed blocks go to the tail by
    # decreasing highest boundary (176: page 2 then the state; 128; 64); E's are unkeyed.
    assert h.order()[-4:] == [pa.tables[0][2], s176, pa.tables[0][1], pa.tables[0][0]]
    e_save = save_block(pe, 1, 32)
    dst_b = pb.tables[0][2]
    head = [pe.tables[0][0], e_save, pe.recurrent[1].live, dst_b, pb.recurrent[1].live]
    assert h.order()[:5] == head
    # E was finished, B preempted
    stats_e = h.mgr.request_stats("E")
    assert stats_e.admissions == 1
    with pytest.raises(UnknownRequestError):
        h.mgr.lookup("E")
    rb2 = h.lookup("B")  # B is waiting again: a new lookup
    assert rb2.hit == 176
    h.admit("B", res=rb2)
    m1 = h.mgr.metrics()
    assert m1["prefix_cache_preempted_requests"] - m0["prefix_cache_preempted_requests"] == 1
    assert m1["prefix_cache_preempted_queries"] - m0["prefix_cache_preempted_queries"] == 185
    assert m1["prefix_cache_preempted_hits"] - m0["prefix_cache_preempted_hits"] == 176
    assert m1["prefix_cache_requests"] - m0["prefix_cache_requests"] == 2  # B and E, once
    stats_b = h.mgr.request_stats("B")
    assert (stats_b.cached_tokens, stats_b.admissions, stats_b.last_hit) == (176, 2, 176)


def test_case22_discard_deferred_preempt_turned_finish() -> None:
    h = Harness(geo_p())
    h.add("F", A200)
    h.add("K", toks(100, 6000))
    h.admit("F")
    h.admit("K")
    step = h.seal()
    h.preempt("F")  # deferred
    h.preempt("F")  # repeated: changes nothing
    h.finish("F")  # turns the deferred preempt into a finish (10.6)
    with pytest.raises(ValueError):
        h.mgr.allocate("F", 1)  # a request with a deferred release cannot grow
    h.discard(step)
    with pytest.raises(UnknownRequestError):
        h.mgr.lookup("F")  # finished
    assert h.mgr.request_stats("F").admissions == 1
    res = h.lookup("K")  # preempted: waiting, re-admitted by a new lookup
    assert res.hit == 0
    h.admit("K", res=res)
    assert h.entries() == []


def test_case22_discard_withdraws_later_overlapped_plans() -> None:
    h = Harness(geo_p())
    h.add("R", A200)
    h.admit("R")
    s1 = h.seal()
    p2 = h.grow("R", 1)  # overlapped: start 200 = N̂ − 1 while s1 is in flight
    assert (p2.start, p2.end) == (200, 201)
    s2 = h.seal()
    h.discard(s1)  # R is preempted; its plan in s2 is withdrawn
    assert h.mgr.num_free_blocks == h.cfg.num_blocks - 1
    h.commit(s2, {})  # R's withdrawn plan needs no outcome
    assert h.entries() == []
    res = h.lookup("R")  # waiting again
    assert (res.hit, res.reason) == (0, "no_entry")
    h.admit("R", res=res)
    assert h.mgr.request_stats("R").admissions == 2


# ====================================================================================== §16 case 28
def test_case28_reset_while_in_use_then_after_release() -> None:
    h = Harness(geo_p())
    _, pa = h.finished("A", A200)
    h.evict(pa.tables[0][2])  # something in the ghost record
    assert h.mgr.export_ghost() != []
    h.add("R", toks(100, 80_000))
    h.admit("R")
    step = h.seal()
    for phase in ("sealed", "running"):
        h.events()
        before = h.snapshot()
        assert h.reset() is False, phase
        assert h.snapshot() == before
        assert h.events() == []
        if phase == "sealed":
            h.commit(step, {"R": (100, h.sample())})
    h.finish("R")
    h.events()
    before = h.snapshot()
    assert h.reset() is True
    ev = h.events()
    assert len(ev) == 1 and isinstance(ev[0], AllBlocksCleared)
    assert h.mgr.export_entries() == [] and h.mgr.export_ghost() == []
    after = h.snapshot()
    assert after["order"] == before["order"]  # the free-queue order is unchanged
    assert after["epoch"] == before["epoch"] + 1
    for name in ("prefix_cache_requests", "prefix_cache_queries", "kv_blocks_evicted_total"):
        assert after["metrics"][name] == before["metrics"][name]
    assert after["metrics"]["kv_ghost_keys"] == 0
    h.add("A2", A200)
    res = h.lookup("A2")
    assert (res.hit, res.reason) == (0, "no_entry")


# ====================================================================================== §16 case 29
def test_case29_preemption_and_metrics() -> None:
    h = Harness(geo_h())
    m0 = h.mgr.metrics()
    h.add("R", A200)
    res = h.lookup("R")
    assert (res.hit, res.reason) == (0, "no_entry")
    h.admit("R", res=res)
    m1 = h.mgr.metrics()
    assert m1["prefix_cache_requests"] - m0["prefix_cache_requests"] == 1
    assert m1["prefix_cache_queries"] - m0["prefix_cache_queries"] == 200
    assert m1["prefix_cache_hits"] - m0["prefix_cache_hits"] == 0
    assert h.mgr.request_stats("R").cached_tokens == 0
    h.commit(h.seal(), {"R": (200, h.sample())})
    h.decode("R", 29)  # T = 229, N = 230
    assert h.n("R") == 230
    h.events()
    h.preempt("R")
    assert stored_runs(h.events()) == [(1, [224])]  # the held state at φ(229) = 224
    assert max(h.boundaries(0)) == 224
    assert (1, 224) in [(g, b) for g, b, *_ in h.entries(1)]
    m2 = h.mgr.metrics()
    res2 = h.lookup("R")
    assert (res2.top, res2.hit, res2.reason) == (224, 224, "cap_reached")
    h.admit("R", res=res2)
    m3 = h.mgr.metrics()
    deltas = {k: m3[k] - m2[k] for k in m3 if k.startswith("prefix_cache_") and "reason" not in k}
    assert deltas == {
        "prefix_cache_requests": 0,
        "prefix_cache_queries": 0,
        "prefix_cache_hits": 0,
        "prefix_cache_preempted_requests": 1,
        "prefix_cache_preempted_queries": 230,
        "prefix_cache_preempted_hits": 224,
    }
    assert m3["prefix_cache_reason_total"] == m2["prefix_cache_reason_total"]
    stats = h.mgr.request_stats("R")
    assert (stats.cached_tokens, stats.reason) == (0, "no_entry")
    assert (stats.admissions, stats.last_hit, stats.last_reason) == (2, 224, "cap_reached")


# ================================================================================= §12.2 identities
def test_statistics_identities_over_a_window() -> None:
    h = Harness(geo_h())
    h.finished("P0", A200)  # before the window
    m0 = h.mgr.metrics()
    firsts: dict[str, int] = {}
    h.finished("A", A200[:180])
    firsts["A"] = 180
    h.finished("B", A200)
    firsts["B"] = 200
    h.finished("C", A200, skip_read=True)
    firsts["C"] = 200
    h.add("D", toks(50, 3000))
    d_stats = h.finish("D")  # finished before any admission
    assert (d_stats.cached_tokens, d_stats.reason, d_stats.admissions) == (0, "not_admitted", 0)
    h.prefill("R", toks(100, 4000))
    firsts["R"] = 100
    h.preempt("R")
    h.admit("R")  # a re-admission: preempted counters only
    stats = {rid: h.mgr.request_stats(rid) for rid in firsts}
    assert stats["C"].cached_tokens == 0
    assert stats["B"].cached_tokens == 192
    m1 = h.mgr.metrics()
    assert m1["prefix_cache_hits"] - m0["prefix_cache_hits"] == sum(
        s.cached_tokens for s in stats.values()
    )
    assert m1["prefix_cache_queries"] - m0["prefix_cache_queries"] == sum(firsts.values())
    assert m1["prefix_cache_requests"] - m0["prefix_cache_requests"] == len(firsts)
    r0, r1 = m0["prefix_cache_reason_total"], m1["prefix_cache_reason_total"]
    assert sum(r1.values()) - sum(r0.values()) == len(firsts)
    for s in stats.values():
        assert s.reason != "not_admitted"
    assert "not_admitted" not in r1
    assert m1["prefix_cache_preempted_requests"] - m0["prefix_cache_preempted_requests"] == 1
    assert m1["prefix_cache_preempted_queries"] - m0["prefix_cache_preempted_queries"] == 101
    assert m1["prefix_cache_preempted_hits"] - m0["prefix_cache_preempted_hits"] == (
        stats["R"].last_hit
    )


# ================================================================================= StaleLookupError
def _stale_setup() -> Harness:
    h = Harness(geo_h())
    h.finished("A", A200)
    h.add("W", A200)  # the waiting request whose lookup goes stale
    h.add("X", toks(100, 8000))  # a request to act on
    return h


def _running_x(h: Harness) -> None:
    h.admit("X")
    h.commit(h.seal(), {"X": (100, h.sample())})


def _op_allocate(h: Harness) -> Callable[[], Any]:
    return lambda: h.admit("X")


def _op_commit(h: Harness) -> Callable[[], Any]:
    h.admit("X")
    step = h.seal()
    return lambda: h.commit(step, {"X": (100, h.sample())})


def _op_discard(h: Harness) -> Callable[[], Any]:
    h.admit("X")
    step = h.seal()
    return lambda: h.discard(step)


def _op_finish_running(h: Harness) -> Callable[[], Any]:
    _running_x(h)
    return lambda: h.finish("X")


def _op_finish_waiting(h: Harness) -> Callable[[], Any]:
    return lambda: h.finish("X")


def _op_preempt(h: Harness) -> Callable[[], Any]:
    _running_x(h)
    return lambda: h.preempt("X")


def _op_evict(h: Harness) -> Callable[[], Any]:
    blk = next(blk for g, b, _, _, blk in h.entries(0) if b == 64)
    return lambda: h.evict(blk)


def _op_reset(h: Harness) -> Callable[[], Any]:
    return lambda: h.reset()


def _op_grow(h: Harness) -> Callable[[], Any]:
    _running_x(h)
    return lambda: h.grow("X", 1)


@pytest.mark.parametrize(
    "prepare",
    [
        _op_allocate,
        _op_grow,
        _op_commit,
        _op_discard,
        _op_finish_running,
        _op_finish_waiting,
        _op_preempt,
        _op_evict,
        _op_reset,
    ],
    ids=lambda f: f.__name__[4:],
)
def test_stale_lookup_after_state_change(prepare: Callable[[Harness], Callable[[], Any]]) -> None:
    h = _stale_setup()
    act = prepare(h)
    res = h.lookup("W")
    epoch = h.mgr.epoch
    assert res.epoch == epoch
    out = act()
    assert out is not False  # reset must have succeeded
    assert h.mgr.epoch > epoch
    before = h.snapshot()
    with pytest.raises(StaleLookupError):
        h.mgr.allocate("W", 8, lookup=res)
    with pytest.raises(StaleLookupError):
        h.mgr.blocks_needed("W", 8, lookup=res)
    with pytest.raises(StaleLookupError):
        h.mgr.save_positions("W", lookup=res)
    h.check()
    assert h.snapshot() == before
    fresh = h.lookup("W")
    h.admit("W", res=fresh)


@pytest.mark.parametrize("op", ["finish", "preempt"])
def test_stale_lookup_after_deferred_release(op: str) -> None:
    h = _stale_setup()
    h.admit("X")
    step = h.seal()
    res = h.lookup("W")
    getattr(h, op)("X")  # deferred to `step`
    with pytest.raises(StaleLookupError):
        h.mgr.allocate("W", 8, lookup=res)
    h.commit(step, {})


def test_lookup_stays_current_without_state_change() -> None:
    h = _stale_setup()
    _running_x(h)  # X running, holding blocks
    res = h.lookup("W")
    assert h.reset() is False  # changes nothing
    empty = h.seal()
    h.commit(empty, {})  # an empty step: nothing
    h.discard(empty)
    h.add("V", toks(20, 9000))
    h.lookup("V")
    assert h.mgr.epoch == res.epoch
    plan = h.admit("W", res=res)
    assert plan.hit == 192
