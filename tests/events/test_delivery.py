"""Lost batches are repaired through replay; a stalled subscriber costs the publisher only its
configured bounds; a full queue drops and counts instead of blocking; bad input is counted."""

from __future__ import annotations

import threading

import zmq
from replica import GEOMETRIES, Replica, agent_turns, sync, tcp

from kvreuse.events import Publisher, Subscriber

CTX = zmq.Context.instance()


class DroppingRelay:
    """Forwards a publisher's stream to subscribers, dropping the batches `drop` names."""

    def __init__(self, upstream: str, drop: set[int]) -> None:
        self.drop = drop
        self.dropped: list[int] = []
        self.inbound = CTX.socket(zmq.SUB)
        self.inbound.setsockopt(zmq.SUBSCRIBE, b"")
        self.inbound.connect(upstream)
        self.outbound = CTX.socket(zmq.PUB)
        self.outbound.bind("tcp://*:0")
        self.endpoint = tcp(self.outbound.getsockopt_string(zmq.LAST_ENDPOINT))

    def pump(self, timeout_ms: int = 50) -> None:
        while self.inbound.poll(timeout_ms):
            frames = self.inbound.recv_multipart()
            seq = int.from_bytes(frames[1], "big")
            if seq in self.drop:
                self.dropped.append(seq)
            else:
                self.outbound.send_multipart(frames)
            timeout_ms = 0

    def close(self) -> None:
        self.inbound.close(linger=0)
        self.outbound.close(linger=0)


def test_a_dropped_batch_is_replayed_and_the_mirror_stays_exact() -> None:
    replica = Replica(GEOMETRIES["dcp4-hybrid"])
    relay = DroppingRelay(tcp(replica.pub.endpoint), drop=set())
    try:
        with Subscriber() as sub:
            mirror = sub.add_replica(
                "r",
                replica.cfg.geometry,
                relay.endpoint,
                replay_endpoint=tcp(replica.pub.replay_endpoint or ""),
            )
            for _ in range(100):  # both hops subscribed: a probe batch reaches the subscriber
                replica.run(f"probe{_}", [2000 + _] * 20)
                assert replica.pub.flush()
                relay.pump()
                if sub.poll(50):
                    break
            start = replica.pub.next_seq
            relay.drop = {start + 2, start + 3, start + 7}
            for i, tokens in enumerate(agent_turns(7, 10)):
                assert replica.pub.flush()
                relay.pump()
                sync(sub, "r", replica.pub)
                predicted = replica.predict(mirror, f"q{i}", tokens)
                assert predicted.hit == replica.run(f"q{i}", tokens, decode=4)
            relay.pump(200)  # whatever the relay has not read yet
            stream = sub.stream("r")
            assert sorted(set(relay.dropped)) == sorted(relay.drop)
            assert stream.num_replayed >= len(relay.drop) and stream.exact
    finally:
        relay.close()
        replica.close()


def test_a_subscriber_that_stops_reading_costs_only_the_configured_bounds() -> None:
    """Over inproc (no kernel buffers) a stalled subscriber holds at most its pipe's high-water
    marks; the replay buffer and the queue stay within their sizes; publishing goes on."""
    replica = Replica(
        GEOMETRIES["attention"],
        endpoint="inproc://kv-events-stalled",
        replay_endpoint=None,
        hwm=10,
        buffer_steps=50,
        max_queue_size=20,
    )
    stalled = CTX.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 10)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.connect("inproc://kv-events-stalled")
    try:
        for i in range(400):
            replica.run(f"q{i}", [i + 1] * 40)
            assert len(replica.pub.buffer) <= 50
            assert replica.pub._queue.qsize() <= 20
        assert replica.pub.flush()
        assert replica.pub.next_seq + replica.pub.dropped_batches == 400
        assert len(replica.pub.buffer) == 50
        held = 0
        while stalled.poll(100):
            stalled.recv_multipart()
            held += 1
        assert 0 < held <= 40  # sender and receiver high-water marks, with zmq's slack
    finally:
        stalled.close(linger=0)
        replica.close()


def test_a_full_queue_drops_and_counts_instead_of_blocking() -> None:
    replica = Replica(GEOMETRIES["attention"], replay_endpoint=None, max_queue_size=2)
    pub: Publisher = replica.pub
    entered, release = threading.Event(), threading.Event()
    send = pub._send

    def stuck_send(events: object) -> None:  # the thread is busy with this batch
        entered.set()
        release.wait(10)
        send(events)  # type: ignore[arg-type]

    pub._send = stuck_send  # type: ignore[method-assign]
    try:
        replica.run("a", list(range(1, 40)))  # one batch: the thread takes it and sticks
        assert entered.wait(10)
        for i in range(4):
            replica.run(f"b{i}", [100 + i] * 40)  # one batch each
        assert pub.dropped_batches == 2 and pub._queue.qsize() == 2
    finally:
        release.set()
        replica.close()
    assert pub.next_seq == 3


def test_a_payload_that_is_not_a_batch_is_counted_not_raised() -> None:
    """Garbage on the stream's socket is counted and changes nothing: the mirror stays at batch
    0 and exact (a real batch lost that way shows as a gap when the next one comes)."""
    geo = GEOMETRIES["attention"].geometry
    rogue = CTX.socket(zmq.PUB)
    rogue.bind("tcp://*:0")
    try:
        with Subscriber() as sub:
            sub.add_replica("r", geo, tcp(rogue.getsockopt_string(zmq.LAST_ENDPOINT)))
            stream = sub.stream("r")
            for _ in range(200):
                rogue.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1 not msgpack"])
                sub.poll(20)
                if stream.num_bad_payloads:
                    break
            assert stream.num_bad_payloads == 1 and stream.next_seq == 0 and stream.exact
            assert "not a KV event batch" in stream.errors[0]
            rogue.send_multipart([b"", b"short", b"x"])
            sub.poll(1000)
            assert stream.num_rejected == 1 and stream.next_seq == 0 and stream.exact
    finally:
        rogue.close(linger=0)
