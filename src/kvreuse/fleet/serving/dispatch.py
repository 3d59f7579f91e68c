"""The front's routing state: the fleet `Router`, one KV event subscriber per replica, and what
the front knows of each replica (up or down, requests and prompt tokens in flight).

Threads: the front's event loop never touches a socket or a mirror. `route` runs in a worker
thread: first the I/O a decision needs (the shared store's journal, the replay sockets of
replicas whose streams need a check: kvreuse.fleet.serving.freshness, which also says what a
decision is guaranteed to have seen), then, under the routing lock `_lock`, the in-memory part
(the batches that have arrived, the policy). `_lock` is never held across I/O, so `status`,
another decision and the health loop never wait for a replica or the store. The in-flight
counters and replica states have their own short lock, so finishing a request never waits for
a routing decision.

Trust: a decision records whether the replica's mirror was exact and which incarnation of the
replica's stream it followed (`Routed.exact`, `Routed.instance`). A kvreuse replica names its
incarnation in every response; `confirm` then says whether the prediction was made on the
stream of the very process that answered (a replica restarted between two health checks is
found by its first answer), and a replica that names another incarnation has its mirror rebuilt
at the next decision.

Load follows the router's rule (`kvreuse.fleet.routing.router`); the front sees an answer only
when it completes, so a replica's load is the prompt tokens of its requests in flight (routed,
not yet answered) and their number. A replica that is down is never chosen: if the policy picks
one, the request goes to the live replica the policy predicted most for, then the least loaded.

States (`Member.state`, kvreuse.fleet.serving.members): `up`, `down`, and for a replica
process that `kvreuse fleet` supervises `restarting` and `given-up`. A replica that is not up has
no exact mirror as far as anyone is told: what it holds is unknown until it is checked again.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvreuse.core import CacheConfig
from kvreuse.events import ReplicaMirror, StoreMirror, Subscriber
from kvreuse.events.wire import MEDIUM_GPU
from kvreuse.fleet import DEFAULT_LOAD_WEIGHT
from kvreuse.fleet.routing.router import Decision, Router
from kvreuse.fleet.serving.freshness import Freshness
from kvreuse.fleet.serving.members import DOWN, GIVEN_UP, RESTARTING, SUPERVISED, UP, Member
from kvreuse.fleet.serving.store import StoreFollower

__all__ = ["Dispatcher", "Member", "NoReplica", "Routed"]

DOWN_LOAD = 1 << 60  # the load a down replica shows the policy: no cost can prefer it


class NoReplica(RuntimeError):
    """Every replica is down."""


@dataclass(frozen=True)
class Routed:
    """Where a request goes: the member, and the policy's decision (None when the request could
    not be hashed: it then goes to the least loaded replica, which answers it); whether the
    member's mirror was exact when it was decided, and the stream incarnation it followed;
    with a shared store, the store's view the prediction read ("<epoch>:<seq>"; None when the
    front's view was not exact: `exact` is then false)."""

    member: Member
    decision: Decision | None
    num_tokens: int
    exact: bool = False
    instance: str | None = None
    by_medium: dict[str, int] | None = None  # the prediction by where the hit lies
    store_view: str | None = None

    @property
    def predicted(self) -> int | None:
        return None if self.decision is None else self.decision.predicted_cached


class Dispatcher:
    """Routes requests over the members with one policy."""

    def __init__(
        self,
        config: CacheConfig,
        policy: str = "exact",
        *,
        load_weight: float = DEFAULT_LOAD_WEIGHT,
        replay_timeout: float = 0.5,
        tiers: Sequence[str] = (),
        store: StoreMirror | None = None,
    ) -> None:
        """`tiers`: the media of every replica's tiers in order, when known before their
        events name them; `store`: the mirror of a store they share, among `tiers`, which
        `follow_store` keeps current."""
        self.config = config
        self.router = Router(config, policy, load_weight=load_weight)
        self.replay_timeout = replay_timeout
        self.tiers, self.store = tuple(tiers), store
        self.members: list[Member] = []
        self._lock = threading.Lock()  # the routing state; never held across I/O
        self._loads = threading.Lock()  # loads and states
        self.fresh = Freshness(self._lock)

    @property
    def follower(self) -> StoreFollower | None:
        return self.fresh.follower

    # ------------------------------------------------------------------ members
    def add(
        self,
        name: str,
        url: str,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        bind: bool | None = None,
        curve_public_key: str | None = None,
    ) -> Member:
        """Follow a replica's KV events at `endpoint` (a wildcard binds, a specific address
        connects; `bind` overrides) and route to it at `url` (filled in later when unknown).
        `curve_public_key`: its publisher's CURVE key; then nothing else reaches its sockets."""
        with self._lock:
            if any(m.name == name for m in self.members):
                raise ValueError(f"replica {name!r} is given twice")
            member = Member(len(self.members), name, url.rstrip("/"), endpoint, bind)
            member.curve_public_key = curve_public_key
            mirror = self._subscribe(member)
            self.router.add_replica(name, mirror)
            self.members.append(member)
        if replay_endpoint is not None:
            self.set_replay(member, replay_endpoint)
        return member

    def _subscribe(self, member: Member) -> ReplicaMirror:
        sub = Subscriber(replay_timeout=self.replay_timeout)
        mirror = sub.add_replica(
            member.name,
            self.router.geometry,
            member.endpoint,
            bind=member.bind,
            curve_public_key=member.curve_public_key,
            tiers=self.tiers,
            shared=() if self.store is None else (self.store,),
        )
        if member.bind is not False and member.endpoint.endswith(":0"):
            member.endpoint = sub.bound_endpoint(member.name)
        member.subscriber = sub
        return mirror

    def follow_store(self, follower: StoreFollower) -> None:
        """Read the shared store's journal before every decision (its mirror: `store`)."""
        if follower.mirror is not self.store:
            raise ValueError("the store follower must keep the dispatcher's store mirror")
        with self._lock:
            self.fresh.follower = follower
        self.fresh.sync_store()

    def set_replay(self, member: Member, endpoint: str) -> None:
        """Connect to the replica's replay socket (known only once a local replica started)."""
        with member.checking, self._lock:
            member.subscriber.set_replay_endpoint(member.name, endpoint)
            member.replay_endpoint = endpoint
        self.fresh.follow(member, wait=True)

    def mark_down(self, member: Member, why: str, *, url: str | None = None) -> None:
        """Out of rotation until a health check brings it back. `url`: where it failed; a
        replica restarted meanwhile at another address is not the one that failed."""
        with self._loads:
            if (url is None or url == member.url) and member.state in (UP, DOWN):
                member.state, member.why_down = DOWN, why

    def revive(self, member: Member) -> None:
        """A replica that was down answers again: its stream is checked through its replay
        before the next decision (a restarted replica has its mirror rebuilt from there). The
        sockets stay as they are: a bound one keeps its port, a connected one reconnects. A
        replica whose process is restarting or given up is the supervisor's to bring back."""
        if member.state in SUPERVISED:
            return
        with self._lock:
            member.subscriber.recheck(member.name)
            member.catch_up_paused_until = 0.0
        with self._loads:
            if member.state == DOWN:
                member.state, member.why_down = UP, ""

    # ------------------------------------------------------------------ supervision
    def process_exited(self, member: Member, why: str, *, given_up: bool) -> None:
        """The replica's process ended, and is restarting or (`given_up`) will not be. Out of
        rotation at once, and no health check brings it back: only `restarted` does."""
        with self._loads:
            member.state, member.why_down = GIVEN_UP if given_up else RESTARTING, why

    def process_started(self, member: Member, pid: int, *, restart: bool) -> None:
        """A process of the replica was started (`restart`: again, by the supervisor)."""
        with self._loads:
            member.pid = pid
            member.restarts += int(restart)

    def restarted(self, member: Member, url: str, replay_endpoint: str) -> None:
        """The replica's new process is ready at `url`: its mirror starts again from nothing
        (a new process holds nothing) and follows the new event stream from its first batch,
        checked through the new replay socket; then it is back in rotation. The event socket
        stays (the front binds it; the new publisher connects to it)."""
        with member.checking, self._lock:
            member.subscriber.poll(0, check=False)  # the old process's last batches go first
            member.subscriber.restarted(member.name)
            member.subscriber.set_replay_endpoint(member.name, replay_endpoint)
            member.replay_endpoint, member.url = replay_endpoint, url.rstrip("/")
            member.catch_up_paused_until = 0.0
        self.fresh.follow(member, wait=True)
        with self._loads:
            member.state, member.why_down = UP, ""

    def observe(self, member: Member, instance: str | None) -> None:
        """The replica named its stream's incarnation (a health check, a response): another one
        than the mirror follows means a restart, which the next decision's sync repairs."""
        if instance:
            with self._lock:
                member.subscriber.expect_instance(member.name, instance)

    def confirm(self, routed: Routed, instance: str | None, store_view: str | None = None) -> bool:
        """Whether `routed`'s prediction came from an exact mirror of the process that answered
        (`instance`: the incarnation its response named, None for a replica that names none)
        and, with a shared store, from the very view of the store the request was admitted on
        (`store_view`: as the response named it; a replica whose copy was detached, or that
        took another replica's turns since, got other store hits than the front read)."""
        same = instance is None or instance == routed.instance
        if not same:
            self.observe(routed.member, instance)
        store_same = self.follower is None or store_view == routed.store_view
        return routed.exact and same and store_same

    def close(self) -> None:
        held = []
        try:
            for member in list(self.members):  # no check is under way once these are held
                member.checking.acquire()
                held.append(member)
            with self._lock:
                for member in self.members:
                    member.subscriber.close()
        finally:
            for member in held:
                member.checking.release()

    # ------------------------------------------------------------------ requests
    def route(
        self,
        tokens: Sequence[int],
        *,
        request_id: str = "",
        cache_salt: str | None = None,
        exclude: frozenset[int] = frozenset(),
        count: bool = True,
    ) -> Routed:
        """Pick a replica (never one that is down or in `exclude`) and count the request in its
        load at once, so concurrent decisions see it (unless `count` is false: the caller then
        calls `begin` when the request is really sent). NoReplica when none is left."""
        self.fresh.prepare(self.members)
        with self._lock:
            self.fresh.drain(self.members)
            try:
                query = self.router.query(tokens, request_id=request_id, cache_salt=cache_salt)
            except ValueError:
                query = None
            with self._loads:  # a snapshot: `done` never waits for the policy
                usable = [m.up and m.index not in exclude for m in self.members]
                loads = [(m.tokens_in_flight, m.num_in_flight) for m in self.members]
            if not any(usable):
                raise NoReplica("no replica is up: " + self._why_down())
            for i, (tokens_in_flight, num_in_flight) in enumerate(loads):
                self.router.set_load(i, tokens_in_flight if usable[i] else DOWN_LOAD, num_in_flight)
            decision = None if query is None else self.router.route(query)
            index = self._usable_choice(decision, usable, loads)
            if decision is not None and index != decision.index:
                decision = replace(decision, index=index, replica=self.members[index].name)
            member = self.members[index]
            stream = member.subscriber.stream(member.name)
            by_medium = self._by_medium(decision)
            exact, view = stream.exact, None
            if self.follower is not None:  # store hits are predicted from the front's view
                exact, view = exact and self.follower.exact, self.follower.view
            routed = Routed(member, decision, len(tokens), exact, stream.instance, by_medium, view)
            if count:
                self.begin(routed)
        return routed

    def _by_medium(self, decision: Decision | None) -> dict[str, int] | None:
        """The prediction by medium, as a replica with tiers reports its delivery: "GPU" for
        the device, then each tier's medium (None without a per-tier prediction)."""
        tiers = None if decision is None else decision.predicted_tiers
        if decision is None or tiers is None or decision.predicted_cached is None:
            return None
        media = self.router.mirrors[decision.index].media
        if len(media) != len(tiers):
            return None
        out = {MEDIUM_GPU: decision.predicted_cached - sum(tiers)}
        out.update(zip(media, tiers, strict=True))
        return out

    def begin(self, routed: Routed) -> None:
        """The request was sent: it joins the replica's load."""
        with self._loads:
            routed.member.num_in_flight += 1
            routed.member.tokens_in_flight += routed.num_tokens

    def done(self, routed: Routed) -> None:
        """The request's answer is complete (or failed): it leaves the replica's load."""
        with self._loads:
            member = routed.member
            member.num_in_flight -= 1
            member.tokens_in_flight -= routed.num_tokens
            member.finished += 1

    @staticmethod
    def _usable_choice(
        decision: Decision | None, usable: list[bool], loads: list[tuple[int, int]]
    ) -> int:
        """The policy's choice when usable; else the usable replica it predicted most for,
        then the least loaded, then the lowest index."""
        if decision is not None and usable[decision.index]:
            return decision.index
        predicted = None if decision is None else decision.predicted
        return min(
            (i for i, ok in enumerate(usable) if ok),
            key=lambda i: (-(predicted[i] if predicted is not None else 0), loads[i][0], i),
        )

    def refresh(self) -> None:
        """Apply what has arrived and ask every live replica's replay socket for anything newer:
        PUB/SUB shows a lost batch only when a later one arrives, so a quiet replica is caught
        up here (the front's health loop calls this). A replica already being checked is left
        to that check."""
        for member in list(self.members):
            if member.up:
                self.fresh.follow(member)

    def _why_down(self) -> str:
        return "; ".join(f"{m.name}: {m.why_down or 'down'}" for m in self.members)

    # ------------------------------------------------------------------ status
    def status(self) -> list[dict[str, object]]:
        """Per replica: where it is, whether it is up, its load and its event stream."""
        out: list[dict[str, object]] = []
        with self._lock, self._loads:
            for m in self.members:
                stream = m.subscriber.stream(m.name)
                out.append(
                    {
                        "name": m.name,
                        "url": m.url,
                        "events": m.endpoint,
                        "replay": m.replay_endpoint,
                        "up": m.up,
                        "state": m.state,
                        "why_down": m.why_down or None,
                        "restarts": m.restarts,
                        "pid": m.pid,
                        "requests_in_flight": m.num_in_flight,
                        "tokens_in_flight": m.tokens_in_flight,
                        "event_batches": stream.num_batches,
                        "event_gaps": stream.num_gaps,
                        "event_restarts": stream.num_restarts,
                        "event_rejected": stream.num_rejected,
                        "events_instance": stream.instance,
                        # a replica out of rotation may have restarted: unknown until checked
                        "mirror_exact": stream.exact and m.up,
                    }
                )
        return out
