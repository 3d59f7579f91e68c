"""A shared tier: one pool of KV every replica writes to and reads from (a global cache such as
Mooncake's store, pooled from the nodes' memory).

The model, kept simple:

* The tier holds attention units (one hash unit of KV each), keyed by the chain hash that names
  the prefix up to the unit's end. It is an LRU over units with room for `capacity_tokens`.
* Every unit a replica publishes (a `BlockStored` of its attention group, as it commits) is
  written to the tier, or refreshed there if present.
* When a request is admitted on a replica, the tier offers the longest contiguous run of its
  units from the first one, capped at the request's `top`. If that reaches past what the replica
  reuses locally, the difference counts as tokens fetched from the tier (`tier_tokens`); the
  request's hit with the tier is `max(local, tier)`. The units read are refreshed.
* The replica's own cache and the simulated clock do not change: the replica computes the
  fetched tokens as it would have, so its local cache (and what it publishes) is the same with
  and without the tier, and the tier changes only the hit accounting. A real fetch would load
  those units instead of computing them, which the cost model does not credit.

Only for geometries whose one prefix-cacheable group is full attention: a hybrid's recurrent
states and windows would need their own pooled state, which this model does not have.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvreuse.core import Geometry, Stage


class SharedTier:
    def __init__(self, geometry: Geometry, capacity_tokens: int) -> None:
        groups = geometry.cacheable
        if len(groups) != 1 or groups[0].stage is not Stage.FULL:
            raise ValueError(
                "--shared-tier-capacity models a pool of attention KV: it needs a geometry whose "
                "only prefix-cacheable group is full attention"
            )
        if type(capacity_tokens) is not int or capacity_tokens < 1:
            raise ValueError(f"the shared tier needs a capacity ≥ 1 token, got {capacity_tokens!r}")
        self.group_id = groups[0].group_id
        self.unit = geometry.hash_unit
        self.capacity_tokens = capacity_tokens
        self.capacity_units = max(1, capacity_tokens // self.unit)
        self.units: OrderedDict[int, None] = OrderedDict()  # wire keys, least recent first
        self.num_written = 0
        self.num_evicted = 0

    def write(self, keys: Sequence[int]) -> None:
        """Units a replica published: written, or refreshed when present."""
        units = self.units
        for key in keys:
            if key in units:
                units.move_to_end(key)
            else:
                units[key] = None
                self.num_written += 1
        while len(units) > self.capacity_units:
            units.popitem(last=False)
            self.num_evicted += 1

    def match(self, keys: Sequence[int], top: int) -> int:
        """Tokens of the request's longest leading run of units in the tier, up to `top`; the
        units read are refreshed."""
        units = self.units
        limit = top // self.unit
        k = 0
        while k < limit and keys[k] in units:
            k += 1
        for key in keys[:k]:
            units.move_to_end(key)
        return k * self.unit
