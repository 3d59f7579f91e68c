"""`kvreuse.core`: the pure-Python prefix-cache manager (no I/O, no torch, no asyncio).

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
from kvreuse.core.encoding import TOKEN_TYPECODE
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
from kvreuse.core.hashing.chain import Chain
from kvreuse.core.hashing.hasher import Hasher
from kvreuse.core.kinds import (
    EntryKind,
    PagedGroup,
    PlainAsk,
    Probe,
    Stage,
    StateGroup,
    register_kind,
    unregister_kind,
)
from kvreuse.core.ledger import StepFate
from kvreuse.core.lookup import IndexView, LookupResult, Reason, compute_lookup
from kvreuse.core.manager import KVCacheManager
from kvreuse.core.metrics import RequestStats
from kvreuse.core.native import describe as describe_core_path
from kvreuse.core.plan import Copy, RecurrentSlot, RequestPlan, Save, StepPlan
from kvreuse.core.policy import EvictionPolicy, LRUPolicy, PoolView
from kvreuse.core.request import Deferral, MultiModalItem, Request, SavePurpose
from kvreuse.core.savepoints import finish_point, replay_point
from kvreuse.core.tiers.ops import Demote, Load, Move, TierOp
from kvreuse.core.tiers.shared import SharedTier, TierState
from kvreuse.core.tiers.spec import DEVICE_MEDIUM, Admission, TierSpec
from kvreuse.core.tiers.view import LayeredIndex, tier_hit_tokens, tier_sources

__all__ = [
    "DEVICE_MEDIUM",
    "TOKEN_TYPECODE",
    "Admission",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "Chain",
    "ConfigError",
    "Copy",
    "Deferral",
    "Demote",
    "EntryKind",
    "Event",
    "EvictionPolicy",
    "Geometry",
    "GroupGeometry",
    "GroupSpec",
    "Hasher",
    "IndexView",
    "InvariantError",
    "KVCacheManager",
    "LRUPolicy",
    "LayeredIndex",
    "Load",
    "LookupResult",
    "Move",
    "MultiModalItem",
    "Outcome",
    "PagedGroup",
    "PlainAsk",
    "PoolView",
    "Probe",
    "Reason",
    "RecurrentSlot",
    "Request",
    "RequestPlan",
    "RequestStats",
    "Save",
    "SavePurpose",
    "SharedTier",
    "SharedTierBusyError",
    "Stage",
    "StaleLookupError",
    "StateGroup",
    "StepFate",
    "StepPlan",
    "StoredEntry",
    "TierOp",
    "TierRemoved",
    "TierSpec",
    "TierState",
    "TierStored",
    "UnknownRequestError",
    "compute_lookup",
    "describe_core_path",
    "finish_point",
    "register_kind",
    "replay_point",
    "tier_hit_tokens",
    "tier_sources",
    "unregister_kind",
]
