"""Follows the KV event streams of several replicas and keeps a mirror of each.

Each replica gets its own SUB socket (so a batch's origin never depends on topics) and, when it
has a replay endpoint, a DEALER socket for replays. What is applied, and when a mirror is exact,
is the stream's to decide (`kvreuse.events.stream`): live batches are claims, checked through
the replay whenever they do not simply continue the stream; a restarted replica (its batches
numbered from 0 again, or another incarnation answering the replay) has its mirror rebuilt from
its replay; a gap is repaired from it; a forged or garbled message changes nothing. Nothing a
replica (or anyone else on its socket) sends raises out of `poll()`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager

import zmq

from kvreuse.core import Geometry
from kvreuse.events import curve
from kvreuse.events.convert import attention_group
from kvreuse.events.mirror import ReplicaMirror, StoreMirror
from kvreuse.events.stream import MAX_MESSAGE_BYTES, ReplicaStream

log = logging.getLogger(__name__)

__all__ = ["ReplicaStream", "Subscriber"]


class Subscriber:
    """Mirrors of replicas' caches, kept current by `poll()`."""

    def __init__(self, *, replay_timeout: float = 2.0) -> None:
        self.replay_timeout = replay_timeout
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._streams: dict[str, ReplicaStream] = {}
        self._poller = zmq.Poller()
        self._by_socket: dict[zmq.Socket[bytes], ReplicaStream] = {}
        self._keys: curve.KeyPair | None = None  # this subscriber's CURVE client pair

    def add_replica(
        self,
        name: str,
        geometry: Geometry,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        bind: bool | None = None,
        curve_public_key: str | None = None,
        tiers: Sequence[str] = (),
        shared: Sequence[StoreMirror] = (),
    ) -> ReplicaMirror:
        """Follow a replica's stream.

        By default a wildcard `endpoint` (`tcp://*:5557`) binds, for a replica whose publisher
        connects to a specific address, and any other connects (ipc and inproc publishers
        bind, as in vLLM); `bind` overrides it. The replay endpoint always connects.
        `curve_public_key`: the replica publisher's CURVE public key; then only that publisher
        can reach these sockets (`kvreuse.events.curve`). `tiers`: the media of the replica's
        tiers, in order (`ReplicaMirror`; a medium not named is added when first seen), and
        `shared` the mirrors of the tiers among them other replicas share.
        """
        if name in self._streams:
            raise ValueError(f"replica {name!r} is already followed")
        mirror = ReplicaMirror(
            geometry, attention_group(geometry).group_id, tiers=tiers, shared=shared
        )
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        own = None
        if curve_public_key is not None:
            own = self._curve_keys()
            curve.dial(sub, curve_public_key, own)
        try:
            if bind if bind is not None else "*" in endpoint or "::" in endpoint:
                sub.bind(endpoint)
            else:
                sub.connect(endpoint)
        except zmq.ZMQError as exc:
            sub.close(linger=0)
            raise ValueError(f"cannot follow replica {name!r}: {exc}") from None
        stream = ReplicaStream(name, mirror, sub, None, replay_timeout=self.replay_timeout)
        if curve_public_key is not None and own is not None:
            stream.curve = (curve_public_key, own)
        if replay_endpoint is not None:
            try:
                stream.replace_replay(replay_endpoint)
            except ValueError:
                sub.close(linger=0)
                raise
        self._streams[name] = stream
        self._by_socket[sub] = stream
        self._poller.register(sub, zmq.POLLIN)
        return mirror

    def _curve_keys(self) -> curve.KeyPair:
        if self._keys is None:
            self._keys = curve.generate()
        return self._keys

    def set_replay_endpoint(self, name: str, replay_endpoint: str) -> None:
        """Connect (or reconnect) a followed replica's replay socket: a replica started by the
        caller may say where it listens only after its stream is followed."""
        self.stream(name).replace_replay(replay_endpoint)

    def bound_endpoint(self, name: str) -> str:
        """The endpoint the replica's stream socket last bound or connected (the port a
        `tcp://host:0` endpoint was given)."""
        return str(self.stream(name).sub.getsockopt_string(zmq.LAST_ENDPOINT))

    def mirror(self, name: str) -> ReplicaMirror:
        return self.stream(name).mirror

    def stream(self, name: str) -> ReplicaStream:
        if name not in self._streams:
            raise KeyError(f"unknown replica {name!r}; followed: {sorted(self._streams)}")
        return self._streams[name]

    def poll(self, timeout_ms: int = 0, *, check: bool = True) -> int:
        """Apply every batch that has arrived (waiting up to `timeout_ms` for the first), then
        check through the replay every stream that received something it could not place
        (unless `check` is false: a caller that checks them itself, outside its lock)."""
        applied = 0
        ready = dict(self._poller.poll(timeout_ms))
        while ready:
            for sock in ready:
                stream = self._by_socket[sock]
                while True:
                    try:
                        frames = stream.sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    applied += stream.receive(frames)
            ready = dict(self._poller.poll(0))
        if not check:
            return applied
        now = time.monotonic()
        for stream in self._streams.values():
            if stream.suspect and stream.replay is not None and now >= stream.paused_until:
                applied += stream.check()
        return applied

    def catch_up(self, name: str, hold: AbstractContextManager[object] | None = None) -> int:
        """Check the replica's stream through its replay and apply every batch past the last
        one applied.

        PUB/SUB reveals a loss only when a later batch arrives, and a restarted replica that
        has published nothing yet shows nothing at all: a router that has seen nothing for a
        while (or has just connected: a subscription takes a moment to reach the publisher)
        calls this. Returns batches applied. `hold`: a lock held for all but the waits for
        the replay (`ReplicaStream.check`).
        """
        stream = self.stream(name)
        if stream.replay is None:
            raise ValueError(f"replica {name!r} has no replay endpoint to catch up from")
        return stream.check(hold)

    def expect_instance(self, name: str, instance: str) -> None:
        """The replica says (on its health check, in a response) which incarnation it is: when
        that is not the one followed, the stream is suspect until the next check rebuilds it."""
        stream = self.stream(name)
        if stream.instance != instance:
            stream.request_check()

    def recheck(self, name: str) -> None:
        """Check the replica's stream through its replay at the next poll (a replica that was
        unreachable may have restarted meanwhile)."""
        stream = self.stream(name)
        if stream.replay is not None:
            stream.request_check()
            stream.paused_until = 0.0

    def restarted(self, name: str) -> None:
        """The replica's process was replaced (its supervisor says so): what the mirror holds
        is gone with the old process, and the new one numbers its batches from 0. The mirror
        is emptied and follows the new process from its first batch, checked through the
        replay before it counts as exact."""
        self.stream(name).restart()

    def close(self) -> None:
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        self._by_socket.clear()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
