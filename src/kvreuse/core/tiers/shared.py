"""A tier several managers share: one store below every replica of a fleet.

    replica 0: pool ─► host 0 ─┐
    replica 1: pool ─► host 1 ─┼─► shared store (one index, one LRU, one slot numbering)
    replica 2: pool ─► host 2 ─┘

Each manager lists the same `SharedTier` object among its tiers (the facade's
`tiers=[TierSpec("host", …), store]`). Its slots, index and LRU order are one piece of state:
a block one replica demotes is a hit another replica's lookup sees, and loads from its slot; a
slot one replica's eviction drops is gone for all. Each manager's ops still name the slot
(`Demote`, `Move`, `Load` with the manager's own tier number for it), and its engine carries
them out on the one byte store behind the tier.

Rules that keep it exact:

* Managers sharing a tier take their steps one at a time: a step's decisions and its engine's
  tier ops complete before another manager decides (a slot pinned for a load is pinned only
  while the load is decided, and a slot number is reused only after its bytes were read).
  The core holds the rule where it can see it: from a manager's first op on the tier until
  its `seal_step()` hands the ops out, another manager's lookup, allocation or eviction
  raises `SharedTierBusyError` (a demote decided there names a slot whose bytes are not yet
  written); and every change to the tier makes the lookups of every sharing manager made
  before it stale (`StaleLookupError` at allocate), since a slot they would load may be gone.
  `kvreuse.LLM` runs a step's ops inside `step()`, so LLMs stepped in turn on one thread
  keep the rule; the fleet simulation steps replicas in simulated order and keeps it too.
* Only managers of one cache layout may share a tier: the same groups, page sizes, DCP size,
  hash unit, hash function and seed, speculative mode (`layout_of`). Another layout is refused
  when the manager is built. Bytes are namespaced by `namespace` (a digest of the layout) and
  by the model, which the engine adds.
* The tier's index changes are its own KV events (`take_events()`: `TierStored`,
  `TierRemoved` with the tier's medium), recorded in the order they happen whichever replica
  caused them: a router that mirrors the store reads them from the store, not from each
  replica, whose streams reach it in another order.
* A manager's `reset()` leaves a shared tier alone: its bytes belong to the namespace, not to
  that replica's weights.

Managers in other processes share a tier by each holding a copy of it and passing its changes
on: with `record()` the tier writes every change to its slots (a placement, a removal, an
extension, a touch of its LRU order) to a journal, in order, and `replay()` makes those
changes on another copy, which then equals it slot for slot. Between turns a copy refuses any
change (`close_turn()`), so a change made outside a turn is a loud error, never a copy that
silently differs. Who holds the turn and where the journal lives is the engine's
(kvreuse.engine.store).
"""

from __future__ import annotations

import hashlib
from dataclasses import astuple, dataclass
from typing import Any, cast

from kvreuse.core.config import CacheConfig
from kvreuse.core.errors import ConfigError, InvariantError, SharedTierBusyError
from kvreuse.core.events import Event, EventLog
from kvreuse.core.tiers.ops import Keys
from kvreuse.core.tiers.spec import TierSpec
from kvreuse.core.tiers.tier import Slot, Tier

Change = tuple[object, ...]  # ("place", slot, group id, keys) | ("take", slot) | …


@dataclass(frozen=True)
class TierState:
    """A shared tier's copy as a value (`SharedTier.export_state`): per slot in LRU order,
    (slot, group id, [(boundary, key, indexed here)]), and the free slot numbers."""

    slots: list[tuple[int, int, list[tuple[int, bytes, bool]]]]
    free: list[int]


def layout_of(config: CacheConfig) -> tuple[object, ...]:
    """What must agree for two caches to read each other's blocks: what a key names and what
    a block holds (not the pool's size, the policies or the event options)."""
    return (
        tuple(astuple(g) for g in config.groups),
        config.dcp_size,
        config.hash_unit,
        config.hash_algo,
        config.hash_seed,
        config.spec_mode,
        config.lookahead_tokens,
    )


class SharedTier(Tier):
    """A tier (`spec`) for managers of `config`'s cache layout to share (module docstring)."""

    shared = True

    def __init__(
        self,
        spec: TierSpec,
        config: CacheConfig,
        *,
        enable_events: bool = False,
        max_pending_events: int | None = 65536,
    ) -> None:
        if not isinstance(spec, TierSpec):
            raise TypeError(f"SharedTier needs a TierSpec, got {type(spec).__name__}")
        if not isinstance(config, CacheConfig):
            raise TypeError(f"SharedTier needs a CacheConfig, got {type(config).__name__}")
        super().__init__(spec, len(config.groups))
        self.config = config
        self.layout = layout_of(config)
        self.namespace = hashlib.sha256(repr(self.layout).encode()).hexdigest()[:16]
        self.events = EventLog(enable_events, max_pending_events)
        self.log = self.events  # where every stack sharing the tier records its changes

    def check_layout(self, config: CacheConfig) -> None:
        """ConfigError unless a manager of `config` may share this tier."""
        if layout_of(config) != self.layout:
            raise ConfigError(
                f"shared tier {self.spec.name!r} holds blocks of another cache layout (groups, "
                "page sizes, DCP size, hash unit, hash function and seed, speculative mode "
                "must all agree); give this manager its own tier"
            )

    def take_events(self) -> list[Event]:
        """The tier's index changes since the last call, in the order they happened."""
        return self.events.take(self.config.geometry)

    # ------------------------------------------------------------------ copies elsewhere
    journal: list[Change] | None = None  # with `record()`: the changes since `take_journal`
    closed = False  # between two turns of a copy shared through a journal: no change

    def record(self) -> None:
        """From now on, every change to the slots goes to the journal."""
        self.journal = []

    def take_journal(self) -> list[Change]:
        out, self.journal = self.journal or [], [] if self.journal is not None else None
        return out

    def open_turn(self) -> None:
        self.closed = False

    def close_turn(self) -> None:
        self.closed = True

    def _change(self, change: Change) -> None:
        if self.closed:
            raise SharedTierBusyError(
                f"shared tier {self.spec.name!r} changed outside this replica's turn: its "
                "copies in other processes would no longer agree"
            )
        if self.journal is not None:
            self.journal.append(change)

    def touch(self, slot: int) -> None:
        self._change(("touch", slot))
        super().touch(slot)

    def take(self, slot: int) -> tuple[Slot, Keys]:
        self._change(("take", slot))
        return super().take(slot)

    def place(self, entry: Slot) -> tuple[int, Keys]:
        self._change(("place", self._free[-1] if self._free else -1, entry.group_id, entry.keys))
        return super().place(entry)

    def extend(self, slot: int, keys: Keys) -> Keys:
        self._change(("extend", slot, list(keys)))
        return super().extend(slot, keys)

    def clear(self) -> None:
        self._change(("clear",))
        super().clear()

    def export_state(self) -> TierState:
        """The copy as a value: its slots in LRU order (oldest first), each with its group, its
        keys and which of them it indexes, and its free slot numbers in the order `place`
        takes them (last first). `import_state` of it gives an equal copy, slot for slot."""
        rows = []
        for slot in self.order:
            entry = self.slots[slot]
            idx = self.index[entry.group_id]
            rows.append((slot, entry.group_id, [(b, k, idx.get(k) == slot) for b, k in entry.keys]))
        return TierState(rows, list(self._free))

    def import_state(self, state: TierState) -> None:
        """Make this copy the one `state` describes (another copy's `export_state`); a state
        that does not fit the tier (a slot out of range, a group unknown, a key indexed
        twice) is an InvariantError and leaves the copy detached (empty)."""
        self.detach()
        try:
            for slot, gid, keys in state.slots:
                if not 0 <= slot < self.spec.num_blocks or slot in self.slots:
                    raise InvariantError(f"slot {slot}")
                self.slots[slot] = Slot(gid, [(b, k) for b, k, _ in keys])
                self.order[slot] = None
                for _, key, indexed in keys:
                    if indexed:
                        if key in self.index[gid]:
                            raise InvariantError(f"key indexed twice in group {gid}")
                        self.index[gid][key] = slot
            free = list(state.free)
            if sorted(free + list(self.slots)) != list(range(self.spec.num_blocks)):
                raise InvariantError("free slots and held slots do not partition the tier")
            self._free = free
        except (InvariantError, IndexError, TypeError, ValueError) as exc:
            self.detach()
            raise InvariantError(
                f"shared tier {self.spec.name!r}: state does not fit ({exc})"
            ) from None
        self.version += 1

    def detach(self) -> None:
        """Forget every slot and take no new one until `import_state` (or a replay after it):
        a copy that can no longer follow the others' changes offers no hit and admits
        nothing, so the manager works as if the tier were not there. Not a change of the
        shared state: nothing is journaled."""
        Tier.clear(self)
        self._free = []

    @property
    def detached(self) -> bool:
        return not self.slots and not self._free

    def replay(self, changes: list[Change]) -> None:
        """Make another copy's changes here, in their order (they bump `version`, so a lookup
        made before them is stale). InvariantError if this copy has drifted from that one."""
        for change in changes:
            op, args = change[0], cast(tuple[Any, ...], change[1:])
            if op == "touch":
                Tier.touch(self, args[0])
            elif op == "take":
                Tier.take(self, args[0])
            elif op == "place":
                slot, gid, keys = args
                if Tier.place(self, Slot(gid, list(keys)))[0] != slot:
                    raise InvariantError(f"shared tier {self.spec.name!r}: replay drifted")
            elif op == "extend":
                Tier.extend(self, args[0], list(args[1]))
            elif op == "clear":
                Tier.clear(self)
            else:
                raise InvariantError(f"shared tier {self.spec.name!r}: unknown change {op!r}")
        if changes:
            self.version += 1  # (each change bumped it already; touches did not)
