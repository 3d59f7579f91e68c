"""A store tier shared by servers in several processes: each holds a copy of the core's
`SharedTier`, and they take their steps in turn through one Redis server.

    kvreuse:<ns>:turn    the turn: "<fence>:<owner>", set only if absent, with a lease
    kvreuse:<ns>:fence   INCR'd at every turn taken: a fencing token no earlier turn holds
    kvreuse:<ns>:epoch   the shared view's incarnation, new whenever the view starts again
    kvreuse:<ns>:seq     the sequence number of the last change entry
    kvreuse:<ns>:log     a stream of change entries, id "<seq>-0": one per turn that changed
    kvreuse:<ns>:snap    the copy as of some entry (`SharedTier.export_state`), the log after it
    kvreuse:<ns>:<slot>  a slot's bytes (kvreuse.engine.tiers: identity-tagged frames)

A turn is one scheduler step. The server takes the turn, reads what changed since its copy's
entry and applies it, steps, then pushes its changes as one entry and gives the turn back in one
script that checks its fence, the epoch and the sequence first. Every write of the turn (the
entry and each slot's bytes) is fenced: a server paused past its lease finds its fence gone and
writes nothing, and its copy, no longer current, is rebuilt. A server whose copy cannot follow
(the epoch changed: the store was emptied or replaced; the sequence went back: restored from an
older dump; the entries after its own were trimmed; an entry does not decode or does not fit
its copy) rebuilds it from the snapshot and the entries after it; a snapshot that cannot serve
starts a new epoch, an empty view every server then takes up. The log stays bounded: a turn
whose entries since the snapshot outweigh it (or `LOG_FLOOR` bytes) writes a new snapshot and
trims the entries it covers, so the store's index never takes more than twice the snapshot
(whose size the tier's capacity bounds) plus one entry, and a server that joins reads the
snapshot, not the history.

The store failing is never the server's failure: any error of Redis (refused, timed out, out of
memory, a script error) or a turn not free within `wait_s` detaches the copy (it offers no hit
and takes no block: kvreuse.core.tiers.shared) and opens a breaker that keeps the server from
asking again for a while; steps run meanwhile as if there were no store. A slot whose bytes a
fault lost is a miss when read (the engine checks every value's identity), so no fault can make
a token wrong; a rebuilt copy is the store's view again.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvreuse.core import InvariantError, SharedTier
from kvreuse.core.spi import TierState
from kvreuse.serve.store_view import (
    StoreKeys,
    decode_state,
    encode,
    encode_state,
    entries_after,
    read_view,
)

log = logging.getLogger("kvreuse.store")

LOG_FLOOR = 64 * 1024  # bytes of entries the log may hold however small the snapshot

_ACQUIRE = """
if redis.call('exists', KEYS[1]) == 1 then return false end
local token = redis.call('incr', KEYS[2]) .. ':' .. ARGV[1]
redis.call('set', KEYS[1], token, 'PX', ARGV[2])
return token
"""
# KEYS: turn, epoch, seq, log, snap, logbytes; ARGV: token, epoch, base seq, entry ('' for none),
# snapshot ('' for none). Returns the new seq, or -1 (fenced out), -2 (another epoch), -3 (the
# sequence moved: not the view this turn read).
_PUSH = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('get', KEYS[2]) ~= ARGV[2] then return -2 end
local seq = tonumber(redis.call('get', KEYS[3]) or '-1')
if seq ~= tonumber(ARGV[3]) then return -3 end
if ARGV[4] ~= '' then
  seq = redis.call('incr', KEYS[3])
  redis.call('xadd', KEYS[4], seq .. '-0', 'e', ARGV[4])
  redis.call('incrby', KEYS[6], string.len(ARGV[4]))
end
if ARGV[5] ~= '' then
  redis.call('set', KEYS[5], ARGV[5])
  redis.call('xtrim', KEYS[4], 'MINID', (seq + 1) .. '-0')
  redis.call('set', KEYS[6], '0')
end
redis.call('del', KEYS[1])
return seq
"""
# KEYS: turn, epoch, seq, log, snap, logbytes; ARGV: token, new epoch, empty snapshot
_RESET = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return -1 end
redis.call('set', KEYS[2], ARGV[2])
redis.call('set', KEYS[3], '0')
redis.call('del', KEYS[4])
redis.call('set', KEYS[5], ARGV[3])
redis.call('set', KEYS[6], '0')
return 0
"""
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end"


_REFUSED = {
    -1: "the turn's fence was taken (its lease ran out)",
    -2: "the store's view started again",
    -3: "the log moved under the turn",
}


_REFUSED = {
    -1: "the turn's fence was taken (its lease ran out)",
    -2: "the store's view started again",
    -3: "the log moved under the turn",
}


class StoreTurnTimeout(RuntimeError):
    """Another server held the store's turn for longer than this one would wait."""


class ViewBroken(Exception):
    """The copy cannot follow the store's view from where it is: rebuild it."""


# ------------------------------------------------------------------------------ the turns
class Breaker:
    """Stops asking a failing store for a while: `cooldown_s`, doubling with each failure in a
    row up to `max_s`."""

    def __init__(self, cooldown_s: float = 1.0, max_s: float = 30.0) -> None:
        self.cooldown_s, self.max_s = cooldown_s, max_s
        self.open_until = 0.0
        self.num_trips = 0
        self._streak = 0

    def closed(self) -> bool:
        return time.monotonic() >= self.open_until

    def trip(self) -> None:
        self._streak += 1
        self.num_trips += 1
        wait = min(self.max_s, self.cooldown_s * 2 ** (self._streak - 1))
        self.open_until = time.monotonic() + wait

    def ok(self) -> None:
        self._streak = 0


class StoreTurns:
    """The turns of one server over a `SharedTier` copies of which other servers hold
    (module docstring); `turn()` wraps each step (`Scheduler.turn`). `fence` is the token a
    slot's write must present while a turn is held (`RedisBytes.fence`), else None."""

    def __init__(
        self,
        tier: SharedTier,
        client: Any,
        namespace: str,
        *,
        lease_s: float = 10.0,
        wait_s: float = 5.0,
        breaker: Breaker | None = None,
    ) -> None:
        self.tier, self.client = tier, client
        self.keys = StoreKeys(namespace)
        self.log_key = self.keys.log
        self.owner = uuid.uuid4().hex
        self.lease_ms, self.wait_s = int(lease_s * 1000), wait_s
        self.breaker = breaker or Breaker()
        self.epoch: str | None = None  # the view the copy follows; None: detached
        self.seq = -1  # the last entry in the copy
        self.fence: str | None = None
        # the view the last turn's step ran on, "<epoch>:<seq>" (None: the step ran detached):
        # what a request admitted in that step could hit, as a front that read the same names
        self.followed: str | None = None
        self.num_turns = self.num_replayed = self.num_rebuilds = self.num_resets = 0
        self.num_detached_turns = self.num_snapshots = 0
        self.last_error: str | None = None
        self._log_bytes = self._snap_bytes = 0  # as the turn's read found them
        self._scripts = {n: client.register_script(s) for n, s in
                         (("acquire", _ACQUIRE), ("push", _PUSH), ("reset", _RESET),
                          ("release", _RELEASE))}  # fmt: skip
        tier.record()
        tier.detach()
        tier.close_turn()

    @contextmanager
    def turn(self) -> Iterator[None]:
        held = self._begin()
        try:
            yield
        finally:
            self._end(held)

    # ------------------------------------------------------------------ begin and end
    def _begin(self) -> bool:
        self.followed = None
        if not self.breaker.closed():
            self._detach()
            self.num_detached_turns += 1
            return False
        try:
            self.fence = self._acquire()
            self._follow()
        except Exception as exc:  # the store's errors are its own; none may stop the server
            self._fault(exc)
            self.num_detached_turns += 1
            return False
        self.tier.open_turn()
        self.followed = f"{self.epoch}:{self.seq}"
        return True

    def _end(self, held: bool) -> None:
        self.tier.close_turn()
        changes = self.tier.take_journal()
        if not held:
            return
        token, self.fence = self.fence, None
        try:
            entry = encode(changes) if changes else ""
            snap = self._snapshot(len(entry)) if entry else ""
            args = [token, self.epoch, self.seq, entry, snap]
            seq = int(self._scripts["push"](keys=self.keys.view(), args=args))
            if seq < 0:
                raise ViewBroken(_REFUSED[seq])
            self.seq = seq
            self.num_turns += 1
            self.breaker.ok()
        except ViewBroken as why:  # its changes reached no one: the copy is not the view
            log.warning("shared store %s: %s; this server rebuilds its copy", self.keys.ns, why)
            self._detach()
        except Exception as exc:  # as in _begin
            self._fault(exc)

    def _acquire(self) -> str:
        deadline, pause = time.monotonic() + self.wait_s, 0.0005
        while True:
            token = self._scripts["acquire"](keys=[self.keys.turn, self.keys.fence],
                                             args=[self.owner, self.lease_ms])  # fmt: skip
            if token:
                return str(token.decode() if isinstance(token, bytes) else token)
            if time.monotonic() > deadline:
                raise StoreTurnTimeout(f"the shared store's turn ({self.keys.turn}) was not "
                                       f"free within {self.wait_s:g} s")  # fmt: skip
            time.sleep(pause)
            pause = min(2 * pause, 0.01)

    def _fault(self, exc: Exception) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self.breaker.closed():  # once per outage: later turns do not ask
            log.warning("shared store %s: %s; running without it for a while", self.keys.ns,
                        self.last_error)  # fmt: skip
        self.breaker.trip()
        if self.fence is not None:
            with contextlib.suppress(Exception):  # the lease ends it anyway
                self._scripts["release"](keys=[self.keys.turn], args=[self.fence])
            self.fence = None
        self._detach()

    def _detach(self) -> None:
        if not self.tier.detached:
            self.tier.detach()
        self.epoch, self.seq = None, -1

    # ------------------------------------------------------------------ following the view
    def _follow(self) -> None:
        """Bring the copy to the store's view (we hold the turn)."""
        view = read_view(self.client, self.keys, self.seq)
        epoch, seq, entries = view.epoch, view.seq, view.entries
        self._log_bytes, self._snap_bytes = view.log_bytes, view.snap_bytes
        if epoch is None:
            self._reset("the store holds no view (new, emptied or restarted)")
            return
        try:
            if epoch != self.epoch or seq < self.seq:
                raise ViewBroken("another view" if epoch != self.epoch else "the log went back")
            self._apply(entries, self.seq, seq)
        except ViewBroken:
            self._rebuild(epoch, seq)

    def _apply(self, entries: list[Any], after: int, upto: int) -> None:
        """Apply the entries after `after`, which must run without a gap to `upto`."""
        self.tier.open_turn()
        try:
            for changes in entries_after(entries, after, upto):
                self.tier.replay(changes)
                self.num_replayed += 1
        except (ValueError, InvariantError, KeyError, IndexError) as exc:
            raise ViewBroken(f"the log does not fit this copy: {exc}") from None
        finally:
            self.tier.close_turn()
            self.tier.take_journal()  # a replay records nothing of this server's
        self.seq = upto

    def _rebuild(self, epoch: str, seq: int) -> None:
        """The copy from the snapshot and the entries after it; a new view if they fail."""
        self.num_rebuilds += 1
        try:
            raw = self.client.get(self.keys.snap)
            if raw is None:
                raise ViewBroken("no snapshot")
            snap_epoch, snap_seq, state = decode_state(raw)
            if snap_epoch != epoch or snap_seq > seq:
                raise ViewBroken("the snapshot is of another view")
            self.tier.import_state(state)
            self.epoch = epoch
            entries = self.client.xrange(self.keys.log, min=f"{snap_seq + 1}-0", max="+")
            self._apply(entries, snap_seq, seq)
        except (ViewBroken, ValueError, InvariantError) as why:
            self._reset(f"the view cannot be rebuilt ({why})")

    def _reset(self, why: str) -> None:
        """Start a new, empty view (we hold the turn)."""
        log.warning("shared store %s: %s; starting a new view", self.keys.ns, why)
        self._detach()
        epoch = uuid.uuid4().hex
        self.tier.import_state(TierState([], list(range(self.tier.spec.num_blocks - 1, -1, -1))))
        args = [self.fence, epoch, self._state(epoch, 0)]
        if self._scripts["reset"](keys=self.keys.view(), args=args) != 0:
            raise ViewBroken("the turn's fence was taken")
        self.epoch, self.seq = epoch, 0
        self.num_resets += 1

    def _state(self, epoch: str, seq: int) -> str:
        return encode_state(epoch, seq, self.tier.export_state())

    def _snapshot(self, entry_bytes: int) -> str:
        """A new snapshot for the push when the log since the last one would outweigh it."""
        if self._log_bytes + entry_bytes <= max(self._snap_bytes, LOG_FLOOR):
            return ""
        self.num_snapshots += 1
        return self._state(str(self.epoch), self.seq + 1)
