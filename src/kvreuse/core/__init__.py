"""`kvreuse.core`: the pure-Python prefix-cache manager (no I/O, no torch, no asyncio).

Layers, bottom up: `hashing` (the chain) → `pool` + `policy` (blocks, index, free queue) →
`lookup` (per-kind acceptance, coordinator) → `allocate` / `commit` (plans and publication) →
`manager` (the facade of spec §3).
"""

from kvreuse.core.allocate import replay_point
from kvreuse.core.config import CacheConfig, Geometry, GroupGeometry, GroupSpec
from kvreuse.core.errors import ConfigError, InvariantError, StaleLookupError, UnknownRequestError
from kvreuse.core.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, StoredEntry
from kvreuse.core.lookup import LookupResult
from kvreuse.core.manager import KVCacheManager
from kvreuse.core.metrics import RequestStats
from kvreuse.core.plan import Copy, RecurrentSlot, RequestPlan, Save, StepPlan
from kvreuse.core.policy import EvictionPolicy, LRUPolicy, PoolView
from kvreuse.core.request import MultiModalItem, Request

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "ConfigError",
    "Copy",
    "Event",
    "EvictionPolicy",
    "Geometry",
    "GroupGeometry",
    "GroupSpec",
    "InvariantError",
    "KVCacheManager",
    "LRUPolicy",
    "LookupResult",
    "MultiModalItem",
    "PoolView",
    "RecurrentSlot",
    "Request",
    "RequestPlan",
    "RequestStats",
    "Save",
    "StaleLookupError",
    "StepPlan",
    "StoredEntry",
    "UnknownRequestError",
    "replay_point",
]
