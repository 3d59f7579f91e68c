"""Memory tiers (kvreuse.core.tiers) against the oracle, and their bytes against a model.

Random histories (the property harness's engine: admissions, chunked prefill, drafts, saves,
aborts, discards, preemption, targeted eviction, reset) run on random geometries of every kind
with small pools and one or two small tiers below them, so blocks move down, are evicted from
the tiers too, and come back. After every operation, besides the harness's own checks:

- every lookup equals the oracle over everything held anywhere (the pool's entries and the
  tiers'), hit, reason, junction and bounds, and its slots name, for each page, a device block
  or tier slot that holds that page's key;
- a model of the bytes follows the plans: a block's contents are the set of entries it was
  written with (at publication), and each Demote / Move / Load / Copy carries them along in the
  order the step lists them; a fresh block starts empty. Every admission then reads, in every
  page and state of its hit, bytes written for its own prefix; and a loaded block is published
  only with keys whose bytes the load brought;
- the KV events, through vLLM's wire format (each tier's under its own `medium`), rebuild a
  router's mirror whose device and tier entries are the replica's, and whose lookup across
  tiers gives the replica's hit with the same blocks loaded from the same tiers.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness import Driver, Engine, Known
from kvreuse import CacheConfig, GroupSpec, KVCacheManager, LookupResult, StepPlan
from kvreuse.core import (
    Admission,
    ConfigError,
    Demote,
    Load,
    Move,
    SharedTier,
    TierSpec,
    compute_lookup,
)
from kvreuse.core.events import AllBlocksCleared, BlockRemoved, BlockStored, TierRemoved, TierStored
from kvreuse.core.tiers.view import source_of, tier_sources
from kvreuse.events import Converter, ReplicaMirror, StoreMirror
from kvreuse.events.mirror import HashChain
from kvreuse.events.wire import EventBatch, decode_batch, encode_batch, hash64
from kvreuse.oracle import expected_slots, ident, oracle
from test_properties import geometries


class TierDriver(Driver):
    """The harness's driver on a manager with tiers, checked against the oracle over the pool
    and the tiers together, with a model of where each entry's bytes are."""

    def __init__(
        self,
        cfg: CacheConfig,
        rng: random.Random,
        tiers: list[TierSpec | SharedTier],
        store: StoreMirror | None = None,
        slot_bytes: defaultdict[tuple[Any, int, int], set[Any]] | None = None,
    ) -> None:
        """`store`: the mirror of a shared tier among `tiers`, which other drivers share, as
        they share `slot_bytes` (a shared tier's slots are everyone's)."""
        super().__init__(cfg, rng)
        self.mgr = KVCacheManager(cfg, tiers=tiers)
        self.bytes: defaultdict[int, set[Any]] = defaultdict(set)  # device block: entries
        # (owner, tier, slot): entries; the owner is "shared" for a shared tier's slots
        self.slot_bytes = defaultdict(set) if slot_bytes is None else slot_bytes
        self.store = store
        self.loaded: set[int] = set()  # blocks whose bytes came from a tier
        self.seen_trace = 0
        self.seen_entries: set[tuple[int, int, bytes, int]] = set()
        self.num_loads = 0
        self.num_demotes = 0
        self.num_loaded_admissions = 0
        self.ops_in: list[int] = [0] * len(tiers)  # per tier: demotes and moves into it run
        self.ops_out: list[int] = [0] * len(tiers)  # per tier: loads from it run
        self.converter = Converter(self.geo)
        media = [t.spec.medium if isinstance(t, SharedTier) else t.medium for t in tiers]
        self.mirror = ReplicaMirror(self.geo, tiers=media, shared=[store] if store else [])
        self.num_mirror_lookups = 0
        self.num_mirror_tier_hits = 0

    # ------------------------------------------------------------------ the oracle
    def _tier_rows(self) -> list[tuple[int, int, bytes]]:
        return [(gid, b, key) for _, gid, b, key, _ in self.mgr.tiers.export_entries()]

    def lookup(self, k: Known) -> LookupResult:
        mgr = self.mgr
        res = mgr.lookup(k.rid)
        oreq = self.oracle_request(k)
        entries = self.book.entries(mgr.export_entries()) | self.book.entries(self._tier_rows())
        ghost = self.book.ghost(mgr.export_ghost())
        truth = oracle(self.geo, oreq, entries, ghost)
        got = (res.hit, res.reason, res.junction, res.top, res.n)
        want = (truth.hit, truth.reason, truth.junction, truth.top, truth.n)
        assert got == want, f"{k.rid}: core {got} != oracle {want}\n{res.explain()}"
        if self.geo.caching_enabled and not k.skip_read:
            assert res.bounds == truth.bounds
            self._check_tier_slots(k, res, entries)
        pending = oracle(self.geo, oreq, entries | self._pending_entries(), ghost)
        assert res.pending_hit == pending.hit
        assert list(res.loads) == tier_sources(res)
        if not mgr.events.pending and not k.skip_read:  # the mirror has every event
            self._check_mirror_lookup(k, res)
        self.num_lookups += 1
        return res

    def _check_mirror_lookup(self, k: Known, res: LookupResult) -> None:
        """A router's lookup on the mirror: the same hit, the same blocks loaded per tier."""
        chain = HashChain(self._hashes(self.oracle_request(k)))
        seen = compute_lookup(self.geo, self.mirror.tiered, k.rid, chain, len(k.tokens))
        assert seen.hit == res.hit, f"{k.rid}: mirror {seen.hit} != replica {res.hit}"
        assert [(g, t) for g, t, _ in tier_sources(seen)] == [(g, t) for g, t, _ in res.loads]
        self.num_mirror_lookups += 1
        self.num_mirror_tier_hits += bool(res.loads)

    def _check_tier_slots(self, k: Known, res: LookupResult, entries: set) -> None:
        """Each page of the hit names a block or a tier slot that holds its key."""
        hashes = self._hashes(self.oracle_request(k))
        u = self.geo.hash_unit
        want = expected_slots(self.geo, self.oracle_request(k), entries, res.hit)

        def holds(gid: int, blk: int, key: bytes) -> bool:
            if blk > 0:
                return self.mgr.pool.index[gid].get(key) == blk
            t, slot = source_of(blk)
            return self.mgr.tiers.tiers[t].index[gid].get(key) == slot

        for gid, marks in want.items():
            if not self.geo.groups[gid].cacheable:
                continue
            row, B = res.slots[gid], self.geo.groups[gid].page_size
            assert len(row) == len(marks)
            for j, (blk, mark) in enumerate(zip(row, marks, strict=True)):
                if mark == "full":
                    assert holds(gid, blk, hashes[(j + 1) * B // u]), (gid, j, blk)
                elif mark == "copy":
                    assert blk == res.copy_src[gid] and blk != 0
        for g in self.geo.cacheable:
            if not g.is_attention and res.hit:
                src = res.state_src[g.group_id]
                assert src is not None and holds(g.group_id, src, hashes[res.hit // u])

    def check_junction_saves(self, k: Known, res: LookupResult, lacks: dict[int, bool]) -> None:
        if not res.loads:  # a load's pops may evict the state the lookup saw at J
            super().check_junction_saves(k, res, lacks)

    # ------------------------------------------------------------------ the bytes
    def check(self) -> None:
        super().check()
        trace = self.trace
        events = []
        for item in trace[self.seen_trace :]:
            if isinstance(item, StepPlan):
                self._run_ops(item)
            elif isinstance(item, EVENTS):
                events.append(item)
        self.seen_trace = len(trace)
        self._note_publications()
        self._check_mirror(events)
        self._check_tier_metrics()

    def _check_tier_metrics(self) -> None:
        """The manager's per-tier counts are the ops the engine was handed (and those decided
        but not yet handed out); what each tier holds is within its capacity."""
        stack = self.mgr.tiers
        stored, loaded = list(self.ops_in), list(self.ops_out)
        for op in stack.ops:
            if isinstance(op, Demote):
                stored[op.tier] += 1
            elif isinstance(op, Move):
                stored[op.dst_tier] += 1
            else:
                loaded[op.tier] += 1
        metrics = self.mgr.metrics()["tiers"]
        for t, tier in enumerate(stack.tiers):
            m = metrics[tier.spec.name]
            assert (m["stored_blocks"], sum(m["loaded_blocks"].values())) == (stored[t], loaded[t])
            assert m["held_blocks"] == len(tier) <= m["capacity_blocks"] == tier.spec.num_blocks
            assert m["medium"] == tier.spec.medium and m["shared"] == tier.shared

    def _check_mirror(self, events: list[Any]) -> None:
        """The new events, as bytes on the wire, applied to the mirror: it holds what the pool
        and every tier hold, key for key."""
        payload = encode_batch(EventBatch(0.0, self.converter.convert(events)))
        mirror = self.mirror
        batch = decode_batch(payload).events
        mirror.check(batch)
        mirror.apply(batch)
        mgr = self.mgr
        for tier in mgr.tiers.tiers:
            if isinstance(tier, SharedTier) and self.store is not None:
                wire = encode_batch(EventBatch(0.0, self.converter.convert(tier.take_events())))
                self.store.apply(decode_batch(wire).events)
        for g in self.geo.cacheable:
            gid = g.group_id
            device = {hash64(key) for g2, _, key, _, _ in mgr.export_entries() if g2 == gid}
            assert set(mirror.entries(gid)) == device, gid
            for t in range(len(mgr.tiers.tiers)):
                held = {hash64(key) for t2, g2, _, key, _ in mgr.tiers.export_entries()
                        if (t2, g2) == (t, gid)}  # fmt: skip
                assert set(mirror.tier_entries(t, gid)) == held, (t, gid)

    def _entry(self, gid: int, b: int, key: bytes) -> Any:
        return (gid, b, self.book.by_hash[bytes(key)])

    def _slot(self, t: int, slot: int) -> tuple[Any, int, int]:
        if self.mgr.tiers.tiers[t].shared:
            return ("shared", 0, slot)
        return (id(self), t, slot)

    def _run_ops(self, step: StepPlan) -> None:
        """The engine's order: tier ops, then fresh blocks, then copies; then the reads."""
        for op in step.tier_ops:
            if isinstance(op, Demote):
                self.slot_bytes[self._slot(op.tier, op.slot)] = set(self.bytes[op.block_id])
                self.num_demotes += 1
                self.ops_in[op.tier] += 1
            elif isinstance(op, Move):
                src = self.slot_bytes[self._slot(op.src_tier, op.src_slot)]
                self.slot_bytes[self._slot(op.dst_tier, op.dst_slot)] = set(src)
                self.ops_in[op.dst_tier] += 1
            else:
                assert isinstance(op, Load)
                self.bytes[op.block_id] = set(self.slot_bytes[self._slot(op.tier, op.slot)])
                self.loaded.add(op.block_id)
                self.num_loads += 1
                self.ops_out[op.tier] += 1
        for plan in step.requests:
            fresh = [b for row in plan.new_blocks.values() for b in row]
            for b in fresh + [s.block for s in plan.saves]:
                self.bytes[b] = set()
                self.loaded.discard(b)
        for c in step.copies:
            self.bytes[c.dst] = set(self.bytes[c.src])
        for plan in step.requests:
            if plan.is_admission and plan.hit:
                self._check_reads(plan)

    def _check_reads(self, plan: Any) -> None:
        """Every page and state the admission reuses holds bytes of its own prefix."""
        k = self.known[plan.request_id]
        oreq = self.oracle_request(k)
        geo, h, u = self.geo, plan.hit, self.geo.hash_unit
        nu = len(self._hashes(oreq)) - 1
        marks = expected_slots(geo, oreq, set(), h)
        for gid, row_marks in marks.items():
            g = geo.groups[gid]
            if not g.cacheable:
                continue
            B, row = g.page_size, plan.tables[gid]
            for j, mark in enumerate(row_marks):
                have = self.bytes[row[j]]
                if mark == "full":
                    assert (gid, (j + 1) * B, ident(geo, oreq, (j + 1) * B)) in have, (gid, j)
                elif mark == "copy":
                    top = min((j + 1) * B, nu * u)
                    # The source may hold a later boundary of this page whose bytes before
                    # it are this prefix's: a block loaded from a tier is keyed at its
                    # page's lower boundaries too.
                    assert any(
                        self._covers(row[j], (gid, b, ident(geo, oreq, b)))
                        for b in range(h, top + 1, u)
                    ), (gid, j)
        for g in geo.cacheable:
            if not g.is_attention:
                live = plan.recurrent[g.group_id].live
                assert (g.group_id, h, ident(geo, oreq, h)) in self.bytes[live], g.group_id
        self.num_loaded_admissions += any(
            b in self.loaded for row in plan.tables.values() for b in row
        )

    def _covers(self, blk: int, entry: Any) -> bool:
        """Block `blk` holds the bytes of `entry`: written for it, or, on an attention page,
        for a later boundary of the same page and the same prefix (the page's bytes before
        that boundary are this prefix's)."""
        have = self.bytes[blk]
        if entry in have:
            return True
        gid, b, (tokens, units) = entry
        g, u, look = self.geo.groups[gid], self.geo.hash_unit, self.geo.lookahead
        if not g.is_attention:
            return False
        page = (b - 1) // g.page_size
        return any(
            g2 == gid and b2 > b and (b2 - 1) // g.page_size == page
            and (t2[: b + look], x2[: b // u]) == (tokens, units)
            for g2, b2, (t2, x2) in have
        )  # fmt: skip

    def _note_publications(self) -> None:
        """Entries published since the last check: a computed block now holds them; a loaded
        block must have been given them by its load."""
        now = {(g, b, bytes(key), blk) for g, b, key, _, blk in self.mgr.export_entries()}
        for gid, b, key, blk in now - self.seen_entries:
            entry = self._entry(gid, b, key)
            if blk in self.loaded:
                assert self._covers(blk, entry), f"block {blk} keyed {b} without its bytes"
            else:
                self.bytes[blk].add(entry)
        self.seen_entries = now


EVENTS = (BlockStored, BlockRemoved, AllBlocksCleared, TierStored, TierRemoved)
ADMISSIONS = st.sampled_from(
    [Admission.ON_EVICTION, Admission.ON_EVICTION, Admission.WRITE_THROUGH, Admission.NEVER]
)


@st.composite
def tier_stacks(draw: st.DrawFn) -> list[TierSpec]:
    num = draw(st.integers(1, 2))
    out = []
    for i, name in enumerate(["host", "store"][:num]):
        rule = {kind: draw(ADMISSIONS) for kind in ("full", "sliding", "chunked", "recurrent")}
        medium = "CPU" if name == "host" else ""  # "" takes the name: "STORE"
        out.append(TierSpec(name, draw(st.sampled_from([1, 3, 8, 40][i:])), rule, medium=medium))
    return out


@given(
    cfg=geometries(), tiers=tier_stacks(), seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 30)
)
def test_lookups_across_tiers_agree_with_the_oracle(
    cfg: CacheConfig, tiers: list[TierSpec], seed: int, rounds: int
) -> None:
    drv = TierDriver(cfg, random.Random(seed), tiers)
    page = max(g.page_size for g in cfg.geometry.groups)
    Engine(drv, max_len=min(3 * page + 5, 120)).run(rounds)
    drv.check()


def test_the_property_moves_bytes_through_the_tiers() -> None:
    """The histories above do exercise loads: on a small pool with a host tier, resends come
    back from the host and read the bytes the model says they must."""
    cfg = CacheConfig(num_blocks=12, groups=[GroupSpec(kind="full", block_size=4)])
    totals = [0, 0, 0, 0]
    for seed in range(20):
        drv = TierDriver(cfg, random.Random(seed), [TierSpec("host", 64)])
        Engine(drv, max_len=17).run(30)
        totals = [
            totals[0] + drv.num_demotes,
            totals[1] + drv.num_loads,
            totals[2] + drv.num_loaded_admissions,
            totals[3] + drv.num_mirror_tier_hits,
        ]
    assert all(totals), totals  # the mirror, too, saw lookups whose hit loads from the host


# ---------------------------------------------------------------------- worked examples
def _run(mgr: KVCacheManager, rid: str, tokens: list[int]) -> tuple[LookupResult, StepPlan]:
    from kvreuse import Request

    mgr.add_request(Request(rid, tokens))
    res = mgr.lookup(rid)
    assert mgr.allocate(rid, len(tokens) - res.hit, lookup=res) is not None
    step = mgr.seal_step()
    mgr.commit(step.step_id, {rid: (len(tokens), [7])})
    mgr.finish(rid)
    mgr.check_invariants()
    return res, step


def test_an_evicted_prefix_comes_back_from_the_host() -> None:
    cfg = CacheConfig(num_blocks=10, groups=[GroupSpec(kind="full", block_size=4)])
    mgr = KVCacheManager(cfg, tiers=[TierSpec("host", 32)])
    prompt = list(range(17))  # 4 full pages of 4, then the last token
    _run(mgr, "a", prompt)
    _, flood = _run(mgr, "b", [100 + i for i in range(33)])  # needs all 9 blocks
    assert len([op for op in flood.tier_ops if isinstance(op, Demote)]) == 4  # a's pages
    res, step = _run(mgr, "c", prompt)
    assert res.hit == 16 and [t for _, t, _ in res.loads] == [0, 0, 0, 0]
    loads = [op for op in step.tier_ops if isinstance(op, Load)]
    assert [op.block_id for op in loads] == step.requests[0].tables[0][:4]
    assert mgr.tiers.hit_tokens == [16]  # all of c's hit came from the host
    assert mgr.request_stats("c").tier_tokens == (16,)
    assert mgr.request_stats("a").tier_tokens == ()  # a loaded nothing
    # the loaded pages are device pages again: the next resend loads nothing
    res, step = _run(mgr, "d", prompt)
    assert res.hit == 16 and not res.loads
    assert not [op for op in step.tier_ops if isinstance(op, Load)]


def test_without_the_state_the_tier_gives_no_hybrid_hit() -> None:
    """A hit needs every group: a tier that never keeps recurrent states gives the attention
    pages back but no state, so the hybrid's hit is 0; one that keeps them gives it all."""
    groups = [GroupSpec(kind="full", block_size=4), GroupSpec(kind="recurrent", block_size=4)]
    cfg = CacheConfig(num_blocks=14, groups=groups)
    prompt = list(range(17))
    hits = {}
    for rule in (Admission.NEVER, Admission.ON_EVICTION):
        mgr = KVCacheManager(cfg, tiers=[TierSpec("host", 64, {"recurrent": rule})])
        _run(mgr, "a", prompt)
        _run(mgr, "b", [100 + i for i in range(40)])  # evicts everything "a" left
        res, _ = _run(mgr, "c", prompt)
        # whatever the hit reuses comes from the host: the device kept nothing of "a"
        assert all(b < 0 for row in res.slots.values() for b in row if b)
        hits[rule] = res.hit
    assert hits[Admission.NEVER] == 0
    assert hits[Admission.ON_EVICTION] == 16


def test_a_full_host_moves_its_oldest_slot_down_to_the_store() -> None:
    cfg = CacheConfig(num_blocks=6, groups=[GroupSpec(kind="full", block_size=4)])
    mgr = KVCacheManager(cfg, tiers=[TierSpec("host", 2), TierSpec("store", 16)])
    for i in range(4):
        _run(mgr, f"r{i}", [10 * i + j for j in range(9)])
    assert not mgr.tiers.take_ops()  # every op went out with its step
    moved = [e for e in mgr.tiers.export_entries() if e[0] == 1]
    assert moved and len([e for e in mgr.tiers.export_entries() if e[0] == 0]) <= 2
    # every slot the host freed went to the store, which has room for all: none was dropped
    host, store = mgr.metrics()["tiers"]["host"], mgr.metrics()["tiers"]["store"]
    assert host["held_blocks"] == 2 and host["evicted_blocks"] == store["stored_blocks"] > 0
    assert host["stored_blocks"] == host["held_blocks"] + host["evicted_blocks"]
    assert store["evicted_blocks"] == 0 and mgr.tiers.num_dropped == 0


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: TierSpec("", 4), "needs a name"),
        (lambda: TierSpec("host", 0), "num_blocks must be an integer ≥ 1"),
        (
            lambda: TierSpec("host", 4, {"full": "sometimes"}),
            "allowed: on_eviction, write_through, never",
        ),
    ],
)
def test_a_bad_tier_is_one_line(make: Any, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        make()


def test_two_tiers_with_one_name_are_refused() -> None:
    cfg = CacheConfig(num_blocks=6, groups=[GroupSpec(kind="full", block_size=4)])
    with pytest.raises(ConfigError, match="tier names must differ"):
        KVCacheManager(cfg, tiers=[TierSpec("host", 2), TierSpec("host", 4)])
