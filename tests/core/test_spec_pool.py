"""Spec cases on the block pool: eviction, copy sources, admission counting, release order, T8.

* §16 cases 23–24 (§11.3): evicting a block removes every key on it (`BlockRemoved`, ghost
  record); a middle page's eviction cuts the hit to `evicted`, and a resend republishes it.
* §16 case 25 (§9.5): a copy source is adopted at allocation and returns to the tail at commit.
* §16 cases 26–27 (§9.5): admission counts adopted and fresh blocks and fails atomically; hit
  blocks are adopted before any pop.
* §11.2: release batches, unkeyed blocks to the head, keyed ones to the tail by decreasing
  highest boundary, recurrent slots in their order.
* T8 (§9.5): a failed `allocate` changes nothing; growth ignores the admission watermark.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvreuse.core import BlockRemoved, CacheConfig
from spec_harness import A200, G, Harness, geo_h, geo_p, save_block, stored_runs, toks


# ====================================================================================== §16 case 23
def test_case23_evicted_middle_page() -> None:
    h = Harness(geo_p())
    a256 = toks(256)
    _, pa = h.finished("A", a256)
    assert h.boundaries(0) == list(range(16, 257, 16))
    page1 = pa.tables[0][1]
    h.events()
    h.evict(page1)
    ev = h.events()
    assert [(type(e), e.boundary) for e in ev] == [(BlockRemoved, b) for b in (80, 96, 112, 128)]
    h.add("R1", a256)
    r1 = h.lookup("R1")
    assert (r1.hit, r1.reason) == (64, "evicted")
    assert r1.top == 240
    # the keys of pages 2 and 3 stay resident (unreachable)
    assert h.boundaries(0) == [16, 32, 48, 64, *range(144, 257, 16)]
    h.admit("R1", res=r1)
    h.commit(h.seal(), {"R1": (256, h.sample())})
    # republishes page 1's keys only; 144 is a duplicate and ends the run
    assert stored_runs(h.events()) == [(0, [80, 96, 112, 128])]
    assert h.mgr.export_ghost() == []  # republished keys leave the ghost record
    h.finish("R1")
    h.add("R2", a256)
    r2 = h.lookup("R2")
    assert (r2.hit, r2.reason) == (240, "cap_reached")
    assert r2.copy_src[0] == pa.tables[0][3]  # page 3 copied from A's block (entry at 256)


# ====================================================================================== §16 case 24
def test_case24_eviction_removes_every_key_of_the_block() -> None:
    h = Harness(geo_p())
    a180 = toks(180)
    _, pa = h.prefill("A", a180)
    h.decode("A", 13)  # T: 180 → 193, past 192
    page2 = pa.tables[0][2]
    assert h.keys_of(page2) == [
        (0, 144, "partial"),
        (0, 160, "partial"),
        (0, 176, "partial"),
        (0, 192, "full"),
    ]
    h.finish("A")
    h.events()
    removed0 = h.counter("kv_entries_removed_total").get("evicted", 0)
    h.evict(page2)
    ev = h.events()
    assert all(isinstance(e, BlockRemoved) and e.cause == "evicted" for e in ev)
    assert [(e.group_id, e.boundary, e.kind) for e in ev] == [
        (0, 144, "partial"),
        (0, 160, "partial"),
        (0, 176, "partial"),
        (0, 192, "full"),
    ]
    assert h.keys_of(page2) == []
    assert h.counter("kv_entries_removed_total")["evicted"] == removed0 + 4
    assert sorted(b for _, b, _ in h.mgr.export_ghost()) == [144, 160, 176, 192]
    h.add("R", a180)
    res = h.lookup("R")
    assert (res.hit, res.reason) == (128, "evicted")


# ====================================================================================== §16 case 25
def test_case25_copy_source_protected_until_commit() -> None:
    h = Harness(geo_h(num_blocks=32))
    a185 = toks(185)
    _, pa = h.finished("A", a185)
    h.add("B", a185)
    rb = h.lookup("B")
    src = rb.copy_src[0]
    assert rb.hit == 176 and src == pa.tables[0][2]
    assert h.ref(src) == 0 and src in h.order()
    src_keys = h.keys_of(src)
    assert src_keys == [(0, 144, "partial"), (0, 160, "partial"), (0, 176, "partial")]
    h.admit("B", res=rb)
    assert h.ref(src) == 1 and src not in h.order()
    # another admission of the same step empties the free queue (pages + live = free)
    free = h.mgr.num_free_blocks
    h.add("X", toks(64 * (free - 1), 20_000))
    h.admit("X")
    assert h.mgr.num_free_blocks == 0
    assert h.keys_of(src) == src_keys and h.ref(src) == 1
    step = h.seal()
    h.commit(step, {"B": (185, h.sample()), "X": (64 * (free - 1), h.sample())})
    assert h.ref(src) == 0
    # B's commit batch: copy sources, keyed, to the tail: page 2 (176, g0) then state (176, g1)
    assert h.order()[-2:] == [src, rb.state_src[1]]
    assert h.keys_of(src) == src_keys


# ====================================================================================== §16 case 26
def _case26_producer() -> Harness:
    h = Harness(geo_p(num_blocks=8))
    _, pa = h.finished("A", A200)
    assert pa.tables[0] == [1, 2, 3, 4]
    assert [blk for *_, blk in h.entries(0)] == [1] * 4 + [2] * 4 + [3] * 4
    assert h.keys_of(4) == []
    assert h.order() == [4, 5, 6, 7, 3, 2, 1]
    return h


def test_case26_admission_counting_resend_fits() -> None:
    h = _case26_producer()
    h.add("R", A200)
    res = h.lookup("R")
    assert res.hit == 192 and res.copy_src[0] is None
    assert h.mgr.blocks_needed("R", 8, lookup=res) == 4  # 3 adopted + 1 fresh
    plan = h.admit("R", 8, res=res)
    assert plan.tables[0] == [1, 2, 3, 4]
    assert plan.copies == []
    assert h.order() == [5, 6, 7]


def test_case26_admission_counting_fails_atomically() -> None:
    h = _case26_producer()
    h.add("X", toks(256, 30_000))
    px = h.admit("X")  # pops 4, 5, 6, 7
    assert px.tables[0] == [4, 5, 6, 7]
    assert h.order() == [3, 2, 1]
    h.add("R", A200)
    res = h.lookup("R")
    assert res.hit == 192
    assert h.mgr.blocks_needed("R", 8, lookup=res) == 4
    h.events()
    before = h.snapshot()
    assert h.mgr.allocate("R", 8, lookup=res) is None
    h.check()
    assert h.snapshot() == before
    assert h.events() == []
    # the lookup is still current (nothing changed): the same call fails the same way
    assert h.mgr.allocate("R", 8, lookup=res) is None
    assert h.snapshot() == before


# ====================================================================================== §16 case 27
def test_case27_adopt_before_pop() -> None:
    h = Harness(geo_p(num_blocks=10))
    h.add("A", A200)
    h.add("F", toks(256, 40_000))
    h.add("Y", toks(40, 60_000))
    pa, pf, py = h.admit("A"), h.admit("F"), h.admit("Y")
    assert (pa.tables[0], pf.tables[0], py.tables[0]) == ([1, 2, 3, 4], [5, 6, 7, 8], [9])
    h.commit(h.seal(), {r: (h.n(r), h.sample()) for r in ("A", "F", "Y")})
    h.finish("A")
    h.finish("Y")
    assert h.order() == [4, 3, 2, 1, 9]
    h.add("Z", toks(30, 70_000))
    assert h.admit("Z").tables[0] == [4]
    h.commit(h.seal(), {"Z": (30, h.sample())})
    assert h.order() == [3, 2, 1, 9]
    h.add("R", A200)
    res = h.lookup("R")
    assert res.hit == 192 and res.slots[0] == [1, 2, 3]
    h.events()
    plan = h.admit("R", res=res)
    assert plan.tables[0] == [1, 2, 3, 9]  # the fresh page is 9, not an evicted block 3
    assert plan.new_blocks[0] == [9]
    assert [(type(e), e.boundary) for e in h.events()] == [(BlockRemoved, 16), (BlockRemoved, 32)]
    assert [b for blk in (1, 2, 3) for _, b, _ in h.keys_of(blk)] == list(range(16, 193, 16))
    assert h.order() == []


# ============================================================================== §11.2 release order
def test_release_order_finished_request_tail_first() -> None:
    h = Harness(geo_h())
    _, pa = h.finished("A", A200)
    assert pa.tables[0] == [1, 2, 3, 4] and pa.recurrent[1].live == 5
    assert [(s.position, s.block) for s in pa.saves] == [(192, 6)]
    # unkeyed: page 3 (4), live (5) to the head; keyed to the tail by decreasing highest
    # boundary, ties by ascending group: 3 (192, g0), 6 (192, g1), 2 (128), 1 (64)
    assert h.order() == [4, 5, *range(7, 64), 3, 6, 2, 1]
    _, pb = h.prefill("B", toks(100, 5000))
    assert pb.tables[0] == [4, 5] and pb.recurrent[1].live == 7
    # saves: rolling 96 first, then replay floor 64 (pop order rolling, replay)
    assert [(s.position, s.block) for s in pb.saves] == [(96, 8), (64, 9)]
    # the commit released the published, non-rolling state at 64: keyed, to the tail
    assert h.order() == [*range(10, 64), 3, 6, 2, 1, 9]
    h.finish("B")
    assert h.order() == [7, *range(10, 64), 3, 6, 2, 1, 9, 5, 8, 4]
    before = h.order()
    h.evict(6)  # a block whose keys are removed in the queue keeps its place
    assert h.order() == before


@pytest.mark.parametrize("when", ["open", "sealed"])
def test_release_order_recurrent_slots_on_withdrawal(when: str) -> None:
    """11.2: unkeyed run = group 0 descending pages; then saves (ascending position), held
    (descending), scratch (descending), live; keyed blocks to the tail."""
    cfg = CacheConfig(
        num_blocks=64,
        dcp_size=4,
        recurrent_retention="dense",
        groups=[G("full", 16), G("recurrent", 16, state_scratch_blocks=2)],
    )
    h = Harness(cfg)
    h.add("R", A200)
    p1 = h.admit("R", 128)
    # dense saves 16 … 128 (128 also rolling); rolling pops first (9.4)
    assert [s.position for s in p1.saves] == [128, *range(16, 128, 16)]
    h.commit(h.seal(), {"R": (128, [])})
    held = save_block(p1, 1, 128)
    assert h.keys_of(held) == [(1, 128, "state")] and h.ref(held) == 1
    p2 = h.grow("R", 72)
    assert [s.position for s in p2.saves] == [192, 144, 160, 176]
    live, scratch = p2.recurrent[1].live, list(p2.recurrent[1].scratch)
    assert len(scratch) == 2
    if when == "sealed":
        step = h.seal()
        h.finish("R")
        h.commit(step, {})
    else:
        h.finish("R")
    table = p2.tables[0]
    save_blocks = [save_block(p2, 1, c) for c in (144, 160, 176, 192)]
    expected_head = [table[3], table[2], *save_blocks, scratch[1], scratch[0], live]
    assert h.order()[: len(expected_head)] == expected_head
    assert h.order()[-3:] == [table[1], held, table[0]]


def test_release_order_geo_p_pages_suffix_first() -> None:
    h = Harness(geo_p(num_blocks=12))
    h.finished("A", toks(300))  # pages 0–4 on blocks 1–5; E = 288, page 4 keyed up to 288
    assert h.order() == [*range(6, 12), 5, 4, 3, 2, 1]


# ================================================================================ T8 atomic failure
def _t8_growth(h: Harness) -> Callable[[], Any]:
    h.add("R", A200)
    h.admit("R")
    h.commit(h.seal(), {"R": (200, h.sample())})  # R holds 1–4; free 5, 6, 7
    assert h.order() == [5, 6, 7]
    # decode with drafts, extra slots up to 500 tokens: 4 new pages > 3 free
    assert h.mgr.blocks_needed("R", 100, num_extra_slots=200) == 4
    return lambda: h.mgr.allocate("R", 100, num_extra_slots=200)


def _t8_watermark(h: Harness) -> Callable[[], Any]:
    h.add("R", A200)
    res = h.lookup("R")
    assert h.mgr.blocks_needed("R", 200, lookup=res) == 4  # 4 ≤ 7 but > 7 − watermark 4
    return lambda: h.mgr.allocate("R", 200, lookup=res)


def _t8_would_evict(h: Harness) -> Callable[[], Any]:
    h.finished("A", A200)
    h.add("X", toks(256, 30_000))
    h.admit("X")  # holds 4–7; the queue is [3, 2, 1], all keyed
    assert h.order() == [3, 2, 1]
    h.add("Y", toks(256, 50_000))
    res = h.lookup("Y")
    assert h.mgr.blocks_needed("Y", 256, lookup=res) == 4
    return lambda: h.mgr.allocate("Y", 256, lookup=res)


def _t8_adopt_hit(h: Harness) -> Callable[[], Any]:
    h.finished("A", A200)
    h.add("X", toks(256, 30_000))
    h.admit("X")
    h.add("R", A200)
    res = h.lookup("R")
    assert res.hit == 192
    return lambda: h.mgr.allocate("R", 8, lookup=res)


@pytest.mark.parametrize(
    ("prepare", "watermark"),
    [(_t8_growth, 0), (_t8_watermark, 4), (_t8_would_evict, 0), (_t8_adopt_hit, 0)],
    ids=["growth", "watermark", "would-evict", "adopt-hit"],
)
def test_t8_failed_allocate_changes_nothing(
    prepare: Callable[[Harness], Callable[[], Any]], watermark: int
) -> None:
    h = Harness(geo_p(num_blocks=8, admission_watermark_blocks=watermark))
    act = prepare(h)
    h.events()
    before = h.snapshot()
    assert act() is None
    h.check()
    assert h.snapshot() == before
    assert h.events() == []


def test_t8_growth_ignores_the_watermark() -> None:
    h = Harness(geo_p(num_blocks=8, admission_watermark_blocks=5))
    h.add("R", toks(60))
    h.admit("R")  # 1 ≤ 7 − 5
    h.commit(h.seal(), {"R": (60, h.sample())})
    # growth succeeds iff required ≤ free (the watermark applies to admissions only)
    plan = h.grow("R", 1, num_extra_slots=383)  # ⌈(61 + 383)/64⌉ = 7 pages: 6 new ≤ 6 free
    assert len(plan.new_blocks[0]) == 6
