"""A store tier shared by servers in several processes: each holds a copy of the core's
`SharedTier`, and they take their steps in turn through one Redis server.

    server A ─┐  turn: SET kvreuse:<ns>:turn NX  ──┐
    server B ─┼─ journal: RPUSH / LRANGE kvreuse:<ns>:journal   (the copies' changes, in order)
    server C ─┘  bytes: kvreuse:<ns>:<slot> (BytesTier, framed with a checksum)

A turn is one scheduler step: the server takes the lock, replays every change the others made
since its last turn (so its copy equals theirs, slot for slot, and its older lookups are
stale), steps (lookups, evictions into the store, loads from it, the forward, the commit and
its write-through copies, whose bytes it writes), pushes its own changes as one journal entry
and lets go. Outside its turn a copy refuses any change (kvreuse.core.shared_tier), so nothing
can make the copies differ silently. The lock is a lease (`lease_s`): a server that dies in
its turn frees it when the lease ends; a step must end within it. The journal grows with the
changes and is read from the start by a server that joins; it is not compacted.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvreuse.core import SharedTier

_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end"


class StoreTurnTimeout(RuntimeError):
    """Another server held the store's turn for longer than this one would wait."""


def encode(changes: list[tuple[Any, ...]]) -> str:
    out: list[list[Any]] = []
    for change in changes:
        op, *args = change
        if op == "place":
            slot, gid, keys = args
            out.append([op, slot, gid, [[b, k.hex()] for b, k in keys]])
        elif op == "extend":
            out.append([op, args[0], [[b, k.hex()] for b, k in args[1]]])
        else:
            out.append([op, *args])
    return json.dumps(out, separators=(",", ":"))


def decode(raw: bytes | str) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for op, *args in json.loads(raw):
        if op == "place":
            slot, gid, keys = args
            out.append((op, slot, gid, [(b, bytes.fromhex(k)) for b, k in keys]))
        elif op == "extend":
            out.append((op, args[0], [(b, bytes.fromhex(k)) for b, k in args[1]]))
        else:
            out.append((op, *args))
    return out


class StoreTurns:
    """The turns of one server over a `SharedTier` copies of which other servers hold
    (module docstring); `turn()` wraps each step (`Scheduler.turn`)."""

    def __init__(
        self,
        tier: SharedTier,
        client: Any,
        namespace: str,
        *,
        lease_s: float = 30.0,
        wait_s: float = 120.0,
    ) -> None:
        self.tier, self.client = tier, client
        self.lock_key = f"kvreuse:{namespace}:turn"
        self.log_key = f"kvreuse:{namespace}:journal"
        self.token = uuid.uuid4().hex
        self.lease_ms, self.wait_s = int(lease_s * 1000), wait_s
        self.cursor = 0  # journal entries already in this copy
        self.num_turns = self.num_replayed = 0
        self._release = client.register_script(_RELEASE)
        tier.record()
        tier.close_turn()

    @contextmanager
    def turn(self) -> Iterator[None]:
        self._acquire()
        try:
            entries = self.client.lrange(self.log_key, self.cursor, -1)
            for raw in entries:
                self.tier.replay(decode(raw))
            self.cursor += len(entries)
            self.num_replayed += len(entries)
            self.tier.open_turn()
            yield
        finally:
            self.tier.close_turn()
            changes = self.tier.take_journal()
            try:
                if changes:
                    self.cursor = int(self.client.rpush(self.log_key, encode(changes)))
                self.num_turns += 1
            finally:
                self._release(keys=[self.lock_key], args=[self.token])

    def _acquire(self) -> None:
        deadline, pause = time.monotonic() + self.wait_s, 0.0005
        while not self.client.set(self.lock_key, self.token, nx=True, px=self.lease_ms):
            if time.monotonic() > deadline:
                raise StoreTurnTimeout(
                    f"the shared store's turn ({self.lock_key}) was not free within "
                    f"{self.wait_s:g} s: another server holds it"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
