"""Spec §16 edge cases 19–36, plus §11.2 release order, §12.2 identities, staleness and T8.

Every expected value below is derived from the rules of docs/cache-semantics.md (sections 2–14),
with the example geometries of §4. "A finished" means: A's prompt prefilled in one step, one
output token sampled (T = P), then `finish`. `check_invariants()` runs after every operation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from kvreuse.core import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheConfig,
    ConfigError,
    GroupSpec,
    KVCacheManager,
    LookupResult,
    Request,
    RequestPlan,
    StaleLookupError,
    StepPlan,
    UnknownRequestError,
)

G = GroupSpec
NULL = 0


# ----------------------------------------------------------------------------- geometries (§4)
def geo_p(**kw: Any) -> CacheConfig:
    """Geo-P: full attention, local 16 × dcp 4 → B = 64; u = 16."""
    kw.setdefault("num_blocks", 64)
    return CacheConfig(groups=[G("full", 16)], dcp_size=4, **kw)


def geo_h(**kw: Any) -> CacheConfig:
    """Geo-H: full 16 × dcp 4 → 64; recurrent M = 16; u = 16."""
    kw.setdefault("num_blocks", 64)
    return CacheConfig(groups=[G("full", 16), G("recurrent", 16)], dcp_size=4, **kw)


def geo_3(extra: Sequence[GroupSpec] = (), **kw: Any) -> CacheConfig:
    """Geo-3: full 16 × dcp 4 → 64; sliding B = 32, W = 48; recurrent M = 32; u = 16."""
    kw.setdefault("num_blocks", 64)
    groups = [G("full", 16), G("sliding", 32, window=48), G("recurrent", 32), *extra]
    return CacheConfig(groups=groups, dcp_size=4, **kw)


def geo_c(**kw: Any) -> CacheConfig:
    """Geo-C: full 16 × dcp 4 → 64; chunked B = 32, C = 64; u = 16."""
    kw.setdefault("num_blocks", 64)
    return CacheConfig(groups=[G("full", 16), G("chunked", 32, chunk=64)], dcp_size=4, **kw)


DRAFT64 = G("full", 64, dcp_sharded=False, role="draft")  # the draft group of Geo-D


# ----------------------------------------------------------------------------- harness
def toks(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


class Harness:
    """Thin wrapper: every operation is followed by `check_invariants()` (T10)."""

    def __init__(self, cfg: CacheConfig) -> None:
        self.cfg = cfg
        self.mgr = KVCacheManager(cfg)
        self.tokens: dict[str, list[int]] = {}
        self._next = 900_000
        self._seq = 0
        self._replay: set[tuple[int, bytes, int, str]] = set()
        self._buffer: list[Any] = []
        self.check()

    # -- plumbing
    def check(self) -> None:
        """T10 invariants, T9 event replay (seq + 1 each), and the 12.1 gauge identity."""
        mgr = self.mgr
        mgr.check_invariants()
        for e in mgr.take_events():
            assert e.seq == self._seq + 1, (e.seq, self._seq)
            self._seq = e.seq
            if isinstance(e, BlockStored):
                self._replay |= {(e.group_id, x.hash, x.boundary, x.kind) for x in e.entries}
            elif isinstance(e, BlockRemoved):
                self._replay.remove((e.group_id, e.hash, e.boundary, e.kind))
            else:
                assert isinstance(e, AllBlocksCleared)
                self._replay.clear()
            self._buffer.append(e)
        assert self._replay == {(g, hh, b, k) for g, b, hh, k, _ in mgr.export_entries()}
        m = mgr.metrics()
        total = sum(m["kv_blocks_in_use"].values()) + sum(m["kv_blocks_cached"].values())
        assert total + m["kv_blocks_free"] == self.cfg.num_blocks - 1
        assert sum(mgr.pool.ref_count(b) > 0 for b in range(1, self.cfg.num_blocks)) == (
            self.cfg.num_blocks - 1 - mgr.num_free_blocks
        )

    def sample(self, k: int = 1) -> list[int]:
        out = list(range(self._next, self._next + k))
        self._next += k
        return out

    def n(self, rid: str) -> int:
        return len(self.tokens[rid])

    # -- operations
    def add(self, rid: str, tokens: Sequence[int], **kw: Any) -> None:
        self.mgr.add_request(Request(rid, list(tokens), **kw))
        self.tokens[rid] = list(tokens)
        self.check()

    def lookup(self, rid: str) -> LookupResult:
        res = self.mgr.lookup(rid)
        self.check()
        return res

    def admit(
        self, rid: str, num: int | None = None, res: LookupResult | None = None, **kw: Any
    ) -> RequestPlan:
        if res is None:
            res = self.lookup(rid)
        if num is None:
            num = self.n(rid) - res.hit
        plan = self.mgr.allocate(rid, num, lookup=res, **kw)
        self.check()
        assert plan is not None, f"admission of {rid} unexpectedly failed"
        return plan

    def grow(self, rid: str, num: int, **kw: Any) -> RequestPlan:
        plan = self.mgr.allocate(rid, num, **kw)
        self.check()
        assert plan is not None, f"growth of {rid} unexpectedly failed"
        return plan

    def seal(self) -> StepPlan:
        step = self.mgr.seal_step()
        self.check()
        return step

    def commit(self, step: StepPlan, outcomes: dict[str, tuple[Any, ...]]) -> None:
        self.mgr.commit(step.step_id, outcomes)
        for rid, out in outcomes.items():
            self.tokens[rid].extend(out[1])
        self.check()

    def discard(self, step: StepPlan) -> None:
        self.mgr.discard(step.step_id)
        self.check()

    def finish(self, rid: str) -> Any:
        stats = self.mgr.finish(rid)
        self.check()
        return stats

    def preempt(self, rid: str) -> None:
        self.mgr.preempt(rid)
        self.check()

    def evict(self, block_id: int) -> None:
        self.mgr.evict(block_id)
        self.check()

    def reset(self) -> bool:
        ok = self.mgr.reset()
        self.check()
        return ok

    # -- composite operations
    def prefill(
        self, rid: str, tokens: Sequence[int], **kw: Any
    ) -> tuple[LookupResult, RequestPlan]:
        """Add, look up, admit the whole remaining prompt, commit T = P with one sampled token."""
        self.add(rid, tokens, **kw)
        res = self.lookup(rid)
        plan = self.admit(rid, res=res)
        step = self.seal()
        self.commit(step, {rid: (len(tokens), self.sample())})
        return res, plan

    def finished(
        self, rid: str, tokens: Sequence[int], **kw: Any
    ) -> tuple[LookupResult, RequestPlan]:
        res, plan = self.prefill(rid, tokens, **kw)
        self.finish(rid)
        return res, plan

    def decode(self, rid: str, steps: int = 1) -> list[RequestPlan]:
        """One-token decode steps: compute position N − 1, sample one token (T′ = N)."""
        plans = []
        for _ in range(steps):
            num = self.n(rid)
            plans.append(self.grow(rid, 1))
            step = self.seal()
            self.commit(step, {rid: (num, self.sample())})
        return plans

    # -- observation
    def entries(self, group: int | None = None) -> list[tuple[int, int, bytes, str, int]]:
        return [e for e in self.mgr.export_entries() if group is None or e[0] == group]

    def boundaries(self, group: int) -> list[int]:
        return sorted(e[1] for e in self.entries(group))

    def keys_of(self, block: int) -> list[tuple[int, int, str]]:
        """(group, boundary, kind) of every key on `block`, ascending boundary."""
        return sorted((g, b, k) for g, b, _, k, blk in self.mgr.export_entries() if blk == block)

    def order(self) -> list[int]:
        return self.mgr.pool.policy.order()  # type: ignore[attr-defined]

    def ref(self, block: int) -> int:
        return self.mgr.pool.ref_count(block)

    def counter(self, name: str) -> Any:
        return self.mgr.metrics()[name]

    def events(self) -> list[Any]:
        """Events emitted since the last call (drained by `check`, in seq order)."""
        self.check()
        out, self._buffer = self._buffer, []
        return out

    def snapshot(self) -> dict[str, Any]:
        """Everything T8 says a failed allocate must not change (events: drain before/after)."""
        mgr = self.mgr
        return {
            "refs": [mgr.pool.ref_count(b) for b in range(1, self.cfg.num_blocks)],
            "order": self.order(),
            "entries": mgr.export_entries(),
            "ghost": mgr.export_ghost(),
            "metrics": mgr.metrics(),
            "epoch": mgr.epoch,
            "free": mgr.num_free_blocks,
        }


def stored(events: Sequence[Any]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def stored_runs(events: Sequence[Any]) -> list[tuple[int, list[int]]]:
    return [(e.group_id, [x.boundary for x in e.entries]) for e in stored(events)]


def save_positions_of(plan: RequestPlan, group: int) -> list[int]:
    return sorted(s.position for s in plan.saves if s.group_id == group)


def save_block(plan: RequestPlan, group: int, position: int) -> int:
    (blk,) = [s.block for s in plan.saves if s.group_id == group and s.position == position]
    return blk


def reason_total(h: Harness) -> dict[str, int]:
    return dict(h.counter("prefix_cache_reason_total"))


A200 = toks(200)
B_SIBLING = A200[:150] + toks(70, 50_000)  # shares A's first 150 tokens, 220 in all


# ============================================================================ §16 case 19
def _case19_setup() -> tuple[Harness, RequestPlan, RequestPlan]:
    h = Harness(geo_h())
    _, prefill = h.prefill("R", toks(190))  # T = 190, N = 191
    # prefill [0, 190): saves at 176 (rolling + replay ρ(190)) and 128 (S floor of 176)
    assert save_positions_of(prefill, 1) == [128, 176]
    h.events()
    plan = h.grow("R", 4)  # decode: start 190 = N − 1, positions 190–193, three drafts
    assert (plan.start, plan.end) == (190, 194)
    assert save_positions_of(plan, 1) == [192]  # the rolling save at 192 (9.4, decode step)
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
    assert stored(ev)[0].token_start == 128
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


# ============================================================================ §16 case 20
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


# ============================================================================ §16 case 21
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
    assert stored(h.events()) == []
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


# ============================================================================ §16 case 22
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
    assert stored(h.events()) == []
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


# ============================================================================ §16 case 23
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


# ============================================================================ §16 case 24
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


# ============================================================================ §16 case 25
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


# ============================================================================ §16 case 26
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


# ============================================================================ §16 case 27
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


# ============================================================================ §16 case 28
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


# ============================================================================ §16 case 29
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


# ============================================================================ §16 case 30
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


# ============================================================================ §16 case 31
def test_case31_promotion_keeps_partial_entries() -> None:
    h = Harness(geo_p())
    a180 = toks(180)
    _, pa = h.prefill("A", a180)
    first = h.events()
    assert stored_runs(first) == [(0, list(range(16, 177, 16)))]
    ev0 = stored(first)[0]
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


# ============================================================================ §16 case 32
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
    assert save_positions_of(pb, 2) == [128, 144, 192, 208]


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


# ============================================================================ §16 case 33
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


# ============================================================================ §16 case 34
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
    saves = save_positions_of(pb, 1)
    assert 64 in saves and 144 not in saves


# ============================================================================ §16 case 35
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


# ============================================================================ §16 case 36
@pytest.mark.parametrize(
    ("build", "needles"),
    [
        pytest.param(
            lambda: geo_p(hash_unit=24),
            [
                "hash_unit 24",
                "group 0",
                "64",
                "1, 2, 4, 8, 16, 32, 64",
            ],
            id="V4-hash-unit-24",
        ),
        pytest.param(
            lambda: CacheConfig(
                num_blocks=64,
                dcp_size=4,
                groups=[G("full", 16), G("sliding", 32, window=48, dcp_sharded=True)],
            ),
            ["group 1", "sliding", "replicated"],
            id="V2-sharded-sliding",
        ),
        pytest.param(lambda: geo_h(spec_mode="drop"), ["drop", "draft"], id="V5-drop-no-draft"),
        pytest.param(
            lambda: CacheConfig(num_blocks=64, groups=[G("sliding", 32, window=1)]),
            ["group 0", "sliding", "window"],
            id="V3-window-1",
        ),
        pytest.param(
            lambda: CacheConfig(
                num_blocks=64,
                dcp_size=4,
                groups=[G("full", 16), G("recurrent", 16, prefix_cacheable=False)],
            ),
            ["group 1", "recurrent", "enable_prefix_caching=False"],
            id="V6-recurrent-not-cacheable",
        ),
    ],
)
def test_case36_configuration_errors(build: Callable[[], CacheConfig], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_case36_v4_message_exact() -> None:
    with pytest.raises(ConfigError) as info:
        geo_p(hash_unit=24)
    assert str(info.value) == (
        "hash_unit 24 does not divide the page of group 0 (full, 16 × dcp 4 = 64 tokens). "
        "Every page must be a multiple of hash_unit; valid values divide 64: "
        "1, 2, 4, 8, 16, 32, 64."
    )


# ============================================================================ §11.2 release order
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
    saves = [save_block(p2, 1, c) for c in (144, 160, 176, 192)]
    expected_head = [table[3], table[2], *saves, scratch[1], scratch[0], live]
    assert h.order()[: len(expected_head)] == expected_head
    assert h.order()[-3:] == [table[1], held, table[0]]


def test_release_order_geo_p_pages_suffix_first() -> None:
    h = Harness(geo_p(num_blocks=12))
    h.finished("A", toks(300))  # pages 0–4 on blocks 1–5; E = 288, page 4 keyed up to 288
    assert h.order() == [*range(6, 12), 5, 4, 3, 2, 1]


# ============================================================================ §12.2 identities
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


# ============================================================================ StaleLookupError
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


# ============================================================================ T8 atomic failure
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
