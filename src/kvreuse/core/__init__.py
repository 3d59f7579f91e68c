"""`kvreuse.core`: the pure-Python prefix-cache manager (no I/O, no torch, no asyncio).

Layers, bottom up: `hashing` (the chain) → `pool` + `policy` (blocks, index, free queue) →
`lookup` (per-kind acceptance, coordinator) → `allocate` / `commit` (plans and publication) →
`manager` (the facade of spec §3).
"""

from kvreuse.core.commit import Outcome
from kvreuse.core.config import CacheConfig, Geometry, GroupGeometry, GroupSpec
from kvreuse.core.errors import ConfigError, InvariantError, StaleLookupError, UnknownRequestError
from kvreuse.core.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, StoredEntry
from kvreuse.core.ledger import StepFate
from kvreuse.core.lookup import IndexView, LookupResult, Reason, compute_lookup
from kvreuse.core.manager import KVCacheManager
from kvreuse.core.metrics import RequestStats
from kvreuse.core.plan import Copy, RecurrentSlot, RequestPlan, Save, StepPlan
from kvreuse.core.policy import EvictionPolicy, LRUPolicy, PoolView
from kvreuse.core.request import Deferral, MultiModalItem, Request, SavePurpose
from kvreuse.core.savepoints import finish_point, replay_point

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "ConfigError",
    "Copy",
    "Deferral",
    "Event",
    "EvictionPolicy",
    "Geometry",
    "GroupGeometry",
    "GroupSpec",
    "IndexView",
    "InvariantError",
    "KVCacheManager",
    "LRUPolicy",
    "LookupResult",
    "MultiModalItem",
    "Outcome",
    "PoolView",
    "Reason",
    "RecurrentSlot",
    "Request",
    "RequestPlan",
    "RequestStats",
    "Save",
    "SavePurpose",
    "StaleLookupError",
    "StepFate",
    "StepPlan",
    "StoredEntry",
    "UnknownRequestError",
    "compute_lookup",
    "finish_point",
    "replay_point",
]
