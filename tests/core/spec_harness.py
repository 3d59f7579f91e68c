"""The spec harness: what the spec-case tests (tests/core/test_spec_*.py) share.

* **Reference hashing** (`Tok`, `ref_enc`, `ref_chain`): an independent SHA-256 implementation of
  spec §5, written from the tables of §5.1–§5.4, so a test never trusts the library's own hasher.
  `test_spec_keys.py` pins it to every test vector of §5.6.
* **The named geometries of §4** (Geo-P, Geo-H, Geo-D, Geo-L, Geo-3, Geo-C) and the request
  shapes of §16: "A finished" (prompt prefilled in one step, one token sampled, T = P, released),
  `A200` and its sibling `B_SIBLING` (A's first 150 tokens + 70).
* **Two drivers of a real `KVCacheManager`**, both checking invariants after every operation (T10):
  `Checked` with the functions `add`, `look`, `admit`, `commit1`, `produce`, `decode` and the
  observations `rows`, `block_of`, `keys_on`, `stored`, `assert_lookup` (the test reads the event
  stream itself; `admit` also checks the admission counters of §12.1–§12.2, T6); and `Harness`, a
  class that owns the event stream and the requests' tokens and after every operation also checks
  the event replay (T9) and the gauge identity of §12.1.

Group ids of the example geometries (§4):

    Geo-P  0 full (16 × dcp 4 = 64)
    Geo-H  0 full (64)        1 recurrent (M = 16)
    Geo-D  0 full (64)        1 recurrent (16)       2 full draft (64, unsharded); mode "drop"
    Geo-L  0 full (2048 × 4 = 8192)                  1 recurrent (M = 256);  u = 256
    Geo-3  0 full (64)        1 sliding (32, W = 48) 2 recurrent (M = 32)
    Geo-C  0 full (64)        1 chunked (32, C = 64)

The random-history driver checked against the oracle is a different tool: `harness.py`.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvreuse.core import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheConfig,
    GroupSpec,
    KVCacheManager,
    LookupResult,
    MultiModalItem,
    Request,
    RequestPlan,
    StepPlan,
)

G = GroupSpec
NULL = 0  # the null block (§2): a slot the request does not need
OUT = 7  # the token every `produce` samples at the end of its prefill


# ================================================================================ reference hashing
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


# ================================================================================== geometries (§4)
def geo_p(num_blocks: int = 64, **kw: Any) -> CacheConfig:
    """Geo-P: full attention, local 16 × dcp 4 → B = 64; u = 16."""
    return CacheConfig(num_blocks=num_blocks, dcp_size=4, groups=[G("full", 16)], **kw)


def geo_h(num_blocks: int = 64, **kw: Any) -> CacheConfig:
    """Geo-H: full 16 × dcp 4 → 64; recurrent M = 16; u = 16."""
    groups = [G("full", 16), G("recurrent", 16)]
    return CacheConfig(num_blocks=num_blocks, dcp_size=4, groups=groups, **kw)


DRAFT64 = G("full", 64, dcp_sharded=False, role="draft")  # the draft group of Geo-D


def geo_d(mode: str = "drop", L: int = 1, num_blocks: int = 64) -> CacheConfig:
    """Geo-D: Geo-H plus an unsharded draft group, B = 64; spec mode `drop` by default."""
    groups = [G("full", 16), G("recurrent", 16), DRAFT64]
    return CacheConfig(
        num_blocks=num_blocks, dcp_size=4, groups=groups, spec_mode=mode, lookahead_tokens=L
    )  # type: ignore[arg-type]


def geo_l(num_blocks: int = 64) -> CacheConfig:
    """Geo-L: full 2048 × dcp 4 → 8192; recurrent M = 256; u = 256 (the `hybrid-dcp4` preset)."""
    groups = [G("full", 2048), G("recurrent", 256)]
    return CacheConfig(num_blocks=num_blocks, dcp_size=4, groups=groups)


def geo_3(extra: Sequence[GroupSpec] = (), **kw: Any) -> CacheConfig:
    """Geo-3: full 16 × dcp 4 → 64; sliding B = 32, W = 48; recurrent M = 32; u = 16."""
    kw.setdefault("num_blocks", 64)
    groups = [G("full", 16), G("sliding", 32, window=48), G("recurrent", 32), *extra]
    return CacheConfig(groups=groups, dcp_size=4, **kw)


def geo_c(**kw: Any) -> CacheConfig:
    """Geo-C: full 16 × dcp 4 → 64; chunked B = 32, C = 64; u = 16."""
    kw.setdefault("num_blocks", 64)
    return CacheConfig(groups=[G("full", 16), G("chunked", 32, chunk=64)], dcp_size=4, **kw)


# =============================================================================== requests and plans
def toks(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


A200 = toks(200)
B_SIBLING = A200[:150] + toks(70, 50_000)  # shares A's first 150 tokens, 220 in all


def saves(plan: RequestPlan, g: int | None = None) -> list[int]:
    """The positions of the plan's saves (in group g, or all), ascending."""
    return sorted(s.position for s in plan.saves if g is None or s.group_id == g)


def save_block(plan: RequestPlan, g: int, pos: int) -> int:
    """The block of the plan's one save at `pos` in group g."""
    (blk,) = [s.block for s in plan.saves if s.group_id == g and s.position == pos]
    return blk


# ============================================================================ Checked and its cycle
class Checked:
    """A manager whose every method call is followed by `check_invariants()` (T10).

    A transparent proxy: the test reads events itself (`take_events()`) and drives the cycle
    with the functions below, which take the `Checked` manager as their first argument."""

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


# ========================================================================================== Harness
class Harness:
    """A manager driven through named operations, each followed by `check` (T9, T10, §12.1).

    It owns the event stream (`events()` hands back what arrived since the last call) and the
    tokens of each request, so a test states operations, not bookkeeping."""

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


def stored_events(events: Sequence[Any]) -> list[BlockStored]:
    """The BlockStored events, in order."""
    return [e for e in events if isinstance(e, BlockStored)]


def stored_runs(events: Sequence[Any]) -> list[tuple[int, list[int]]]:
    """(group, boundaries) of each BlockStored, in order."""
    return [(e.group_id, [x.boundary for x in e.entries]) for e in stored_events(events)]


def reason_total(h: Harness) -> dict[str, int]:
    return dict(h.counter("prefix_cache_reason_total"))
