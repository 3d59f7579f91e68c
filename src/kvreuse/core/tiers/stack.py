"""The tiers below one device pool (`TierStack`): where evicted blocks go instead of being
dropped, and what a tier writes through.

    device pool ──evict──► tier 0 (host) ──evict──► tier 1 (store) ──evict──► dropped
         ▲                    │                        │
         └──────── load ──────┴────────────────────────┘   (a hit that needs a tier block)

A tier holds *slots*, each a copy of one device block's bytes together with every key that
block carried (a large page carries several sub-page keys; a state block one). Tiers are
inclusive of what they loaded: a slot stays after its block is loaded back, so the next
eviction of that block finds its bytes already there and copies nothing. Each tier keeps its
own LRU order over its slots and its own index per group (key → slot), in the same shape as the
pool's, so the lookup rules read a tier exactly as they read the pool (kvreuse.core.tiers.view).

The engine moves the bytes; this module only decides, recording each decision as a `TierOp` in
the order it was made. The manager hands them out with the next `StepPlan` (`tier_ops`), and
the engine runs them in that order before the step's copies and forward: every op was decided
while the bytes it reads were still where it says (a block is overwritten only by a forward,
which comes after), so the order alone keeps them exact.

What a tier admits is its `Admission`, per group kind: `ON_EVICTION` (the default: a keyed
block the pool evicts is copied down), `WRITE_THROUGH` (a block is copied here as soon as it
is published, and stays on the device: a store several replicas share then holds a prefix's
first pages too, which a pool evicts last) or `NEVER` (the kind's blocks are dropped, as
without tiers). A tier's own eviction moves a slot to the next tier that admits its kind, or
drops it.

A write-through copy is decided when a commit publishes the block, after the forward that
wrote it: its op goes with the next sealed step (before that step's forward, which is the
first that could overwrite the block), or to an engine that takes it at once
(the manager's `take_tier_ops`). A page published a unit at a time (a large DCP page) is
copied again into the same slot each time it gains keys: the slot's older keys name a prefix
of the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvreuse.core.errors import ConfigError, SharedTierBusyError
from kvreuse.core.tiers.ops import Demote, Keys, Load, Move, TierOp
from kvreuse.core.tiers.spec import TierSpec
from kvreuse.core.tiers.tier import Slot, Tier, TierEvents


class TierStack:
    """The tiers below one pool, in order, and the ops decided since they were last taken."""

    def __init__(
        self,
        specs: Sequence[TierSpec | Tier],
        kinds: Sequence[str],
        log: TierEvents | None = None,
    ) -> None:
        """`specs`: a TierSpec for a tier of this stack's own, or a `Tier` object another
        stack shares (kvreuse.core.tiers.shared), whose changes go to its own `log`."""
        tiers = [s if isinstance(s, Tier) else Tier(s, len(kinds)) for s in specs]
        names, media = [t.spec.name for t in tiers], [t.spec.medium for t in tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must differ (got {names})")
        if len(set(media)) != len(media):
            raise ConfigError(f"tier media must differ: events tell tiers apart (got {media})")
        self.kinds = list(kinds)  # per group id, its kind's name
        self.tiers = tiers
        # per tier, where its index changes go as KV events (TierStored, TierRemoved)
        self.logs: list[TierEvents | None] = [t.log if t.shared else log for t in tiers]
        self.ops: list[TierOp] = []
        self.shared = [t for t in tiers if t.shared]
        self.writes_through = any(t.spec.any_write_through() for t in tiers)
        self.num_demoted = 0  # blocks copied down from the pool (evicted or written through)
        self.num_dropped = 0  # keyed blocks no tier kept
        self.num_stored = [0] * len(specs)  # per tier: copies into it (demotes and moves)
        self.num_evicted = [0] * len(specs)  # per tier: slots it freed to make room
        self.num_loaded: list[list[int]] = [[0] * len(kinds) for _ in specs]  # [tier][gid]
        self.hit_tokens: list[int] = [0] * len(specs)  # first admissions' hit tokens, per tier
        self.num_faulty = [0] * len(specs)  # per tier: slots dropped as the engine found them bad

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def take_ops(self) -> list[TierOp]:
        """The ops decided since the last call; a shared tier they touched is free again."""
        ops, self.ops = self.ops, []
        for tier in self.shared:
            if tier.holder is self:
                tier.holder = None
        return ops

    def count_hit_tokens(self, got: Sequence[int]) -> None:
        """A first admission's hit loaded `got` tokens from each tier (`hit_tokens`)."""
        self.hit_tokens = [a + b for a, b in zip(self.hit_tokens, got, strict=True)]

    def uncount_hit_tokens(self, got: Sequence[int]) -> None:
        """That admission delivered nothing (its loads failed): take `got` back."""
        self.hit_tokens = [a - b for a, b in zip(self.hit_tokens, got, strict=True)]

    # ------------------------------------------------------------------ sharing
    def check_turn(self) -> None:
        """SharedTierBusyError while another stack's ops on a shared tier are not yet taken."""
        for tier in self.shared:
            if tier.holder is not None and tier.holder is not self:
                raise SharedTierBusyError(
                    f"shared tier {tier.spec.name!r} has another manager's tier ops not yet "
                    "taken by its seal_step() and run; managers sharing a tier take their "
                    "steps one at a time"
                )

    def check_publish_turn(self) -> None:
        """Before a call that may publish (commit, finish, preempt): with a tier that writes
        through, publishing changes the tier, so it is a turn of its own too."""
        if self.writes_through:
            self.check_turn()

    def shared_version(self) -> int:
        """Grows with every change to a shared tier, whichever stack made it (a lookup made
        before a change may name slots that are gone)."""
        return sum(tier.version for tier in self.shared)

    def _hold(self) -> None:
        """This stack is about to decide ops: no other may touch its shared tiers until
        `take_ops`."""
        self.check_turn()
        for tier in self.shared:
            tier.holder = self

    def find(self, group_id: int, key: bytes) -> tuple[int, int] | None:
        """(tier, slot) of the highest tier holding `key` in `group_id`, or None."""
        for t, tier in enumerate(self.tiers):
            slot = tier.find(group_id, key)
            if slot is not None:
                return t, slot
        return None

    # ------------------------------------------------------------------ eviction from the pool
    def demote(self, victims: Iterable[tuple[int, int, Keys]]) -> None:
        """The pool evicted these keyed blocks (block id, group id, keys): copy each down to
        the first tier that admits its kind, unless a tier already holds its bytes."""
        if self.shared:
            self._hold()
        for block_id, gid, keys in victims:
            kind, above = self.kinds[gid], len(self.tiers)
            held = self.find(gid, keys[-1][1])
            if held is not None:
                self.tiers[held[0]].touch(held[1])  # the same bytes are there already
                if not self.tiers[held[0]].spec.writes_through(kind):
                    continue
                above = held[0]  # a write-through copy: a faster tier may still take it
            for t in range(above):
                if self.tiers[t].spec.admits(kind) and self._make_room(t):
                    slot = self._place(t, Slot(gid, keys))
                    self.ops.append(Demote(t, slot, gid, block_id, tuple(keys)))
                    self.num_demoted += 1
                    self.num_stored[t] += 1
                    break
            else:
                self.num_dropped += held is None

    # ------------------------------------------------------------------ publication
    def write_through(self, published: Iterable[tuple[int, int, Keys]]) -> None:
        """A commit published these blocks (block id, group id, every key the block now
        carries): copy each into every tier that writes its kind through, unless the tier holds
        its highest key already. A slot holding a copy of the same page with fewer keys (a
        page that gained units) is copied over in place."""
        for block_id, gid, keys in published:
            kind = self.kinds[gid]
            for t, tier in enumerate(self.tiers):
                if not tier.spec.writes_through(kind):
                    continue
                if self.shared:
                    self._hold()
                top = tier.find(gid, keys[-1][1])
                if top is not None:
                    tier.touch(top)
                    continue
                older = tier.find(gid, keys[0][1])
                if older is not None and _prefix(tier.slots[older].keys, keys):
                    self._log_stored(t, gid, tier.extend(older, keys))
                    self.ops.append(Demote(t, older, gid, block_id, tuple(keys)))
                elif self._make_room(t):
                    slot = self._place(t, Slot(gid, keys))
                    self.ops.append(Demote(t, slot, gid, block_id, tuple(keys)))
                else:
                    continue
                self.num_demoted += 1
                self.num_stored[t] += 1

    def _make_room(self, t: int) -> bool:
        """Free one slot of tier `t`, moving its LRU slot down (or dropping it); False when
        every slot is pinned."""
        tier = self.tiers[t]
        if not tier.is_full():
            return True
        victim = tier.victim()
        if victim is None:
            return False
        entry = tier.slots[victim]
        kind = self.kinds[entry.group_id]
        for d in range(t + 1, len(self.tiers)):
            below = self.tiers[d]
            if below.find(entry.group_id, entry.keys[-1][1]) is not None:
                break  # already there: nothing to copy
            if below.spec.admits(kind) and self._make_room(d):
                dst = self._place(d, entry)
                self.ops.append(Move(t, victim, d, dst, tuple(entry.keys), entry.group_id))
                self.num_stored[d] += 1
                break
        else:
            self.num_dropped += 1
        self.num_evicted[t] += 1
        self._take(t, victim)
        return True

    def _place(self, t: int, entry: Slot) -> int:
        slot, new = self.tiers[t].place(Slot(entry.group_id, list(entry.keys)))
        self._log_stored(t, entry.group_id, new)
        return slot

    def _log_stored(self, t: int, gid: int, new: Keys) -> None:
        log = self.logs[t]
        if new and log is not None and log.enabled:
            log.tier_stored(t, self.tiers[t].spec.medium, gid, new)

    def _take(self, t: int, slot: int) -> None:
        entry, gone = self.tiers[t].take(slot)
        log = self.logs[t]
        if gone and log is not None and log.enabled:
            log.tier_removed(t, self.tiers[t].spec.medium, entry.group_id, gone)

    # ------------------------------------------------------------------ loads
    def pin(self, sources: Iterable[tuple[int, int]]) -> None:
        for t, slot in sources:
            self.tiers[t].pinned.add(slot)

    def unpin(self) -> None:
        for tier in self.tiers:
            tier.pinned.clear()

    def load(self, t: int, slot: int, block_id: int) -> Keys:
        """Record the copy of a (pinned) slot into a fresh device block; its keys, for the
        pool to publish on that block."""
        if self.shared:
            self._hold()
        tier = self.tiers[t]
        entry = tier.slots[slot]
        tier.touch(slot)
        self.ops.append(Load(t, slot, entry.group_id, block_id, tuple(entry.keys)))
        self.num_loaded[t][entry.group_id] += 1
        return list(entry.keys)

    def drop(self, t: int, slot: int, group_id: int, keys: Sequence[tuple[int, bytes]]) -> bool:
        """The engine found slot `slot` of tier `t` without the bytes of `keys` (missing, or
        not what the op that wrote them copied): forget it, so no lookup plans a load from it
        again. Only while the slot still holds that entry: one the same step placed there
        since holds other bytes. Returns whether it was dropped."""
        tier = self.tiers[t]
        entry = tier.slots.get(slot)
        if entry is None or entry.group_id != group_id or entry.keys != list(keys):
            return False
        if tier.shared:
            self._hold()
        self._take(t, slot)
        self.num_faulty[t] += 1
        return True

    def clear(self) -> None:
        """Forget every slot of every tier of this stack's own (bytes left behind are never
        read again); the pool's AllBlocksCleared event, which `reset()` records, says so to
        consumers. A shared tier stays: its bytes are its namespace's, not this replica's."""
        for tier in self.tiers:
            if not tier.shared:
                tier.clear()

    # ------------------------------------------------------------------ views
    def export_entries(self) -> list[tuple[int, int, int, bytes, int]]:
        """(tier, group id, boundary, key, slot) of every entry, for tests and tools."""
        return [
            (t, e.group_id, b, key, slot)
            for t, tier in enumerate(self.tiers)
            for slot, e in tier.slots.items()
            for b, key in e.keys
            if tier.index[e.group_id].get(key) == slot
        ]

    def audit(self) -> None:
        for t, tier in enumerate(self.tiers):
            tier.audit(f"tier {t} ({tier.spec.name})")


def _prefix(short: Keys, long: Keys) -> bool:
    """Whether `short`'s keys are the first of `long`'s (a copy of the page with fewer units)."""
    return len(short) < len(long) and long[: len(short)] == short
