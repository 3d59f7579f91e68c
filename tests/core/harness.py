"""A driver that plays random histories against the core and checks it against the oracle.

It plays the engine's part (prefill chunks, sampled tokens, drafts with random acceptance,
saves it may fail to write) and after every operation asserts: `check_invariants()`, the
replay property of events (T9), the metric identities (T6), and — at every lookup — that the
hit, reason, junction, slots and pending_hit equal the oracle's truth (T1, T2, T4, T5, T7).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field, replace
from typing import Any

from kvreuse import (
    CacheConfig,
    KVCacheManager,
    LookupResult,
    MultiModalItem,
    Request,
    compute_lookup,
)
from kvreuse.core.pool import NULL
from kvreuse.core.request import Phase
from kvreuse.oracle import IdentBook, OracleRequest, expected_slots, oracle


@dataclass
class Known:
    """The harness's own record of a request (never read from the manager's internals)."""

    rid: str
    prompt: list[int]
    lora: tuple[str, str] | None
    mm: tuple[MultiModalItem, ...]
    salt: str | None
    skip_read: bool
    tokens: list[int] = field(default_factory=list)
    max_tokens: int = 4
    admitted: bool = False
    first_hit: int | None = None


class Mirror:
    """An IndexView of plain dicts: per group, hash -> block id, and the ghost keys."""

    def __init__(self, num_groups: int, entries: list, ghost: list) -> None:
        self.index: list[dict[bytes, int]] = [{} for _ in range(num_groups)]
        for gid, _, key, _, block_id in entries:
            self.index[gid][key] = block_id
        self._ghost = {(gid, key) for gid, _, key in ghost}

    def in_ghost(self, group_id: int, key: bytes) -> bool:
        return (group_id, key) in self._ghost


class ChainCopy:
    """A ChainView from a list of hashes H[0] … H[n]."""

    def __init__(self, hashes: list[bytes]) -> None:
        self.hashes = hashes
        self.num_units = len(hashes) - 1


class Driver:
    def __init__(self, cfg: CacheConfig, rng: random.Random) -> None:
        self.cfg = cfg
        self.geo = cfg.geometry
        self.mgr = KVCacheManager(cfg)
        self.rng = rng
        self.book = IdentBook(self.geo, self._hashes)
        self.known: dict[str, Known] = {}
        self.finished: list[Known] = []
        self.replayed: dict[tuple[int, bytes], tuple[int, str]] = {}
        self.tier_replayed: dict[tuple[int, int, bytes], int] = {}  # (tier, gid, key): bd
        self.dropped_events = False
        self.hits_sum = 0
        self.queries_sum = 0
        self.num_first = 0
        self.next_id = 0
        self.num_lookups = 0
        self.num_resets = 0
        self.last_seq = 0
        self.trace: list[Any] = []  # plans, steps and events, in order (T12)
        self.last_lookup: dict[str, tuple[int, tuple[int, int], int]] = {}
        self.admitted_at: dict[str, tuple[int, int]] = {}
        self.preempted = [0, 0, 0]  # requests, queries, hits of re-admissions (T6)

    # ------------------------------------------------------------------ helpers
    def _hashes(self, req: OracleRequest) -> list[bytes]:
        mm = tuple(MultiModalItem(i, o, n) for i, o, n in req.mm_items)
        chain = self.mgr.hasher.chain(lora=req.lora, mm_items=mm, cache_salt=req.cache_salt)
        chain.extend(list(req.tokens))
        return chain.hashes

    def oracle_request(self, k: Known) -> OracleRequest:
        return OracleRequest(
            tuple(k.tokens),
            len(k.prompt),
            k.lora,
            tuple((m.identifier, m.offset, m.length) for m in k.mm),
            k.salt,
            k.skip_read,
        )

    def check(self) -> None:
        """After every operation: invariants, event replay, metric identities."""
        mgr = self.mgr
        mgr.check_invariants()
        if self.cfg.enable_events:
            events = mgr.take_events()
            for ev in events:  # T9: seq grows by exactly 1 per event of any type
                assert ev.seq == self.last_seq + 1, (ev.seq, self.last_seq)
                self.last_seq = ev.seq
            self.trace.extend(events)
            tiers = self.tier_replayed
            for ev in events:
                if ev.type == "BlockStored":
                    for e in ev.entries:
                        self.replayed[(ev.group_id, e.hash)] = (e.boundary, e.kind)
                elif ev.type == "BlockRemoved":
                    del self.replayed[(ev.group_id, ev.hash)]
                elif ev.type == "TierStored":
                    for b, key in ev.entries:
                        assert (ev.tier, ev.group_id, key) not in tiers, "stored twice"
                        tiers[(ev.tier, ev.group_id, key)] = b
                elif ev.type == "TierRemoved":
                    for _, key in ev.entries:
                        del tiers[(ev.tier, ev.group_id, key)]
                else:
                    assert ev.type == "AllBlocksCleared", ev.type
                    self.replayed.clear()
                    tiers.clear()
            if not mgr.metrics()["kv_events_dropped_total"]:
                exported = {(g, h): (b, kind) for g, b, h, kind, _ in mgr.export_entries()}
                assert exported == self.replayed, "event replay differs from export_entries()"
                own = [not tier.shared for tier in mgr.tiers.tiers]  # a shared one logs apart
                held = {(t, g, key): b for t, g, b, key, _ in mgr.tiers.export_entries() if own[t]}
                assert held == tiers, "tier event replay differs from the tiers' entries"
        m = mgr.metrics()
        assert m["prefix_cache_hits"] == self.hits_sum
        assert m["prefix_cache_queries"] == self.queries_sum
        assert m["prefix_cache_requests"] == self.num_first
        assert [
            m["prefix_cache_preempted_requests"],
            m["prefix_cache_preempted_queries"],
            m["prefix_cache_preempted_hits"],
        ] == self.preempted
        for k in self.known.values():
            if k.admitted:
                assert mgr.request_stats(k.rid).cached_tokens == k.first_hit

    # ------------------------------------------------------------------ requests
    def new_request(
        self,
        tokens: list[int],
        *,
        salt: str | None = None,
        lora: tuple[str, str] | None = None,
        mm: tuple[MultiModalItem, ...] = (),
        skip_read: bool = False,
        max_tokens: int = 4,
    ) -> Known:
        rid = f"r{self.next_id}"
        self.next_id += 1
        k = Known(rid, list(tokens), lora, mm, salt, skip_read, list(tokens), max_tokens)
        self.mgr.add_request(
            Request(rid, tokens, lora=lora, mm_items=mm, cache_salt=salt, skip_read=skip_read)
        )
        self.known[rid] = k
        self.book.add(self.oracle_request(k))
        self.check()
        return k

    def lookup(self, k: Known) -> LookupResult:
        """A lookup checked against the oracle (T1, T2, T4, T5, T7)."""
        mgr = self.mgr
        res = mgr.lookup(k.rid)
        oreq = self.oracle_request(k)
        entries = self.book.entries(mgr.export_entries())
        ghost = self.book.ghost(mgr.export_ghost())
        truth = oracle(self.geo, oreq, entries, ghost)
        assert (res.hit, res.reason, res.junction) == (truth.hit, truth.reason, truth.junction), (
            f"{k.rid}: core {(res.hit, res.reason, res.junction)} != oracle "
            f"{(truth.hit, truth.reason, truth.junction)}\n{res.explain()}"
        )
        assert res.top == truth.top and res.n == truth.n
        if self.geo.caching_enabled and not k.skip_read:
            assert res.bounds == truth.bounds
        u = self.geo.hash_unit
        assert res.hit <= max(0, len(k.tokens) - 1) and res.hit % u == 0 and res.hit <= res.n * u
        self._check_slots(k, res, entries)
        self._check_mirror(k, res)
        pending = oracle(self.geo, oreq, entries | self._pending_entries(), ghost)
        assert res.pending_hit == pending.hit, (res.pending_hit, pending.hit)
        if self.geo.caching_enabled and not k.skip_read:
            assert res.pending_bounds == pending.bounds, (res.pending_bounds, pending.bounds)
        removed = self._removals()
        last = self.last_lookup.get(k.rid)
        if last is not None and last[1] == removed and last[2] == len(k.tokens):
            assert res.hit >= last[0], f"T3: {k.rid} hit fell from {last[0]} to {res.hit}"
        self.last_lookup[k.rid] = (res.hit, removed, len(k.tokens))
        self.num_lookups += 1
        return res

    def _check_mirror(self, k: Known, res: LookupResult) -> None:
        """The lookup rules run unchanged over a mirror built from the exports (what a router
        rebuilds from events): the same result, pending keys aside (a mirror has none)."""
        mgr = self.mgr
        mirror = Mirror(len(self.geo.groups), mgr.export_entries(), mgr.export_ghost())
        chain = ChainCopy(self._hashes(self.oracle_request(k)))
        got = compute_lookup(
            self.geo, mirror, k.rid, chain, len(k.tokens), skip_read=k.skip_read, epoch=res.epoch
        )
        assert got == replace(res, pending_hit=res.hit, pending_bounds=res.bounds), (got, res)

    def run_to_finish(self, k: Known) -> LookupResult:
        """Admit `k` with its whole prompt in one step, sample one token, finish it."""
        mgr = self.mgr
        res = self.lookup(k)
        assert mgr.allocate(k.rid, len(k.tokens) - res.hit, lookup=res) is not None
        self.hits_sum += res.hit
        self.queries_sum += len(k.prompt)
        self.num_first += 1
        k.admitted, k.first_hit = True, res.hit
        self.check()
        step = mgr.seal_step()
        mgr.commit(step.step_id, {k.rid: (len(k.tokens), [1])})
        k.tokens.append(1)
        self.book.add(self.oracle_request(k))
        self.check()
        mgr.finish(k.rid)
        self.known.pop(k.rid)
        self.finished.append(k)
        self.check()
        return res

    def lacks_state(self, k: Known, position: int | None) -> dict[int, bool]:
        """Per recurrent group: is there no state at `position` for this request's chain?"""
        if position is None:
            return {}
        key = self.mgr.requests[k.rid].chain.hashes[position // self.geo.hash_unit]
        return {
            g.group_id: key not in self.mgr.pool.index[g.group_id]
            for g in self.geo.cacheable
            if not g.is_attention
        }

    def check_junction_saves(self, k: Known, res: LookupResult, lacks: dict[int, bool]) -> None:
        """T5: saves at the junction J are planned exactly in the recurrent groups that lacked a
        state at J when the request looked up."""
        if res.junction is None:
            return
        planned = self.mgr.requests[k.rid].planned
        for gid, missing in lacks.items():
            assert (res.junction in planned[gid]) == missing, (gid, res.junction)

    def _removals(self) -> tuple[int, int]:
        """Keys removed so far (evictions) and resets: T3 and T14 hold between removals."""
        return (self.mgr.pool.num_removed_keys, self.num_resets)

    def check_publication(self, rid: str) -> None:
        """T14: after a commit, every boundary up to min(T, n·u) of the request's own pages is
        keyed (unless a key was removed since its admission or a window freed the page)."""
        st = self.mgr.requests.get(rid)
        if st is None or self.admitted_at.get(rid) != self._removals():
            return
        u_ = self.geo.hash_unit
        e = min(st.committed, st.chain.num_units * u_)
        hashes = st.chain.hashes
        for gid, row in st.tables.items():
            g = self.geo.groups[gid]
            if not g.cacheable or not self.geo.caching_enabled:
                continue
            start = st.hit // g.page_size * g.page_size
            for b in range(start + u_, e + 1, u_):
                if row[(b - 1) // g.page_size] != NULL:
                    assert hashes[b // u_] in self.mgr.pool.index[gid], f"T14: {rid} g{gid} b{b}"

    def _check_slots(self, k: Known, res: LookupResult, entries: set) -> None:
        if not self.geo.caching_enabled or k.skip_read:
            return
        want = expected_slots(self.geo, self.oracle_request(k), entries, res.hit)
        hashes = self._hashes(self.oracle_request(k))
        index = self.mgr.pool.index
        for gid, marks in want.items():
            if not self.geo.groups[gid].cacheable:
                continue  # invisible to lookup (spec §4)
            row = res.slots[gid]
            assert len(row) == len(marks), (gid, row, marks)
            B = self.geo.groups[gid].page_size
            for j, (blk, mark) in enumerate(zip(row, marks, strict=True)):
                if mark == "null":
                    assert blk == NULL
                elif mark == "full":
                    assert index[gid].get(hashes[(j + 1) * B // u(self)]) == blk
                else:
                    assert blk == res.copy_src[gid] and blk != NULL
        for g in self.geo.cacheable:
            if not g.is_attention:
                src = res.state_src[g.group_id]
                if res.hit:
                    assert index[g.group_id].get(hashes[res.hit // u(self)]) == src
                else:
                    assert src is None

    def _pending_entries(self) -> set:
        """Entries of uncommitted plans (7.8), from the plans' own tables and saves."""
        out = set()
        mgr = self.mgr
        u_ = self.geo.hash_unit
        for st in mgr.requests.values():
            if st.phase is not Phase.RUNNING or st.deferred is not None:
                continue
            recs = [r for r in mgr.ledger.records() if r.req is st and not r.withdrawn]
            if not recs:
                continue
            end = max(r.plan.end for r in recs)
            oreq = self.oracle_request(self.known[st.request_id])
            e = min(end, st.chain.num_units * u_)
            for gid, row in st.tables.items():
                g = self.geo.groups[gid]
                if not g.cacheable:
                    continue
                for b in range(st.processed[gid] + u_, e + 1, u_):
                    if row[(b - 1) // g.page_size] != NULL:
                        out.add((gid, b, self._ident(oreq, b)))
            for r in recs:
                for gid, c, _, _, planned in r.saves:  # PlannedSave fields
                    if planned and c <= e:
                        out.add((gid, c, self._ident(oreq, c)))
        return out

    def _ident(self, oreq: OracleRequest, b: int) -> Any:
        from kvreuse.oracle import ident

        return ident(self.geo, oreq, b)


def u(driver: Driver) -> int:
    return driver.geo.hash_unit


# ---------------------------------------------------------------------------- the engine's part
@dataclass
class Flight:
    """A sealed step the fake engine is running."""

    step_id: int
    plans: list[Any]


class Engine:
    """Plays random histories on a Driver: admissions, steps, commits, aborts, pressure."""

    def __init__(self, drv: Driver, max_len: int) -> None:
        self.drv = drv
        self.rng = drv.rng
        self.max_len = max_len
        self.spec = drv.geo.spec_mode != "none"
        self.plan_views: dict[int, tuple] = {}  # id(plan) -> its content when it was handed out

    # plans are snapshots ------------------------------------------------------------------
    def note_plan(self, plan: Any) -> None:
        """A fresh plan shows the request's tables and slots as they are now (spec §9.7)."""
        st = self.drv.mgr.requests[plan.request_id]
        assert plan.tables == st.tables, "a plan's tables differ from the request's"
        for gid, slot in plan.recurrent.items():
            slots = st.recurrent[gid]
            assert (slot.live, slot.scratch) == (slots.live, tuple(slots.scratch))
        for gid, fresh in plan.new_blocks.items():
            if gid in plan.tables:
                row = plan.tables[gid]
                assert row[len(row) - len(fresh) :] == fresh, "new blocks are the table's tail"
        self.plan_views[id(plan)] = _plan_view(plan)

    def check_plan_unchanged(self, plan: Any) -> None:
        """Later growth of the request never changes a plan already handed out."""
        view = self.plan_views.pop(id(plan), None)
        assert view is None or _plan_view(plan) == view, "a plan changed after it was handed out"

    # requests ----------------------------------------------------------------------------
    def random_prompt(self) -> list[int]:
        rng, pool = self.rng, self.drv.finished + list(self.drv.known.values())
        kind = rng.choice(["cold", "resend", "extend", "diverge", "turn", "turn"])
        if kind == "cold" or not pool:
            return [rng.randrange(4) for _ in range(rng.randint(1, self.max_len))]
        base = rng.choice(pool)
        if kind == "resend":
            return list(base.prompt)
        if kind == "extend":
            return base.prompt + [rng.randrange(4) for _ in range(rng.randint(1, 12))]
        if kind == "diverge":
            cut = rng.randint(0, len(base.prompt))
            tail = [rng.randrange(4, 8) for _ in range(rng.randint(1, 12))]
            return base.prompt[:cut] + tail
        return base.tokens + [rng.randrange(4) for _ in range(rng.randint(1, 8))]

    def add(self) -> Known:
        rng = self.rng
        tokens = self.random_prompt()[: self.max_len * 2]
        salt = rng.choice([None, None, None, "", "t1", "t2"])
        lora = rng.choice([None, None, None, ("fr", "/v1"), ("fr", "/v2")])
        mm: tuple[MultiModalItem, ...] = ()
        if rng.random() < 0.1 and len(tokens) > 2:
            off = rng.randrange(len(tokens) - 1)
            mm = (MultiModalItem(rng.choice(["img-a", b"img-b"]), off, rng.randint(1, 6)),)
        return self.drv.new_request(
            tokens,
            salt=salt,
            lora=lora,
            mm=mm,
            skip_read=rng.random() < 0.05,
            max_tokens=rng.randint(1, 6),
        )

    # steps -------------------------------------------------------------------------------
    def schedule(self) -> None:
        """Admit or grow every request that has no step in flight (growths sometimes in one
        `allocate_many` call, checked against the same calls one by one on a twin)."""
        drv, mgr, rng = self.drv, self.drv.mgr, self.rng
        batch: list[tuple[str, int]] | None = [] if rng.random() < 0.3 else None
        for k in list(drv.known.values()):
            st = mgr.requests.get(k.rid)
            if st is None or st.inflight or st.deferred or st.open_plan is not None:
                continue
            if st.phase is Phase.WAITING:
                if rng.random() < 0.2:
                    continue
                res = drv.lookup(k)
                num_new = rng.randint(1, len(k.tokens) - res.hit)
                if rng.random() < 0.6:
                    num_new = len(k.tokens) - res.hit
                before = snapshot(mgr)
                lacks = drv.lacks_state(k, res.junction)
                plan = mgr.allocate(
                    k.rid, num_new, lookup=res, num_extra_slots=rng.choice([0, 0, 1])
                )
                drv.trace.append(plan)
                if plan is None:
                    assert snapshot(mgr) == before, "a failed allocate changed state (T8)"
                else:
                    self.note_plan(plan)
                    drv.check_junction_saves(k, res, lacks)
                    drv.admitted_at[k.rid] = drv._removals()
                    if not k.admitted:
                        k.admitted, k.first_hit = True, res.hit
                        drv.hits_sum += res.hit
                        drv.queries_sum += len(k.prompt)
                        drv.num_first += 1
                    else:
                        drv.preempted[0] += 1
                        drv.preempted[1] += len(k.tokens)
                        drv.preempted[2] += res.hit
            else:
                num = len(k.tokens)
                if st.scheduled < num - 1:
                    num_new = rng.randint(1, num - st.scheduled)
                else:
                    num_new = 1 + (rng.randint(0, 3) if self.spec else 0)
                if batch is not None:
                    batch.append((k.rid, num_new))
                    continue
                before = snapshot(mgr)
                grown = mgr.allocate(k.rid, num_new)
                if grown is None:
                    assert snapshot(mgr) == before, "a failed allocate changed state (T8)"
                else:
                    self.note_plan(grown)
            drv.check()
        if batch:
            self.grow_batch(batch)

    def grow_batch(self, batch: list[tuple[str, int]]) -> None:
        """`allocate_many` equals the per-request calls: same plans, same state after."""
        mgr = self.drv.mgr
        template = mgr.hasher.template  # immutable (and holds a Struct, which cannot be copied)
        twin = copy.deepcopy(mgr, memo={id(template): template})
        expected = [twin.allocate(rid, n) for rid, n in batch]
        counts: Any = [n for _, n in batch]
        if len({*counts}) == 1 and self.rng.random() < 0.5:
            counts = counts[0]  # one count for all
        got = mgr.allocate_many([rid for rid, _ in batch], counts)
        assert got == expected, (got, expected)
        assert snapshot(mgr) == snapshot(twin)
        for plan in got:
            if plan is not None:
                self.note_plan(plan)
        self.drv.check()

    def probe_lookup(self) -> None:
        """Look up one waiting request (pure; checked against the oracle by `lookup`)."""
        mgr = self.drv.mgr
        waiting = [k for k in self.drv.known.values() if _is_waiting(mgr, k.rid)]
        if waiting:
            self.drv.lookup(self.rng.choice(waiting))

    def outcome(self, k: Known, plan: Any) -> tuple:
        rng, num = self.rng, len(k.tokens)
        if plan.end < num:
            t_new, new = plan.end, []
        elif plan.end == num:
            t_new, new = num, [rng.randrange(4)]
        else:
            accepted = rng.randint(0, plan.end - num)
            t_new, new = num + accepted, [rng.randrange(4) for _ in range(accepted + 1)]
        saves = [s.position for s in plan.saves]
        saved = None if rng.random() < 0.7 else [c for c in saves if rng.random() < 0.5]
        return (t_new, new, saved)

    def run_step(self) -> None:
        drv, mgr, rng = self.drv, self.drv.mgr, self.rng
        self.schedule()
        step = mgr.seal_step()
        drv.trace.append(step)
        drv.check()
        self.probe_lookup()  # between seal and commit: sealed plans count for pending_hit
        if not step.requests:
            return
        steps = [step]
        if not self.spec and rng.random() < 0.3:
            steps.append(self.overlap(step))
        for _ in range(rng.randint(0, 2)):
            self.chaos()
        for s in steps:
            if rng.random() < 0.1:
                mgr.discard(s.step_id)
            else:
                self.commit(s)
            self.forget_finished()
            drv.check()
        for k in list(drv.known.values()):
            st = mgr.requests.get(k.rid)
            if (
                st is not None
                and st.phase is Phase.RUNNING
                and not st.inflight
                and (len(k.tokens) - len(k.prompt) >= k.max_tokens)
            ):
                self.finish(k)

    def overlap(self, step: Any) -> Any:
        """Schedule the next step of `step`'s requests while it is in flight (10.6, 9.6: N̂)."""
        drv, mgr, rng = self.drv, self.drv.mgr, self.rng
        for plan in step.requests:
            st = mgr.requests.get(plan.request_id)
            if st is None or st.deferred is not None or st.open_plan is not None:
                continue
            num = len(st.tokens)
            n_hat = num + (1 if plan.end >= num else 0)
            start = st.scheduled
            num_new = rng.randint(1, n_hat - start) if start < n_hat - 1 else 1
            before = snapshot(mgr)
            grown = mgr.allocate(plan.request_id, num_new)
            if grown is None:
                assert snapshot(mgr) == before
            else:
                self.note_plan(grown)
            drv.check()
        second = mgr.seal_step()
        drv.trace.append(second)
        drv.check()
        return second

    def commit(self, step: Any) -> None:
        """Play the engine's outcome of `step` (computed now, after earlier steps committed)."""
        drv, mgr = self.drv, self.drv.mgr
        outcomes = {}
        for plan in step.requests:
            self.check_plan_unchanged(plan)
            st = mgr.requests.get(plan.request_id)
            if st is not None and st.phase is Phase.RUNNING:
                outcomes[plan.request_id] = self.outcome(drv.known[plan.request_id], plan)
        if self.rng.random() < 0.5:
            mgr.commit(step.step_id, outcomes)
        else:  # the same outcomes in plan order
            mgr.commit_batch(step.step_id, [outcomes.get(p.request_id) for p in step.requests])
        for rid, (_, new, _) in outcomes.items():
            st = mgr.requests.get(rid)
            if st is not None and st.phase is Phase.RUNNING and st.deferred is None:
                k = drv.known[rid]
                k.tokens.extend(new)
                drv.book.add(drv.oracle_request(k))
                drv.check_publication(rid)

    def finish(self, k: Known) -> None:
        self.drv.mgr.finish(k.rid)
        self.forget_finished()
        self.drv.check()

    def forget_finished(self) -> None:
        """Requests whose (possibly deferred) finish has happened leave the live set."""
        for k in list(self.drv.known.values()):
            if k.rid not in self.drv.mgr.requests:
                self.drv.known.pop(k.rid)
                self.drv.finished.append(k)

    def chaos(self, inflight: Any = None) -> None:
        """Aborts, preemptions, targeted evictions, resets, extra lookups."""
        drv, mgr, rng = self.drv, self.drv.mgr, self.rng
        op = rng.choice(["finish", "preempt", "evict", "reset", "lookup", "nothing"])
        live = list(drv.known.values())
        if op == "finish" and live:
            self.finish(rng.choice(live))
        elif op == "preempt":
            running = [k for k in live if mgr.requests[k.rid].phase is Phase.RUNNING]
            if running:
                mgr.preempt(rng.choice(running).rid)
                drv.check()
        elif op == "evict":
            cached = [b for *_, b in mgr.export_entries() if mgr.pool.ref[b] == 0]
            if cached:
                mgr.evict(rng.choice(cached))
                drv.check()
        elif op == "reset":
            in_use = mgr.num_free_blocks != mgr.pool.num_blocks - 1
            before = mgr.export_entries()
            assert mgr.reset() is (not in_use)  # T13
            drv.num_resets += not in_use
            if in_use:
                assert mgr.export_entries() == before
            else:
                assert mgr.export_entries() == [] and mgr.export_ghost() == []
            drv.check()
        elif op == "lookup":
            waiting = [k for k in live if mgr.requests[k.rid].phase is Phase.WAITING]
            if waiting:
                drv.lookup(rng.choice(waiting))
        # A finish/preempt of a request in `inflight` is deferred by the core itself.

    def run(self, num_rounds: int) -> None:
        for _ in range(num_rounds):
            for _ in range(self.rng.choice([0, 1, 1, 2])):
                self.add()
            self.run_step()
            if self.rng.random() < 0.3:
                self.chaos()


def _is_waiting(mgr: KVCacheManager, rid: str) -> bool:
    st = mgr.requests.get(rid)
    return st is not None and st.phase is Phase.WAITING


def _plan_view(plan: Any) -> tuple:
    """A deep copy of what the engine reads from a plan."""
    return (
        {g: list(row) for g, row in plan.tables.items()},
        dict(plan.recurrent),
        {g: list(b) for g, b in plan.new_blocks.items()},
        list(plan.copies),
        list(plan.saves),
    )


def snapshot(mgr: KVCacheManager) -> tuple:
    """Everything a call that fails or is refused must leave unchanged (T8, spec §3)."""
    pool = mgr.pool
    return (
        mgr.epoch,
        list(pool.ref),
        pool.policy.order() if hasattr(pool.policy, "order") else None,
        mgr.export_entries(),
        dict(mgr.stats.counters),
        mgr.events.seq,
        len(mgr.events.pending),
        sorted(mgr.requests),
    )
