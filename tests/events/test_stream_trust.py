"""A subscriber believes only what continues its replica's stream.

A replica restarted on the same endpoints numbers its batches from 0 again: its mirror is rebuilt
from the new incarnation's replay, exact again, never frozen on the old one. Batches forged onto
the subscriber's bound socket (the next number with other bytes, a number far ahead, a payload
nested past the interpreter's stack) change nothing once the real stream is checked, and never
raise out of `poll()`.
"""

from __future__ import annotations

import time

import msgspec
import zmq
from replica import GEOMETRIES, Replica, agent_turns, shared_prefix, tcp

from kvreuse.core import KVCacheManager
from kvreuse.events import Publisher, Subscriber
from kvreuse.events.replay import NOTE_SEQ, ReplayEnd, decode_end
from kvreuse.events.stream import ReplicaStream
from kvreuse.events.wire import AllBlocksCleared, EventBatch, encode_batch

CTX = zmq.Context.instance()
CFG = GEOMETRIES["dcp4-hybrid"]


def resident(mgr: KVCacheManager) -> list[dict[int, int]]:
    out: list[dict[int, int]] = [{} for _ in mgr.geo.groups]
    for gid, boundary, key, _kind, _block in mgr.export_entries():
        out[gid][int.from_bytes(key[-8:], "big")] = boundary
    return out


def mirrored(stream: ReplicaStream) -> list[dict[int, int]]:
    return [dict(stream.mirror.entries(g.group_id)) for g in CFG.geometry.groups]


def settle(sub: Subscriber, name: str, pub: Publisher, timeout: float = 10.0) -> None:
    """Poll (catching up through the replay when nothing arrives) until the mirror follows
    `pub` and holds all it has sent."""
    assert pub.flush(timeout)
    stream = sub.stream(name)
    deadline = time.monotonic() + timeout
    while stream.next_seq != pub.next_seq or not stream.exact or stream.instance != pub.instance_id:
        assert time.monotonic() < deadline, f"at {stream.next_seq} of {pub.next_seq}"
        if not sub.poll(50):
            sub.catch_up(name)


def restarted(old: Replica) -> Replica:
    """A new manager and publisher on the old one's ports: the replica after a restart."""
    endpoint = "tcp://*:" + old.pub.endpoint.rsplit(":", 1)[1]
    replay = old.pub.replay_endpoint
    replay = None if replay is None else "tcp://*:" + replay.rsplit(":", 1)[1]
    old.close()
    deadline = time.monotonic() + 5
    while True:  # ZeroMQ releases a closed socket's port from its I/O thread, a moment later
        try:
            return Replica(CFG, endpoint=endpoint, replay_endpoint=replay)
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_restarted_replica_is_followed_from_its_new_stream() -> None:
    first = Replica(CFG)
    with Subscriber() as sub:
        first.follow(sub, "r")
        stream = sub.stream("r")
        for i, tokens in enumerate(shared_prefix(3)):
            first.run(f"a{i}", tokens, decode=3)
        settle(sub, "r", first.pub)
        before = first.pub.next_seq
        assert before > 3 and any(mirrored(stream))
        second = restarted(first)
        try:
            # new prompts: the new incarnation sends fewer batches than the old one had
            for i, tokens in enumerate(agent_turns(3, 2)):
                second.run(f"b{i}", tokens, decode=1)
            assert second.pub.next_seq < before
            settle(sub, "r", second.pub)
            assert mirrored(stream) == resident(second.mgr)
            assert stream.exact and stream.num_restarts == 1
            assert stream.instance == second.pub.instance_id
        finally:
            second.close()


def test_a_restart_that_has_published_nothing_shows_at_the_next_catch_up() -> None:
    first = Replica(CFG)
    with Subscriber() as sub:
        first.follow(sub, "r")
        stream = sub.stream("r")
        first.run("a", shared_prefix(1)[0], decode=2)
        settle(sub, "r", first.pub)
        assert any(mirrored(stream))
        second = restarted(first)
        try:
            # the first catch-up the new replay answers (on a loaded machine the socket may
            # take a moment to reach it; one left unanswered leaves the stream as it was)
            deadline = time.monotonic() + 10
            sub.catch_up("r")
            while stream.instance != second.pub.instance_id and time.monotonic() < deadline:
                time.sleep(0.05)
                sub.catch_up("r")
            assert mirrored(stream) == resident(second.mgr) == [{} for _ in CFG.geometry.groups]
            assert stream.exact and stream.instance == second.pub.instance_id
        finally:
            second.close()


def test_without_a_replay_a_number_below_is_taken_for_a_restart() -> None:
    first = Replica(CFG, replay_endpoint=None)
    with Subscriber() as sub:
        first.follow(sub, "r")
        stream = sub.stream("r")
        deadline = time.monotonic() + 10
        i = 0
        while stream.next_seq < 30:  # a history longer than the new incarnation's will be
            assert time.monotonic() < deadline
            first.run(f"a{i}", [100 + i] * 40)
            first.pub.flush()
            sub.poll(50)
            i += 1
        second = restarted(first)
        try:
            deadline = time.monotonic() + 10
            while not stream.num_restarts:
                assert time.monotonic() < deadline
                second.run(f"b{i}", [300 + i] * 40)
                second.pub.flush()
                sub.poll(50)
                i += 1
            # the first batch of the new incarnation seen was 0 only if none was missed
            assert stream.exact == (stream.errors[-1].startswith("batch 0 "))
            assert all(h in resident(second.mgr)[0] for h in mirrored(stream)[0])
        finally:
            second.close()


class Rogue:
    """Anyone who can reach a subscriber's bound socket: a PUB that connects to it."""

    def __init__(self, endpoint: str) -> None:
        self.sock = CTX.socket(zmq.PUB)
        self.sock.connect(endpoint)

    def send(self, seq: int, payload: bytes) -> None:
        self.sock.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        self.sock.close(linger=0)


def bound_pair() -> tuple[Subscriber, Replica, Rogue]:
    """A subscriber bound to a port that the replica's publisher and a rogue both dial."""
    sub = Subscriber()
    mirror_endpoint = "tcp://127.0.0.1:0"
    sub.add_replica("r", CFG.geometry, mirror_endpoint, bind=True)
    endpoint = sub.bound_endpoint("r")
    replica = Replica(CFG, endpoint=endpoint)
    sub.set_replay_endpoint("r", tcp(replica.pub.replay_endpoint or ""))
    return sub, replica, Rogue(endpoint)


def reach(sub: Subscriber, replica: Replica, rogue: Rogue) -> None:
    """Until both connections are up: the replica's batches and the rogue's garbage arrive."""
    stream = sub.stream("r")
    deadline = time.monotonic() + 10
    i = 0
    while stream.num_batches == 0 or stream.num_rejected == 0:
        assert time.monotonic() < deadline, "the publishers never reached the subscriber"
        rogue.sock.send_multipart([b"ping"])  # not a batch: rejected
        replica.run(f"warm{i}", [50 + i] * 24)
        replica.pub.flush()
        sub.poll(50)
        i += 1
    settle(sub, "r", replica.pub)


def test_a_forged_batch_at_the_next_number_is_undone_when_the_real_one_arrives() -> None:
    sub, replica, rogue = bound_pair()
    try:
        reach(sub, replica, rogue)
        stream = sub.stream("r")
        held = resident(replica.mgr)
        assert any(held) and mirrored(stream) == held
        forged = encode_batch(EventBatch(time.time(), [AllBlocksCleared()], 0))
        rogue.send(stream.next_seq, forged)
        deadline = time.monotonic() + 10
        while stream.num_batches and mirrored(stream) == held:
            assert time.monotonic() < deadline
            sub.poll(50)
        # believed for now (it is the next number); the replica's own batch then contradicts it
        replica.run("real", shared_prefix(1)[0], decode=2)
        while not stream.num_restarts:
            assert time.monotonic() < deadline
            sub.poll(50)
        settle(sub, "r", replica.pub)
        assert mirrored(stream) == resident(replica.mgr)
        assert stream.exact and stream.num_restarts == 1
    finally:
        rogue.close()
        replica.close()
        sub.close()


def test_a_forged_batch_on_a_quiet_stream_is_found_by_the_next_catch_up() -> None:
    """The anchor of a catch-up is the last batch applied: the replay must hold those very
    bytes, which a forged batch the replica never sent is not."""
    sub, replica, rogue = bound_pair()
    try:
        reach(sub, replica, rogue)
        stream = sub.stream("r")
        held = resident(replica.mgr)
        rogue.send(stream.next_seq, encode_batch(EventBatch(time.time(), [AllBlocksCleared()])))
        deadline = time.monotonic() + 10
        while mirrored(stream) == held:
            assert time.monotonic() < deadline
            sub.poll(50)
        sub.catch_up("r")
        assert mirrored(stream) == held and stream.exact and stream.num_restarts == 1
    finally:
        rogue.close()
        replica.close()
        sub.close()


def test_a_batch_numbered_far_ahead_is_rejected_and_the_stream_goes_on() -> None:
    sub, replica, rogue = bound_pair()
    try:
        reach(sub, replica, rogue)
        stream = sub.stream("r")
        rejected = stream.num_rejected
        forged = encode_batch(EventBatch(time.time(), [AllBlocksCleared()], 0))
        rogue.send(2**64 - 2, forged)
        deadline = time.monotonic() + 10
        while stream.num_rejected == rejected:
            assert time.monotonic() < deadline
            sub.poll(50)
        for i, tokens in enumerate(shared_prefix(3)):
            replica.run(f"q{i}", tokens, decode=2)
        settle(sub, "r", replica.pub)
        assert stream.next_seq == replica.pub.next_seq
        assert mirrored(stream) == resident(replica.mgr) and any(mirrored(stream))
        assert stream.exact and stream.num_restarts == 0
    finally:
        rogue.close()
        replica.close()
        sub.close()


def test_a_payload_nested_past_the_stack_is_counted_not_raised() -> None:
    sub, replica, rogue = bound_pair()
    try:
        reach(sub, replica, rogue)
        stream = sub.stream("r")
        event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None}
        event |= {"token_ids": [1] * 8, "block_size": 8, "lora_id": None, "medium": "GPU"}
        event |= {"lora_name": None, "extra_keys": ["HOLE"]}
        # one extra key that is an array of an array of … 5,000 deep (msgpack 0x91: [x])
        plain = msgspec.msgpack.encode([time.time(), [event], 0])
        nested = plain.replace(msgspec.msgpack.encode("HOLE"), b"\x91" * 5_000 + b"\x00")
        bad = stream.num_bad_payloads
        rogue.send(stream.next_seq, nested)
        deadline = time.monotonic() + 10
        while stream.num_bad_payloads == bad:
            assert time.monotonic() < deadline
            sub.poll(50)  # would raise RecursionError if decoding were not guarded
        assert "nested too deeply" in stream.errors[-1] or "nested" in " ".join(stream.errors)
        replica.run("after", shared_prefix(1)[0], decode=1)
        settle(sub, "r", replica.pub)
        assert mirrored(stream) == resident(replica.mgr) and stream.exact
    finally:
        rogue.close()
        replica.close()
        sub.close()


def test_an_answer_cut_by_the_byte_bound_is_fetched_in_rounds() -> None:
    """A publisher that sends at most ~1 KB per answer: a late subscriber still gets every
    batch, asking again from where each answer ended."""
    replica = Replica(CFG, replay_max_bytes=1000)
    try:
        for i, tokens in enumerate(shared_prefix(4)):
            replica.run(f"q{i}", tokens, decode=5)
        assert replica.pub.flush()
        with Subscriber() as sub:
            replica.follow(sub, "r")
            time.sleep(0.2)  # every batch went out before the subscription: none live
            sub.catch_up("r")
            stream = sub.stream("r")
            assert stream.next_seq == replica.pub.next_seq and stream.exact
            assert mirrored(stream) == resident(replica.mgr)
    finally:
        replica.close()


def test_a_replay_client_that_never_reads_holds_no_one_else_up() -> None:
    """With one answer allowed at a time, a second client is told busy at once while the
    first (which reads nothing) holds its slot, and is served after its deadline."""
    replica = Replica(
        CFG,
        replay_endpoint="inproc://replay-stuck",  # no kernel buffers: only the pipes' marks
        replay_max_clients=1,
        replay_hwm=4,
        replay_deadline_s=0.5,
    )
    stuck = CTX.socket(zmq.DEALER)
    stuck.setsockopt(zmq.RCVHWM, 1)
    other = CTX.socket(zmq.DEALER)
    try:
        for i, tokens in enumerate(agent_turns(5, 6)):
            replica.run(f"q{i}", tokens, decode=30)
        assert replica.pub.flush()
        endpoint = replica.pub.replay_endpoint or ""
        stuck.connect(endpoint)
        other.connect(endpoint)
        stuck.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(0.1)
        other.send_multipart([b"", NOTE_SEQ.to_bytes(8, "big")])
        other.send_multipart([b"", (0).to_bytes(8, "big")])
        end_seq = (-1).to_bytes(8, "big", signed=True)
        assert other.poll(2000)
        note = other.recv_multipart()
        assert note[2] == end_seq
        assert decode_end(note[3]) == ReplayEnd(
            replica.pub.instance_id, replica.pub.next_seq, busy=True
        )
        assert other.poll(2000)  # the batch request: vLLM's end marker at once, no batches
        assert other.recv_multipart() == [b"", b"", end_seq, b""]
        time.sleep(0.8)  # past the stuck client's deadline: its slot is free again
        other.send_multipart([b"", (replica.pub.next_seq - 1).to_bytes(8, "big")])
        assert other.poll(2000)
        assert int.from_bytes(other.recv_multipart()[2], "big") == replica.pub.next_seq - 1
    finally:
        stuck.close(linger=0)
        other.close(linger=0)
        replica.close()
