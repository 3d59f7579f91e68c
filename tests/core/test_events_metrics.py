"""Events (spec §13) and metrics (spec §12.1): bounds, gaps, on/off equivalence, gauges."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvreuse import CacheConfig, GroupSpec, KVCacheManager, Request
from kvreuse.core.kinds import EntryKind, count_entry_kinds, entry_kind

GEO_P = CacheConfig(num_blocks=40, dcp_size=4, groups=[GroupSpec(kind="full", block_size=16)])
GEO_H = CacheConfig(
    num_blocks=40,
    dcp_size=4,
    groups=[GroupSpec(kind="full", block_size=16), GroupSpec(kind="recurrent", block_size=16)],
)


def run(mgr: KVCacheManager, rid: str, tokens: list[int], decode: int = 0) -> None:
    mgr.add_request(Request(rid, tokens))
    res = mgr.lookup(rid)
    mgr.allocate(rid, len(tokens) - res.hit, lookup=res)
    step = mgr.seal_step()
    mgr.commit(step.step_id, {rid: (len(tokens), [5])})
    for i in range(decode):
        mgr.allocate(rid, 1)
        step = mgr.seal_step()
        mgr.commit(step.step_id, {rid: (len(tokens) + 1 + i, [6])})
    mgr.finish(rid)
    mgr.check_invariants()


def history(mgr: KVCacheManager) -> None:
    base = list(range(100, 300))
    run(mgr, "a", base, decode=20)
    run(mgr, "b", base[:150] + list(range(500, 570)))
    run(mgr, "c", base)
    for i in range(6):  # pressure: evicts
        run(mgr, f"p{i}", list(range(1000 * (i + 2), 1000 * (i + 2) + 150)))
    run(mgr, "d", base)


@pytest.mark.parametrize("cfg", [GEO_P, GEO_H])
def test_events_off_changes_nothing_else(cfg: CacheConfig) -> None:
    on, off = KVCacheManager(cfg), KVCacheManager(replace(cfg, enable_events=False))
    history(on)
    history(off)
    assert off.take_events() == [] and off.events.seq == 0
    assert on.events.seq > 0
    assert on.export_entries() == off.export_entries()
    assert on.export_ghost() == off.export_ghost()
    assert on.metrics() == off.metrics()
    for rid in "abcd":
        assert on.request_stats(rid) == off.request_stats(rid)


def test_bounded_pending_events_drop_the_oldest_and_leave_a_gap() -> None:
    full, small = KVCacheManager(GEO_H), KVCacheManager(replace(GEO_H, max_pending_events=3))
    history(full)
    history(small)
    everything = full.take_events()
    kept = small.take_events()
    assert [e.seq for e in kept] == [e.seq for e in everything[-3:]]
    assert kept == everything[-3:]
    assert small.metrics()["kv_events_dropped_total"] == len(everything) - 3
    assert full.metrics()["kv_events_dropped_total"] == 0
    seqs = [e.seq for e in everything]
    assert seqs == list(range(1, len(seqs) + 1))


def test_zero_pending_events_keeps_none() -> None:
    mgr = KVCacheManager(replace(GEO_P, max_pending_events=0))
    history(mgr)
    assert mgr.take_events() == []
    assert mgr.metrics()["kv_events_dropped_total"] == mgr.events.seq > 0


def test_events_never_carry_the_salt() -> None:
    mgr = KVCacheManager(GEO_P)
    run(mgr, "a", list(range(100)))
    mgr.add_request(Request("s", list(range(100)), cache_salt="tenant-secret"))
    res = mgr.lookup("s")
    mgr.allocate("s", 100 - res.hit, lookup=res)
    mgr.commit(mgr.seal_step().step_id, {"s": (100, [1])})
    mgr.finish("s")
    text = repr(mgr.take_events())
    assert "tenant-secret" not in text
    assert res.hit == 0  # the salted request shares nothing with the unsalted one


def test_gauges_partition_the_pool_and_counters_are_monotonic() -> None:
    mgr = KVCacheManager(GEO_H)
    mgr.add_request(Request("a", list(range(200))))
    res = mgr.lookup("a")
    mgr.allocate("a", 200, lookup=res)
    m = mgr.metrics()
    in_use = sum(m["kv_blocks_in_use"].values())
    cached = sum(m["kv_blocks_cached"].values())
    assert in_use + cached + m["kv_blocks_free"] == 39
    assert m["kv_usage"] == pytest.approx(in_use / 39)
    assert m["prefix_cache_requests"] == 1 and m["prefix_cache_queries"] == 200
    mgr.commit(mgr.seal_step().step_id, {"a": (200, [1])})
    m2 = mgr.metrics()
    assert m2["kv_index_entries"]["full"] == 3  # 64, 128, 192
    assert m2["kv_index_entries"]["partial"] == 9
    assert m2["kv_index_entries"]["state"] == 1  # the replay point 192 (ρ(200))
    mgr.finish("a")
    m3 = mgr.metrics()
    assert sum(m3["kv_blocks_in_use"].values()) == 0 and m3["kv_usage"] == 0
    assert m3["kv_entries_published_total"]["full"] >= m2["kv_entries_published_total"]["full"]
    assert m3["kv_checkpoint_saves_total"]["published"] >= 1


# ---------------------------------------------------------------------- one home per rule
@pytest.mark.parametrize(
    ("page", "boundary", "kind"),
    [(16, 16, "full"), (64, 48, "partial"), (64, 128, "full"), (0, 48, "state"), (0, 64, "state")],
)
def test_entry_kind_is_one_rule_and_compares_as_a_string(
    page: int, boundary: int, kind: str
) -> None:
    got = entry_kind(page, boundary)
    assert got == kind and got is EntryKind(kind) and f"{got}" == kind and {kind: 1}[got] == 1
    counts = {k.value: 0 for k in EntryKind}
    count_entry_kinds(counts, page, [boundary, boundary])
    assert counts[kind] == 2 and sum(counts.values()) == 2


def test_pool_metrics_and_events_agree_on_kinds() -> None:
    mgr = KVCacheManager(GEO_H)
    history(mgr)
    events = mgr.take_events()
    stored = [
        (e.group_id, s.boundary, s.kind)
        for e in events
        if e.type == "BlockStored"
        for s in e.entries
    ]
    for gid, boundary, kind in stored:
        assert kind == mgr.pool.kind_of(gid, boundary)
    published = {k: 0 for k in ("full", "partial", "state")}
    for _, _, kind in stored:
        published[kind] += 1
    assert mgr.metrics()["kv_entries_published_total"] == published
    for e in events:
        if e.type == "BlockRemoved":
            assert e.kind == mgr.pool.kind_of(e.group_id, e.boundary)


@pytest.mark.parametrize("enabled", [True, False])
def test_reset_records_one_all_blocks_cleared_from_the_pool(enabled: bool) -> None:
    mgr = KVCacheManager(replace(GEO_H, enable_events=enabled))
    history(mgr)
    mgr.take_events()
    assert mgr.reset()
    events = mgr.take_events()
    assert [e.type for e in events] == (["AllBlocksCleared"] if enabled else [])
    assert mgr.export_entries() == [] and mgr.export_ghost() == []
