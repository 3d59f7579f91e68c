"""Pending keys (spec §7.8): what uncommitted plans would publish, for `pending_hit`.

A lookup asks whether another request's plan, not yet committed, is computing more of its
prefix. The union of every live plan's keys is kept between lookups: in one step the scheduler
allocates every running request, then looks up waiting ones, and each admission only adds a plan.

    allocate ─► plan appended ─► union += its keys          (epoch − plans unchanged)
    commit / discard / finish / preempt / evict ─► epoch moves ─► union rebuilt
    seal_step ─► step counter moves ─► union rebuilt
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from kvreuse.core.pool import NULL

if TYPE_CHECKING:
    from kvreuse.core.allocate import PlanRecord
    from kvreuse.core.config import Geometry
    from kvreuse.core.manager import KVCacheManager
    from kvreuse.core.request import RequestState


class PendingKeys:
    """The union of live plans' keys per group, valid while only allocations happened."""

    __slots__ = ("_at", "_keys", "_seen")

    def __init__(self) -> None:
        self._at: tuple[int, int] = (-1, -1)
        self._keys: list[set[bytes]] = []
        self._seen = 0  # plans (mgr._num_plans) the union includes

    def union(self, mgr: KVCacheManager) -> list[set[bytes]]:
        # Every manager change but a successful allocate moves the epoch, and allocate moves
        # it together with the plan count: `epoch - plans` changes exactly on other changes.
        at = (mgr.epoch - mgr._num_plans, mgr._next_step)
        if at == self._at:
            new = mgr._num_plans - self._seen  # appended to the open step since, in order
            recs = mgr._open[len(mgr._open) - new :] if new else []
        else:
            self._keys = [set() for _ in mgr.geo.groups]
            recs = list(itertools.chain(mgr._open, *mgr._sealed.values()))
        keys = self._keys
        for rec in recs:
            req = rec.req
            if rec.withdrawn or req.deferred is not None:
                continue
            # A record's keys change only when its request commits (T, processed, the chain
            # and window frees move together), so they are cached per (T, units).
            rec_at = (req.committed, req.chain.num_units)
            if rec.keys is None or rec.keys_at != rec_at:
                rec.keys, rec.keys_at = pending_keys(mgr.geo, req, rec), rec_at
            for gid, key in rec.keys:
                keys[gid].add(key)
        self._at, self._seen = at, mgr._num_plans
        return keys


def pending_keys(geo: Geometry, req: RequestState, rec: PlanRecord) -> list[tuple[int, bytes]]:
    """Keys the plan's commit would publish if it committed with T′ = end (for pending_hit)."""
    u = geo.hash_unit
    hashes = req.chain.hashes
    E = min(rec.end, req.chain.num_units * u)
    if not rec.saves and all(d + u > E for d in req.processed.values()):
        return []  # most decode plans: no boundary of theirs is left to publish
    keys: list[tuple[int, bytes]] = []
    for gid, row in req.tables.items():
        g = geo.groups[gid]
        if not g.cacheable:
            continue
        B = g.page_size
        for b in range(req.processed[gid] + u, E + 1, u):
            if row[(b - 1) // B] != NULL:
                keys.append((gid, hashes[b // u]))
    for g, c, _, _, planned in rec.saves:
        if planned and c <= E:
            keys.append((g, hashes[c // u]))
    return keys
