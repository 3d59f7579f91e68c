"""Follows the KV event streams of several replicas and keeps a mirror of each.

Each replica gets its own SUB socket (so a batch's origin never depends on topics) and, when it
has a replay endpoint, a DEALER socket for replays. Sequence numbers must arrive as 0, 1, 2, …:
a batch past the next expected one means batches were lost (a slow joiner, a full pipe), and
the subscriber asks the replica's replay socket for everything from the first missing number
before applying it. A mirror is `exact` while every batch from 0 on was applied; a gap that
replay cannot fill (no replay endpoint, a buffer that moved on, no answer in time) or a payload
that does not decode clears it for good and is counted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import zmq

from kvreuse.core import Geometry
from kvreuse.events.convert import attention_group
from kvreuse.events.mirror import ReplicaMirror
from kvreuse.events.wire import PayloadError, decode_batch

log = logging.getLogger(__name__)


@dataclass
class ReplicaStream:
    """One replica's sockets, position in its stream and what went wrong with it."""

    name: str
    mirror: ReplicaMirror
    sub: zmq.Socket[bytes]
    replay: zmq.Socket[bytes] | None
    next_seq: int = 0
    num_batches: int = 0
    num_gaps: int = 0
    num_replayed: int = 0
    num_unrepaired: int = 0
    num_bad_payloads: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not (self.num_unrepaired or self.num_bad_payloads)


class Subscriber:
    """Mirrors of replicas' caches, kept current by `poll()`."""

    def __init__(self, *, replay_timeout: float = 2.0) -> None:
        self.replay_timeout = replay_timeout
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._streams: dict[str, ReplicaStream] = {}
        self._poller = zmq.Poller()
        self._by_socket: dict[zmq.Socket[bytes], ReplicaStream] = {}

    def add_replica(
        self,
        name: str,
        geometry: Geometry,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        bind: bool | None = None,
    ) -> ReplicaMirror:
        """Follow a replica's stream.

        By default a wildcard `endpoint` (`tcp://*:5557`) binds, for a replica whose publisher
        connects to a specific address, and any other connects (ipc and inproc publishers
        bind, as in vLLM); `bind` overrides it. The replay endpoint always connects.
        """
        if name in self._streams:
            raise ValueError(f"replica {name!r} is already followed")
        mirror = ReplicaMirror(geometry, attention_group(geometry).group_id)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        replay = None
        try:
            if bind if bind is not None else "*" in endpoint or "::" in endpoint:
                sub.bind(endpoint)
            else:
                sub.connect(endpoint)
            if replay_endpoint is not None:
                replay = self._ctx.socket(zmq.DEALER)
                replay.connect(replay_endpoint)
        except zmq.ZMQError as exc:
            sub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            raise ValueError(f"cannot follow replica {name!r}: {exc}") from None
        stream = ReplicaStream(name, mirror, sub, replay)
        self._streams[name] = stream
        self._by_socket[sub] = stream
        self._poller.register(sub, zmq.POLLIN)
        return mirror

    def set_replay_endpoint(self, name: str, replay_endpoint: str) -> None:
        """Connect (or reconnect) a followed replica's replay socket: a replica started by the
        caller may say where it listens only after its stream is followed."""
        stream = self.stream(name)
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.connect(replay_endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ValueError(
                f"replica {name!r}: replay endpoint {replay_endpoint}: {exc}"
            ) from None
        if stream.replay is not None:
            stream.replay.close(linger=0)
        stream.replay = sock

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

    def poll(self, timeout_ms: int = 0) -> int:
        """Apply every batch that has arrived (waiting up to `timeout_ms` for the first)."""
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
                    applied += self._receive(stream, frames)
            ready = dict(self._poller.poll(0))
        return applied

    def catch_up(self, name: str) -> int:
        """Ask the replica's replay socket for every batch from the next expected one on.

        PUB/SUB reveals a loss only when a later batch arrives; a router that has seen nothing
        for a while (or has just connected: a subscription takes a moment to reach the
        publisher) calls this to fetch what it may have missed. Returns batches applied.
        """
        stream = self.stream(name)
        if stream.replay is None:
            raise ValueError(f"replica {name!r} has no replay endpoint to catch up from")
        return self._repair(stream, None)

    def close(self) -> None:
        for stream in self._streams.values():
            stream.sub.close(linger=0)
            if stream.replay is not None:
                stream.replay.close(linger=0)
        self._streams.clear()
        self._by_socket.clear()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _receive(self, stream: ReplicaStream, frames: list[bytes]) -> int:
        if len(frames) != 3 or len(frames[1]) != 8:
            return self._bad(stream, f"a message of {len(frames)} frames is not a KV event batch")
        seq = int.from_bytes(frames[1], "big")
        if seq < stream.next_seq:
            return 0  # already applied (it came through a replay first)
        applied = 0
        if seq > stream.next_seq:
            stream.num_gaps += 1
            applied += self._repair(stream, seq)
            if seq < stream.next_seq:
                return applied
        return applied + self._apply(stream, seq, frames[2])

    def _apply(self, stream: ReplicaStream, seq: int, payload: bytes) -> int:
        try:
            batch = decode_batch(payload)
        except PayloadError as exc:
            stream.next_seq = seq + 1
            return self._bad(stream, f"batch {seq}: {exc}")
        stream.mirror.apply(batch.events)
        stream.next_seq = seq + 1
        stream.num_batches += 1
        return 1

    def _bad(self, stream: ReplicaStream, message: str) -> int:
        stream.num_bad_payloads += 1
        self._error(stream, message)
        return 0

    def _error(self, stream: ReplicaStream, message: str) -> None:
        if len(stream.errors) < 100:
            stream.errors.append(message)
        log.warning("KV events of replica %s: %s", stream.name, message)

    def _repair(self, stream: ReplicaStream, seen: int | None) -> int:
        """Fill [next_seq, seen) (or everything buffered when `seen` is None) from the
        replica's replay socket; returns batches applied."""
        first_missing = stream.next_seq
        if stream.replay is None:
            assert seen is not None
            return self._unrepaired(stream, seen, "no replay endpoint")
        stream.replay.send_multipart((b"", first_missing.to_bytes(8, "big")))
        applied = 0
        deadline = time.monotonic() + self.replay_timeout
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not stream.replay.poll(left_ms):
                if seen is None:
                    self._error(stream, "the replay did not answer a catch-up")
                    return applied
                return applied + self._unrepaired(stream, seen, "the replay did not answer")
            frames = stream.replay.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8:
                self._error(stream, f"a replay message of {len(frames)} frames was ignored")
                continue
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq < 0:
                break  # the end marker
            if seq < stream.next_seq:
                continue
            if seq > stream.next_seq:
                # the replay buffer no longer holds what was missed
                self._unrepaired(stream, seq, "the replay buffer moved on")
            applied += self._apply(stream, seq, frames[3])
            stream.num_replayed += 1
        if seen is not None and stream.next_seq < seen:
            applied += self._unrepaired(stream, seen, "the replay ended early")
        return applied

    def _unrepaired(self, stream: ReplicaStream, resume: int, why: str) -> int:
        stream.num_unrepaired += 1
        self._error(stream, f"batches {stream.next_seq}…{resume - 1} are lost ({why})")
        stream.next_seq = resume
        return 0
