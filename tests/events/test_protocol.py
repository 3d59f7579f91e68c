"""The publisher's frames, payloads and replay protocol, read with raw ZeroMQ sockets."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from replica import GEOMETRIES, Replica, shared_prefix, tcp

from kvreuse.core import KVCacheManager, Request
from kvreuse.events import Converter, hash64
from kvreuse.events.replay import NOTE_SEQ, ReplayEnd, decode_end
from kvreuse.events.wire import BlockStored

CTX = zmq.Context.instance()
MASK = (1 << 64) - 1


def raw_sub(endpoint: str, topic: bytes = b"") -> zmq.Socket[bytes]:
    sock = CTX.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.connect(endpoint)
    return sock


def recv_all(sock: zmq.Socket[bytes], count: int, timeout_ms: int = 10_000) -> list[list[bytes]]:
    out = []
    while len(out) < count and sock.poll(timeout_ms):
        out.append(sock.recv_multipart())
    return out


def subscribed(replica: Replica, sock: zmq.Socket[bytes]) -> None:
    """Publish probes until one arrives, so the subscription is in place; drain them."""
    for i in range(200):
        replica.run(f"probe{i}", [1000 + i] * 40)
        if sock.poll(50):
            break
    while sock.poll(200):
        sock.recv_multipart()


def test_frames_payload_and_fields() -> None:
    """Three frames [topic, 8-byte big-endian seq counting up by one, msgpack payload]; the
    payload is [ts, events, rank] with vLLM's tagged maps, one hash unit per block."""
    replica = Replica(GEOMETRIES["dcp4-hybrid"], topic="kv@pod-0@tiny", data_parallel_rank=3)
    sock = raw_sub(tcp(replica.pub.endpoint), b"kv@pod-0@tiny")
    try:
        subscribed(replica, sock)
        first = replica.pub.next_seq
        tokens = shared_prefix(3, 1)[0] + list(range(100, 180))
        replica.run("a", tokens, decode=3)
        assert replica.pub.flush()
        frames = recv_all(sock, replica.pub.next_seq - first)
    finally:
        sock.close(linger=0)
        replica.close()
    assert [f[0] for f in frames] == [b"kv@pod-0@tiny"] * len(frames)
    assert [f[1] for f in frames] == [(first + i).to_bytes(8, "big") for i in range(len(frames))]
    resident = {
        (g, int.from_bytes(k, "big") & MASK): b for g, b, k, _, _ in replica.mgr.export_entries()
    }
    stored = []
    for _, _, payload in frames:
        ts, events, rank = msgspec.msgpack.decode(payload)
        assert isinstance(ts, float) and abs(ts - time.time()) < 600 and rank == 3
        stored += [e for e in events if e["type"] == "BlockStored"]
    assert {e["group_idx"] for e in stored} == {0, 1}
    for e in stored:
        assert e["block_size"] == 8  # the hash unit, not the 128-token DCP page
        assert len(e["token_ids"]) == 8 * len(e["block_hashes"])
        assert e["kv_cache_spec_kind"] == ("full_attention" if e["group_idx"] == 0 else "mamba")
        assert e["medium"] == "GPU" and e["lora_id"] is None and e["lora_name"] is None
        for h in e["block_hashes"]:
            assert (e["group_idx"], h) in resident
    attention = [resident[(0, h)] for e in stored if e["group_idx"] == 0 for h in e["block_hashes"]]
    # every unit boundary of the prompt and the three decoded tokens, each once
    assert sorted(attention) == list(range(8, len(tokens) + 3 + 1, 8))


def test_cache_salt_never_leaves_the_process() -> None:
    replica = Replica(GEOMETRIES["attention"])
    sock = raw_sub(tcp(replica.pub.endpoint))
    try:
        subscribed(replica, sock)
        first = replica.pub.next_seq
        mgr = replica.mgr
        mgr.add_request(Request("s", list(range(1, 70)), cache_salt="tenant-SECRET-salt"))
        res = mgr.lookup("s")
        mgr.allocate("s", 69 - res.hit, lookup=res)
        step = mgr.seal_step()
        mgr.commit(step.step_id, {"s": (69, [5])})
        mgr.finish("s")
        replica.pub.publish(mgr.take_events())
        assert replica.pub.flush()
        frames = recv_all(sock, replica.pub.next_seq - first)
    finally:
        sock.close(linger=0)
        replica.close()
    assert frames
    events = [e for f in frames for e in msgspec.msgpack.decode(f[2])[1]]
    assert sum(len(e["block_hashes"]) for e in events) == 4  # 16, 32, 48, 64
    assert all(b"SECRET" not in f[2] for f in frames)
    assert all(e.get("extra_keys") is None for e in events)


def test_replay_answers_from_the_start_seq_then_the_end_marker() -> None:
    replica = Replica(GEOMETRIES["attention"], buffer_steps=4)
    dealer = CTX.socket(zmq.DEALER)
    dealer.connect(tcp(replica.pub.replay_endpoint or ""))
    try:
        for i, tokens in enumerate(shared_prefix(4, 4)):
            replica.run(f"q{i}", tokens, decode=20)
        assert replica.pub.flush()
        sent = replica.pub.next_seq
        assert sent > 4
        buffered = dict(replica.pub.buffer)
        for start in (0, sent - 2, sent + 5):
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            got = []
            while True:
                assert dealer.poll(10_000)
                frames = dealer.recv_multipart()
                if frames[2] == (-1).to_bytes(8, "big", signed=True):
                    # vLLM's end marker, byte for byte
                    assert frames == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
                    break
                assert len(frames) == 4 and frames[:2] == [b"", b""]
                got.append(int.from_bytes(frames[2], "big"))
                assert frames[3] == buffered[got[-1]]
            # only the last buffer_steps batches are kept
            assert got == list(range(max(start, sent - 4), sent))
        # kvreuse's note request: an end marker alone, naming this publisher and its next number
        dealer.send_multipart([b"", NOTE_SEQ.to_bytes(8, "big")])
        assert dealer.poll(10_000)
        frames = dealer.recv_multipart()
        assert frames[:3] == [b"", b"", (-1).to_bytes(8, "big", signed=True)]
        assert decode_end(frames[3]) == ReplayEnd(replica.pub.instance_id, sent)
        dealer.send_multipart([b"", b"not eight bytes", b"extra"])  # ignored, not fatal
        replica.run("after", [1, 2, 3, 4] * 10)
        assert replica.pub.flush() and replica.pub.next_seq > sent
        dealer.send_multipart([b"", sent.to_bytes(8, "big")])
        assert dealer.poll(10_000)
        assert int.from_bytes(dealer.recv_multipart()[2], "big") == sent
    finally:
        dealer.close(linger=0)
        replica.close()


def test_legacy_mode_sends_positional_arrays_of_the_attention_group() -> None:
    replica = Replica(GEOMETRIES["dcp4-hybrid"], mode="legacy")
    sock = raw_sub(tcp(replica.pub.endpoint))
    try:
        subscribed(replica, sock)
        first = replica.pub.next_seq
        replica.run("a", list(range(1, 50)))
        assert replica.pub.flush()
        frames = recv_all(sock, replica.pub.next_seq - first)
    finally:
        sock.close(linger=0)
        replica.close()
    events = [e for f in frames for e in msgspec.msgpack.decode(f[2])[1]]
    assert events
    for e in events:
        assert isinstance(e, list) and e[0] == "BlockStored"
        hashes, tokens, block_size = e[1], e[3], e[4]
        assert block_size == 8 and len(tokens) == 8 * len(hashes)
    # one group only: 48 tokens of prompt (and none of the recurrent group's states)
    assert sum(len(e[1]) for e in events) == 6


@pytest.mark.parametrize(
    ("option", "value"),
    [("buffer_steps", 0), ("hwm", -1), ("max_queue_size", True), ("mode", "all")],
)
def test_bad_options_are_one_clear_error(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=option if option != "mode" else "mode must be one of"):
        Replica(GEOMETRIES["attention"], **{option: value})


def test_an_endpoint_that_cannot_be_opened_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="cannot open KV event endpoint"):
        Replica(GEOMETRIES["attention"], endpoint="tcp://*:notaport")


def test_ranks_offset_endpoints_as_vllm_does() -> None:
    from kvreuse.events.publisher import offset_endpoint

    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://10.0.0.5:5557", 1) == "tcp://10.0.0.5:5558"
    assert offset_endpoint("tcp://*:0", 3) == "tcp://*:0"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint(None, 1) is None
    with pytest.raises(ValueError, match="expected tcp://HOST:PORT"):
        offset_endpoint("udp://x:1", 1)
    with pytest.raises(ValueError, match="data_parallel_rank must be an int"):
        Replica(GEOMETRIES["attention"], data_parallel_rank=-1)


def test_every_piece_names_the_unit_before_it_as_parent_salted_chains_included() -> None:
    """Runs that start inside a page (decode steps publishing units of a page an earlier commit
    began) on a DCP page of 16 units, for two requests with the same tokens and different
    salts, interleaved: every piece's parent is the chain hash of the unit just before it."""
    cfg = GEOMETRIES["dcp4-hybrid"]
    mgr = KVCacheManager(cfg)
    conv = Converter(cfg.geometry)
    tokens = list(range(1, 21))
    salts = {"a": "salt-1", "b": "salt-2"}
    outputs: dict[str, list[int]] = {rid: [5] for rid in salts}
    for rid, salt in salts.items():
        mgr.add_request(Request(rid, tokens, cache_salt=salt))
        res = mgr.lookup(rid)
        assert mgr.allocate(rid, len(tokens) - res.hit, lookup=res) is not None
        step = mgr.seal_step()
        mgr.commit(step.step_id, {rid: (len(tokens), [5])})
    pieces: list[BlockStored] = []
    for i in range(30):  # one commit per decoded token and request: runs inside the page
        for rid in salts:
            assert mgr.allocate(rid, 1) is not None
            step = mgr.seal_step()
            mgr.commit(step.step_id, {rid: (len(tokens) + 1 + i, [6 + i % 5])})
            outputs[rid].append(6 + i % 5)
            pieces += [e for e in conv.convert(mgr.take_events()) if isinstance(e, BlockStored)]
    chains: dict[int, list[bytes]] = {}  # hash64 of a block → its request's whole chain
    for rid, salt in salts.items():
        chain = mgr.hasher.hash_units(tokens + outputs[rid], cache_salt=salt)
        chains.update((hash64(h), chain) for h in chain[1:])
    inside = 0
    for piece in pieces:
        chain = chains[piece.block_hashes[0]]
        k = next(i for i, h in enumerate(chain) if hash64(h) == piece.block_hashes[0])
        want = None if k == 1 else hash64(chain[k - 1])
        assert piece.parent_block_hash == want, (piece.group_idx, k)
        inside += k % 16 != 1
    assert inside >= 8  # pieces that start inside their page, where the parent is not in it
