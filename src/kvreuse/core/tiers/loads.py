"""The loads that turn a hit from the tiers into device blocks, held until their step commits.

`load_hit` does the loading inside `allocate`: it pins the hit's tier slots (a demotion the
loads cause must not evict them), pops one fresh device block per slot and records a `Load`
for each, then hands `admit` the same result with real block ids: from then on the admission is
the one it would be had the blocks never left the device. The loaded blocks get their keys when
the step commits (`TierLoads.publish`); until then another request that needs the same prefix
loads its own copy from the tier, which still holds it. Loads the engine could not carry out
are misses (`forget_faults`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from kvreuse.core.kinds import Stage
from kvreuse.core.ledger import PlanRecord, StepLedger
from kvreuse.core.lookup import LookupResult
from kvreuse.core.metrics import CacheStats
from kvreuse.core.pool import BlockPool
from kvreuse.core.request import Deferral, RequestState
from kvreuse.core.tiers.ops import Keys
from kvreuse.core.tiers.stack import TierStack
from kvreuse.core.tiers.view import tier_hit_tokens, virtual_id

NO_TIER_TOKENS: tuple[int, ...] = ()  # an admission that loaded nothing

Loaded = list[tuple[int, int, list[tuple[int, bytes]]]]  # (group id, block id, keys)


def page_keys_below(
    own: list[tuple[int, bytes]], chain: Sequence[bytes], unit: int, page: int
) -> list[tuple[int, bytes]]:
    """The request's keys of an attention page below the lowest of `own` (the keys a loaded
    slot carried), from the page's start:

        page j:  |--u--|--u--|--u--|--u--|      own: the keys at 3u and 4u (the slot's block
                 jP   +u    +2u   +3u   +4u     was a copy whose lower keys another block held)
                        ^^^^^^^^^^              returned: the keys at jP+u and jP+2u

    A block keyed at b holds the bytes of every token of its page before b, so each lower
    boundary of the page names a prefix of the same bytes. Published with the rest (a key
    another block holds is skipped), they give the page's first new key a parent the replica
    holds, so the event's reader can place it; without them a slot that outlived the block
    that held its page's lower keys would publish a key whose parent is held nowhere."""
    low = own[0][0]
    start = (low - 1) // page * page
    return [(b, chain[b // unit]) for b in range(start + unit, low, unit)]


def load_hit(pool: BlockPool, tiers: TierStack, res: LookupResult) -> tuple[LookupResult, Loaded]:
    """Pop a fresh device block for every tier block of `res` and record its `Load` (the
    module docstring); the caller has adopted the hit's device blocks and checked that the
    pops fit. Returns `res` with real block ids, and the keys each loaded block is to carry:
    they are published when the step commits, so a step that is discarded (its loads perhaps
    never run) leaves no key on bytes that may not be there."""
    sources = res.loads  # the lookup's load plan (`tier_sources`), not found again
    tiers.pin((t, slot) for _, t, slot in sources)
    real: dict[int, int] = {}
    loaded: Loaded = []
    try:
        for gid, t, slot in sources:
            blk = pool.pop(gid)
            loaded.append((gid, blk, tiers.load(t, slot, blk)))
            real[virtual_id(t, slot)] = blk
    finally:
        tiers.unpin()

    def swap(b: int | None) -> int | None:
        return real[b] if b is not None and b < 0 else b

    res = replace(
        res,
        slots={gid: [real[b] if b < 0 else b for b in row] for gid, row in res.slots.items()},
        copy_src={gid: swap(b) for gid, b in res.copy_src.items()},
        state_src={gid: swap(b) for gid, b in res.state_src.items()},
        loads=(),
    )
    return res, loaded


class TierLoads:
    """The loads of plans not yet committed, each kept with its plan record until its step
    commits (the blocks get their keys), is discarded or the record is dropped (the blocks
    go back unkeyed, as fresh blocks do)."""

    def __init__(self, pool: BlockPool, tiers: TierStack) -> None:
        self.pool, self.tiers = pool, tiers
        self._of: dict[int, tuple[PlanRecord, Loaded]] = {}  # id(record): record, its loads
        self._pending: Loaded = []
        full = [g for g in pool.geo.groups if g.stage is Stage.FULL and g.cacheable]
        # per group, its page size where a block's lower boundaries are prefixes of its bytes
        # (attention pages), else 0 (a state is valid at its own boundary only)
        self._pages = [g.page_size if g.is_attention else 0 for g in pool.geo.groups]
        self._full = (full[0].group_id, full[0].page_size) if full else None

    def __bool__(self) -> bool:
        return bool(self._of)

    def begin(self, res: LookupResult, first: bool) -> tuple[LookupResult, tuple[int, ...]]:
        """`load_hit`, its loads kept for the record `note` gets next; returns the result with
        real block ids and, on a request's first admission (`first`, what the hit counters
        count), the hit tokens each tier gave (the tokens of the hit on the pages it loaded of
        the first full-attention group), which are added to the stack's counts too."""
        got = NO_TIER_TOKENS
        if first and self._full is not None:
            got = tuple(tier_hit_tokens(res, *self._full, len(self.tiers.tiers)))
            self.tiers.count_hit_tokens(got)
        res, self._pending = load_hit(self.pool, self.tiers, res)
        return res, got

    def note(self, rec: PlanRecord) -> None:
        self._of[id(rec)] = (rec, self._pending)
        self._pending = []

    def publish(self, recs: list[PlanRecord]) -> None:
        """A commit of a step with loads: before each record's own commit (which releases a
        loaded copy source), its loaded blocks get the keys of the bytes they now hold."""
        for rec in recs:
            item = self._of.pop(id(rec), None)
            if item is None or rec.withdrawn:
                continue
            chain, u = rec.req.chain.hashes, self.pool.geo.hash_unit
            for gid, blk, keys in item[1]:
                # only the request's own keys: a slot of a page copied from may also carry
                # keys of the prefix it diverged from, whose events this request cannot name
                own = [(b, k) for b, k in keys if b // u < len(chain) and chain[b // u] == k]
                if own and self._pages[gid]:
                    own = page_keys_below(own, chain, u, self._pages[gid]) + own
                if own:
                    bounds, hashes = [b for b, _ in own], [k for _, k in own]
                    self.pool.publish(gid, bounds, hashes, [blk] * len(own), rec.req)

    def drop(self, recs: list[PlanRecord]) -> None:
        for rec in recs:
            self._of.pop(id(rec), None)

    def owners(self, block_ids: set[int]) -> list[PlanRecord]:
        """The records whose loads fill any of `block_ids`."""
        return [
            rec for rec, loaded in self._of.values() if any(b in block_ids for _, b, _ in loaded)
        ]


def forget_faults(
    stack: TierStack,
    loads: TierLoads,
    ledger: StepLedger,
    stats: CacheStats,
    slots: Iterable[tuple[int, int, int, Keys]],
    block_ids: Iterable[int],
) -> list[str]:
    """What the engine could not carry out of the ops it was handed, as misses (the facade's
    `tier_faults`): each of `slots` (tier, slot, group id, the keys of the op) is forgotten
    while it still holds those keys; the requests whose loads fill any of `block_ids` publish
    nothing at their step's commit and go back to wait, their admission uncounted. Returns
    those requests' ids."""
    for t, slot, gid, keys in slots:
        stack.drop(t, slot, gid, keys)
    blocks = set(block_ids)
    recs = loads.owners(blocks) if blocks else []
    failed: dict[str, RequestState] = {r.req.request_id: r.req for r in recs}
    for st in failed.values():
        loads.drop(ledger.records_of(st))
        stats.uncount_admission(st, stack)
        if st.deferred is None:
            ledger.defer(st, Deferral.PREEMPT)
    return list(failed)
