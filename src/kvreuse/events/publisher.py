"""A ZeroMQ publisher of KV events with vLLM's socket protocol and options.

Every batch goes out on a PUB socket as three frames `[topic, seq, payload]`: `seq` is an
8-byte big-endian counter starting at 0, `payload` the msgpack of `[timestamp, events,
data_parallel_rank]`. The last `buffer_steps` batches stay in memory for a ROUTER replay socket
(`kvreuse.events.replay`: vLLM's request and answer, bounded per client, and a note of its own
naming this publisher's incarnation, `instance_id`, and its next sequence number).

`publish(events)` only enqueues the core's events into a queue of at most `max_queue_size`
batches; one background thread converts, encodes, sends and answers replays, so the step loop
never waits for a socket. ZeroMQ drops rather than queues past `hwm` messages per subscriber,
so a subscriber that stops reading costs at most that much. When the queue is full the batch
is dropped and counted (`dropped_batches`): a subscriber then sees no gap, so the count is the
only sign, and it should never move unless the thread is starved.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence

import zmq

from kvreuse.core import Event, Geometry
from kvreuse.events.common import MODES, Mode, endpoint_problem
from kvreuse.events.convert import Converter, attention_group
from kvreuse.events.curve import public_of
from kvreuse.events.curve import serve as curve_serve
from kvreuse.events.replay import (
    DEFAULT_DEADLINE_S,
    DEFAULT_HWM,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_CLIENTS,
    ReplayServer,
)
from kvreuse.events.routable import RoutableFilter
from kvreuse.events.wire import EventBatch, LegacyEventBatch, encode_batch, to_legacy

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"  # bound: the events stay on this machine
_POLL_S = 0.02  # the thread's wait for a batch when no replay is in progress
_BUSY_POLL_S = 0.001  # … and while one is: a client's pipe may take more soon


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: wildcard, ipc and inproc endpoints bind; a specific address connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's per-rank endpoint: a tcp port moves up by the rank (port 0 stays 0); an ipc or
    inproc name gets `_dp<rank>` appended. Rank 0 keeps the endpoint as given."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    base, _, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not port.isdigit():
        raise ValueError(f"endpoint {endpoint!r}: expected tcp://HOST:PORT, ipc:// or inproc://")
    return endpoint if port == "0" else f"{base}:{int(port) + data_parallel_rank}"


def _check_options(mode: str, deadline_s: float, **counts: int) -> None:
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not isinstance(deadline_s, int | float) or not 0 < deadline_s <= 3600:
        raise ValueError(f"replay_deadline_s must be seconds in (0, 3600], got {deadline_s!r}")


class Publisher:
    """Publishes a manager's events (`publish(mgr.take_events())` after each step)."""

    def __init__(
        self,
        geometry: Geometry,
        *,
        endpoint: str | None = None,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        mode: Mode = "groups",
        data_parallel_rank: int = 0,
        instance_id: str | None = None,
        replay_max_clients: int = DEFAULT_MAX_CLIENTS,
        replay_max_bytes: int = DEFAULT_MAX_BYTES,
        replay_deadline_s: float = DEFAULT_DEADLINE_S,
        replay_hwm: int = DEFAULT_HWM,
        curve_secret_key: str | None = None,
        bind: bool | None = None,
    ) -> None:
        """`endpoint`: vLLM's rule (a wildcard, ipc or inproc binds, a specific address
        connects; `bind` overrides it); None binds `DEFAULT_ENDPOINT`, on loopback only."""
        if endpoint is None:
            endpoint, bind = DEFAULT_ENDPOINT, True
        _check_options(
            mode,
            replay_deadline_s,
            buffer_steps=buffer_steps,
            hwm=hwm,
            max_queue_size=max_queue_size,
            replay_max_clients=replay_max_clients,
            replay_max_bytes=replay_max_bytes,
            replay_hwm=replay_hwm,
        )
        if not isinstance(data_parallel_rank, int) or data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be an int ≥ 0, got {data_parallel_rank!r}")
        for given in (endpoint, replay_endpoint):
            problem = None if given is None else endpoint_problem(given)
            if problem is not None:
                raise ValueError(f"cannot open KV event endpoint {given!r}: {problem}")
        endpoint = offset_endpoint(endpoint, data_parallel_rank) or endpoint
        replay_endpoint = offset_endpoint(replay_endpoint, data_parallel_rank)
        self.mode = mode
        self.topic = topic.encode()
        # which incarnation of the replica this stream is: a subscriber that sees another one
        # answer its replay knows the replica restarted
        self.instance_id = instance_id or uuid.uuid4().hex
        self.data_parallel_rank = data_parallel_rank
        self.dropped_batches = 0
        self.send_ns = 0  # the thread's CPU time converting, encoding, sending (benchmarks)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[Sequence[Event]] = queue.Queue(maxsize=max_queue_size)
        groups = [attention_group(geometry).group_id] if mode != "groups" else None
        self._converter: Converter | RoutableFilter = (
            RoutableFilter(geometry)
            if mode == "routable"
            else Converter(geometry, groups, tiers=mode == "groups")
        )
        self._next_seq = 0
        self._stop = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        # with a secret key both sockets are CURVE servers: subscribers that know the public
        # key can tell this publisher from anyone else on the port (kvreuse.events.curve)
        self.curve_public_key = None if curve_secret_key is None else public_of(curve_secret_key)
        if curve_secret_key is not None:
            curve_serve(self._pub, curve_secret_key)
        self._replay_sock: zmq.Socket[bytes] | None = None
        self._replay: ReplayServer | None = None
        try:
            if bind if bind is not None else is_bind_endpoint(endpoint):
                self._pub.bind(endpoint)
                endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint is not None:
                sock = self._replay_sock = self._ctx.socket(zmq.ROUTER)
                sock.setsockopt(zmq.SNDHWM, replay_hwm)
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full pipe says so: not dropped
                if curve_secret_key is not None:
                    curve_serve(sock, curve_secret_key)
                sock.bind(replay_endpoint)
                replay_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
                self._replay = ReplayServer(
                    sock,
                    self.topic,
                    self.instance_id,
                    max_clients=replay_max_clients,
                    max_bytes=replay_max_bytes,
                    deadline_s=replay_deadline_s,
                )
        except zmq.ZMQError as exc:
            self._close_sockets()
            where = f"{endpoint}" if replay_endpoint is None else f"{endpoint} / {replay_endpoint}"
            raise ValueError(f"cannot open KV event endpoint {where}: {exc}") from None
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        # The sockets were made here but from now on only the thread touches them.
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @property
    def next_seq(self) -> int:
        """The sequence number the next sent batch will carry."""
        return self._next_seq

    def publish(self, events: Sequence[Event]) -> None:
        """Queue one step's events (never blocks; a full queue drops and counts the batch)."""
        if self._stop.is_set():
            raise RuntimeError("the KV event publisher is closed")
        if not events:
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.dropped_batches += 1
            if self.dropped_batches == 1:
                log.warning("KV event queue full: batches are being dropped")

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued batch is sent (for tests and an orderly shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to `timeout`), stop the thread and close the sockets."""
        if self._stop.is_set():
            return
        self.flush(timeout)
        self._stop.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    shutdown = close

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay_sock is not None:
            self._replay_sock.close(linger=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            replay = self._replay
            if replay is not None:
                replay.serve(self.buffer, self._next_seq)
            try:
                events = self._queue.get(
                    timeout=_BUSY_POLL_S if replay is not None and replay.busy else _POLL_S
                )
            except queue.Empty:
                continue
            t0 = time.thread_time_ns()
            try:
                self._send(events)
            except Exception:  # one bad batch must not stop the stream
                log.exception("KV event batch could not be published")
            finally:
                self.send_ns += time.thread_time_ns() - t0
                self._queue.task_done()

    def _send(self, events: Sequence[Event]) -> None:
        wire = self._converter.convert(events)
        if not wire:
            return
        ts = time.time()
        batch: EventBatch | LegacyEventBatch
        if self.mode == "legacy":
            batch = LegacyEventBatch(ts, [to_legacy(e) for e in wire], self.data_parallel_rank)
        else:
            batch = EventBatch(ts, wire, self.data_parallel_rank)
        payload = encode_batch(batch)
        seq = self._next_seq
        self._next_seq += 1
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), copy=False)
        self.buffer.append((seq, payload))
