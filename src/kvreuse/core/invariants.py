"""`check_invariants()` (spec §14): a full, slow audit of the manager's state.

Tests call it after every operation; it recomputes every reference count from scratch, so a
drift anywhere (a lost release, a double pop, a stale key) is caught at the operation that
caused it, not thousands of operations later.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from kvreuse.core.config import Geometry
from kvreuse.core.errors import InvariantError
from kvreuse.core.ledger import StepLedger
from kvreuse.core.pool import NULL, BlockPool
from kvreuse.core.request import Phase, RequestState
from kvreuse.core.savepoints import next_save_position, rolling_range, save_positions


def _fail(code: str, msg: str) -> None:
    raise InvariantError(f"{code}: {msg}")


def audit(
    geo: Geometry, pool: BlockPool, requests: Collection[RequestState], ledger: StepLedger
) -> None:
    """Recount every reference and key from the requests, the ledger and the pool; raise
    InvariantError naming the first broken invariant (I1–I14)."""
    n = pool.num_blocks
    refs: Counter[int] = Counter()
    holders: dict[int, set[int]] = {}  # block -> groups of the tables holding it
    table_holders: Counter[tuple[int, int]] = Counter()  # (group, block) -> number of tables
    unkeyed_required: set[int] = set()
    for st in requests:
        for gid, row in st.tables.items():
            for j, b in enumerate(row):
                if b == NULL:
                    continue
                refs[b] += 1
                holders.setdefault(b, set()).add(gid)
                table_holders[(gid, b)] += 1
                _check_position(geo, pool, gid, j, b)
        for gid, slots in st.recurrent.items():
            for b in (slots.live, *slots.scratch):
                refs[b] += 1
                holders.setdefault(b, set()).add(gid)
                unkeyed_required.add(b)
            for b in slots.held.values():
                refs[b] += 1
                holders.setdefault(b, set()).add(gid)
    _count_pending(pool, ledger, refs)
    in_use = 0
    for b in range(1, n):
        r = pool.ref[b]
        if r != refs[b]:
            _fail("I3", f"block {b} has ref {r}, but {refs[b]} slots and pending ops name it")
        queued = b in pool.policy
        if queued != (r == 0):
            _fail("I2", f"block {b} ref {r} but in free queue = {queued}")
        in_use += r > 0
    if NULL in pool.policy or pool.has_keys(NULL) or refs[NULL]:
        _fail("I2", "the null block is queued, keyed or referenced")
    if len(pool.policy) + in_use + 1 != n:
        _fail("I1", f"free {len(pool.policy)} + in use {in_use} + 1 != {n}")
    for b in unkeyed_required:
        if pool.has_keys(b):
            _fail("I8", f"live/scratch block {b} carries a key")
    _check_index(geo, pool, holders, table_holders)
    _check_requests(geo, pool, requests)
    ghost = pool.ghost
    if len(ghost) > pool.ghost_capacity:
        _fail("I12", f"ghost holds {len(ghost)} > capacity {pool.ghost_capacity}")
    for gid, key in ghost:
        if key in pool.index[gid]:
            _fail("I12", f"a key of group {gid} is both in the index and the ghost record")


def _count_pending(pool: BlockPool, ledger: StepLedger, refs: Counter[int]) -> None:
    """Add the references of every live plan's pending copies and saves (I2, I8)."""
    parked = ledger.parked()
    for rec in ledger.records() + parked:
        if rec.withdrawn and rec not in parked:
            continue  # released already with its request
        for c in rec.copies:
            refs[c.src] += 1
            refs[c.dst] += 1
            if c.src == NULL or c.dst == NULL:
                _fail("I2", f"a copy names the null block: {c}")
        for s in rec.saves:
            refs[s.block_id] += 1
            if s.block_id == NULL:
                _fail("I2", "a save names the null block")
            if pool.has_keys(s.block_id):
                _fail("I8", f"save target {s.block_id} ({s}) carries a key")
        for c in rec.copies:
            if pool.has_keys(c.dst):
                _fail("I8", f"copy destination {c.dst} carries a key")


def _check_position(geo: Geometry, pool: BlockPool, gid: int, j: int, b: int) -> None:
    B = geo.groups[gid].page_size
    bounds = [bd for bd, _ in pool.key_list(b)]
    if len(set(bounds)) != len(bounds):
        _fail("I6", f"block {b} carries a boundary twice: {bounds}")
    for bd in bounds:
        if not (j * B < bd <= (j + 1) * B and bd % geo.hash_unit == 0):
            _fail("I6", f"block {b} at page {j} of group {gid} carries boundary {bd}")


def _check_index(
    geo: Geometry,
    pool: BlockPool,
    holders: dict[int, set[int]],
    table_holders: Counter[tuple[int, int]],
) -> None:
    u = geo.hash_unit
    seen = 0
    for b in range(1, pool.num_blocks):
        keys = pool.key_list(b)
        if not keys:
            continue
        gid = pool.group[b]
        if gid < 0:
            _fail("I5", f"keyed block {b} has no group")
        g = geo.groups[gid]
        limit = g.page_size // u if g.is_attention else 1
        if len(keys) > limit:
            _fail("I5", f"block {b} carries {len(keys)} keys > {limit}")
        if holders.get(b, {gid}) != {gid}:
            _fail("I5", f"block {b} keyed in group {gid} is held by groups {holders[b]}")
        for bd, key in keys:
            seen += 1
            if pool.index[gid].get(key) != b:
                _fail(
                    "I4", f"block {b} carries a key of group {gid} at {bd} the index maps elsewhere"
                )
    total = sum(len(idx) for idx in pool.index)
    if total != seen:
        _fail("I4", f"the index holds {total} keys but blocks carry {seen}")
    for (gid, b), count in table_holders.items():
        page = geo.groups[gid].page_size
        if count >= 2 and geo.groups[gid].is_attention:
            page_ends = [bd for bd, _ in pool.key_list(b) if bd % page == 0]
            if not page_ends:
                _fail("I9", f"block {b} is shared by {count} tables without its full key")


def _check_requests(geo: Geometry, pool: BlockPool, requests: Collection[RequestState]) -> None:
    u = geo.hash_unit
    for st in requests:
        if st.phase is not Phase.RUNNING:
            if st.tables or st.recurrent:
                _fail("I3", f"waiting request {st.request_id} holds blocks")
            continue
        limit = min(st.committed, st.chain.num_units * u)
        for gid, row in st.tables.items():
            # I10/I13: the keys on the pages this admission computed or copied are this
            # request's own boundaries in (⌊h/B⌋·B, min(T, n·u)], each on its page's block.
            g = geo.groups[gid]
            B = g.page_size
            lo = st.hit // B * B
            for j in range(st.hit // B, len(row)):
                if row[j] == NULL:
                    continue
                for bd, key in pool.key_list(row[j]):
                    if not lo < bd <= limit:
                        _fail(
                            "I13",
                            f"{st.request_id} group {gid} page {j} carries boundary "
                            f"{bd} outside ({lo}, {limit}]",
                        )
                    if st.chain.hashes[bd // u] != key:
                        _fail(
                            "I10",
                            f"{st.request_id} group {gid} page {j} carries a key at "
                            f"{bd} that is not the request's own",
                        )
        for states in st.published_states.values():
            for c in states:
                if c > limit:
                    _fail("I13", f"{st.request_id} published a state at {c} above {limit}")
        lo, hi = rolling_range(geo, st.chain.num_units, st.committed)
        for gid, slots in st.recurrent.items():
            if len(slots.held) > geo.kappa + 1:
                _fail("I11", f"{st.request_id} holds {len(slots.held)} states in group {gid}")
            for c in slots.held:
                if not lo <= c <= hi:
                    _fail("I11", f"{st.request_id} holds a state at {c} outside [{lo}, {hi}]")
        u = geo.hash_unit
        for gid, planned in st.planned.items():
            for c in planned:
                if c <= 0 or c % u:  # is_quiet_decode relies on it
                    _fail("I14", f"{st.request_id} plans a state of group {gid} at {c}")
        # (not a rule of the cache: the scheduler's shortcut to the first save position)
        wanted = save_positions(geo, st, st.planned, st.scheduled)
        first = next_save_position(geo, st, st.planned, st.scheduled)
        if first != (wanted[0] if wanted else None):
            _fail("I14", f"{st.request_id}: next save position {first}, but it wants {wanted}")
