"""Keeping the front's mirrors current without holding its routing lock across I/O.

Freshness: a replica hands a step's events to its publisher before the step's tokens reach the
client (kvreuse.serve.loop). Before routing, the front applies what has arrived and, for every
replica that finished a request since its last check began, asks its replay socket for anything
newer (`Subscriber.catch_up`; a check another thread began after that is waited for instead),
so the mirror includes the finished requests' entries. A store the replicas share is read from
its journal first (kvreuse.fleet.serving.store): a replica pushes a step's changes to it before
the step's tokens reach the client.

Locks: the routing lock (the dispatcher's) is never held across a wait on the network. A replay
is asked outside it and its answer applied under it (`ReplicaStream.check`), one check per
replica at a time (`Member.checking`, taken before the routing lock, and never while holding it
but for a try that does not wait), so a status read, another decision and the health loop never
wait for a replica. The store's journal is read outside the routing lock, by one thread at a
time (`StoreFollower.fetch()`), and what was read is applied under it (`apply_fetched`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvreuse.fleet.serving.members import Member
from kvreuse.fleet.serving.store import StoreFollower

CATCH_UP_BACKOFF_S = 5.0  # after a replay socket did not answer, skip catch-ups for this long


class Freshness:
    """What a decision must have applied, read outside the routing lock `lock` and applied
    under it."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self.follower: StoreFollower | None = None
        self._store_io = threading.Lock()  # one reader of the store's journal at a time

    def prepare(self, members: Sequence[Member]) -> None:
        """The I/O a decision needs, before it takes the routing lock: the shared store's
        journal, and the replay of every live replica that finished a request since the last
        check began, or whose stream is suspect. A check under way is waited for then (it may
        have begun before that answer, and no decision is made on a mirror being rebuilt);
        any other is left alone."""
        self.sync_store()
        for member in list(members):
            if member.up:
                stream = member.subscriber.stream(member.name)
                need = member.finished
                if member.caught_up < need or stream.suspect:
                    self.follow(member, need=need, wait=True)

    def drain(self, members: Sequence[Member]) -> None:
        """Under the routing lock: the batches that arrived since `prepare`, of every live
        replica not being checked right now (its check applies them after its answer)."""
        for member in members:
            if member.up and member.checking.acquire(blocking=False):
                try:
                    member.subscriber.poll(0, check=False)
                finally:
                    member.checking.release()

    def follow(self, member: Member, *, need: int | None = None, wait: bool = False) -> None:
        """Apply the replica's batches that have arrived; then ask its replay for anything
        newer, unless a replay that did not answer is paused, and unless `need` (a count of
        finished requests) is given and a check that began once they had finished already
        completed, and the stream is not suspect. Only the asking runs outside the routing
        lock; `member.checking` keeps one check per replica at a time, and its live batches
        out meanwhile, so an answer is read against the position it was asked from. `wait`:
        wait for a check under way; else leave it to that one."""
        if not member.checking.acquire(blocking=wait):
            return
        try:
            with self.lock:
                member.subscriber.poll(0, check=False)
                stream = member.subscriber.stream(member.name)
                now = time.monotonic()
                asked = need is None or member.caught_up < need
                due = asked and now >= member.catch_up_paused_until
                due = due or (stream.suspect and now >= stream.paused_until)
                if stream.replay is None or not due:
                    return
                began, errors = member.finished, len(stream.errors)
            member.subscriber.catch_up(member.name, hold=self.lock)
            if len(stream.errors) > errors:  # no answer: do not stall every decision on it
                member.catch_up_paused_until = time.monotonic() + CATCH_UP_BACKOFF_S
            else:  # only an answer covers the requests finished before it was asked
                member.caught_up = max(member.caught_up, began)
        finally:
            member.checking.release()

    def sync_store(self) -> None:
        """Read the shared store's journal (outside the routing lock, one reader at a time: two
        would read the same entries) and apply it under the lock."""
        follower = self.follower
        if follower is None:
            return
        with self._store_io:
            fetched = follower.fetch()
            with self.lock:
                follower.apply_fetched(fetched)
