"""`kvreuse.core.spi`: the core's plumbing for the layers above it and for its extensions.

`kvreuse.core` exports the API an engine builder needs (the manager, its configuration,
requests, results, events, errors, tiers); this module exports what the project's own layers
(sched, events, engine, sim, serve, fleet, qualify) and the core's extensions use beyond it:

    hashing     Hasher, Chain: hash a prompt once, outside a manager (`Request.prefix_hashes`)
    tokens      TOKEN_TYPECODE: the 4-byte array typecode of token ids
    kinds       Stage, PagedGroup, StateGroup, Probe, PlainAsk, register_kind,
                unregister_kind: a group kind of one's own (docs/architecture.md)
    policy      PoolView: what an eviction policy reads of the pool
    tiers       DEVICE_MEDIUM, TierState, LayeredIndex, tier_sources, tier_hit_tokens: a tier's
                medium, a shared tier's copy as a value, a mirror's lookup across tiers
    rules       finish_point, replay_point: where recurrent states are published
    state       Deferral, SavePurpose, StepFate: the manager's own vocabulary
    path        describe_core_path: which path (native or pure Python) the core runs

Outside kvreuse.core, code imports core names from `kvreuse.core` or from here, never from a
core submodule (tests/sim/test_packages.py). `kvreuse` re-exports only the API.
"""

from kvreuse.core.encoding import TOKEN_TYPECODE
from kvreuse.core.hashing.chain import Chain
from kvreuse.core.hashing.hasher import Hasher
from kvreuse.core.kinds import (
    PagedGroup,
    PlainAsk,
    Probe,
    Stage,
    StateGroup,
    register_kind,
    unregister_kind,
)
from kvreuse.core.ledger import StepFate
from kvreuse.core.native import describe as describe_core_path
from kvreuse.core.policy import PoolView
from kvreuse.core.request import Deferral, SavePurpose
from kvreuse.core.savepoints import finish_point, replay_point
from kvreuse.core.tiers.shared import TierState
from kvreuse.core.tiers.spec import DEVICE_MEDIUM
from kvreuse.core.tiers.view import LayeredIndex, tier_hit_tokens, tier_sources

__all__ = [
    "DEVICE_MEDIUM",
    "TOKEN_TYPECODE",
    "Chain",
    "Deferral",
    "Hasher",
    "LayeredIndex",
    "PagedGroup",
    "PlainAsk",
    "PoolView",
    "Probe",
    "SavePurpose",
    "Stage",
    "StateGroup",
    "StepFate",
    "TierState",
    "describe_core_path",
    "finish_point",
    "register_kind",
    "replay_point",
    "tier_hit_tokens",
    "tier_sources",
    "unregister_kind",
]
