"""`kvreuse.core`: the pure-Python prefix-cache manager (no I/O, no torch, no asyncio).

`__all__` is the API an engine builder needs: the manager, its configuration and geometry,
requests, lookups, plans and outcomes, statistics, events, errors, the tiers below the pool
and their ops, eviction policies, and the lookup over an index of one's own (a router's).
The plumbing the project's own layers and the core's extensions use beyond it is
`kvreuse.core.spi`; both lists are pinned by tests/core/test_layering.py.

Owners, bottom up; each piece of state has one, changed only through its methods:

    hashing      Hasher / Chain: H[k] per request, extended as tokens arrive
    pool         BlockPool: reference counts, keys, the index (hash → block), the free queue
                 (policy), the ghost record (ghost) and the event log (events)
    ledger       StepLedger: open and sealed steps, settled fates, in-flight plans, pending keys
    manager      KVCacheManager: the facade; registered requests, the epoch, the rules of use

Rules, as functions given the owners they use (never the facade):

    kinds        one module per group kind (full, sliding, chunked, recurrent) found through
                 one map: its geometry, acceptance (does group g accept a hit of x tokens?),
                 the blocks it holds, its name on the wire
    lookup       the coordinator over any IndexView (the pool, or a router's mirror)
    savepoints   where recurrent states are saved: ρ(P), φ(T), planned and rolling positions
    allocate     admission and growth: count, then adopt → pop → saves
    commit       publication, rolling states, window frees, release batches
    invariants   audit(): every reference and key recounted from scratch

Notation (the spec's, used in names and comments):

    u     hash unit: tokens per hash; H[k] names the prefix [0, k·u) and its extra keys
    n     units hashed so far
    ν     n·u (`nu` in code): the hashed length; nothing beyond it is ever proven
    B     page size of an attention group (block_size × dcp for sharded full attention)
    M     page size of a recurrent group: states are saved at multiples of u, kept per M
    S     common page: lcm of the cacheable page sizes
    F     full attention's covering limit: the largest x its entries prove
    T     committed tokens of a request; T′ what a commit reports
    top   the largest candidate hit: min(N − 1, ν) rounded down to u (the last token of a
          prompt is always computed)
    ρ(P)  replay point: the hit of an identical resend of a P-token prompt
    φ(T)  finish point: the state a finishing request publishes
    κ     extra rolling checkpoints kept (1 in drop mode or lookahead ≥ 2, else 0)
    L     lookahead tokens hashed into each unit (spec mode "lookahead")
"""

from kvreuse.core.commit import Outcome
from kvreuse.core.config import CacheConfig, Geometry, GroupGeometry, GroupSpec
from kvreuse.core.errors import (
    ConfigError,
    InvariantError,
    SharedTierBusyError,
    StaleLookupError,
    UnknownRequestError,
)
from kvreuse.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    StoredEntry,
    TierRemoved,
    TierStored,
)
from kvreuse.core.kinds import EntryKind
from kvreuse.core.lookup import IndexView, LookupResult, Reason, compute_lookup
from kvreuse.core.manager import KVCacheManager
from kvreuse.core.metrics import RequestStats
from kvreuse.core.plan import Copy, RecurrentSlot, RequestPlan, Save, StepPlan
from kvreuse.core.policy import EvictionPolicy, LRUPolicy
from kvreuse.core.request import MultiModalItem, Request
from kvreuse.core.tiers.ops import Demote, Load, Move, TierOp
from kvreuse.core.tiers.shared import SharedTier
from kvreuse.core.tiers.spec import Admission, TierSpec

__all__ = [
    "Admission",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "ConfigError",
    "Copy",
    "Demote",
    "EntryKind",
    "Event",
    "EvictionPolicy",
    "Geometry",
    "GroupGeometry",
    "GroupSpec",
    "IndexView",
    "InvariantError",
    "KVCacheManager",
    "LRUPolicy",
    "Load",
    "LookupResult",
    "Move",
    "MultiModalItem",
    "Outcome",
    "Reason",
    "RecurrentSlot",
    "Request",
    "RequestPlan",
    "RequestStats",
    "Save",
    "SharedTier",
    "SharedTierBusyError",
    "StaleLookupError",
    "StepPlan",
    "StoredEntry",
    "TierOp",
    "TierRemoved",
    "TierSpec",
    "TierStored",
    "UnknownRequestError",
    "compute_lookup",
]
