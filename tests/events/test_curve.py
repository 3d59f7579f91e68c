"""CURVE on the event sockets: a subscriber given a replica's public key reads that replica and
no one else; anything else on its bound port never reaches the mirror."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth
from replica import GEOMETRIES, Replica, shared_prefix
from test_stream_trust import mirrored, resident, settle

from kvreuse.events import Subscriber, curve
from kvreuse.events.publisher import DEFAULT_ENDPOINT, Publisher
from kvreuse.events.wire import AllBlocksCleared, EventBatch, encode_batch

CTX = zmq.Context.instance()
CFG = GEOMETRIES["dcp4-hybrid"]


def curve_pair() -> tuple[Subscriber, Replica]:
    """A subscriber bound to a port its replica's CURVE publisher dials."""
    keys = curve.generate()
    sub = Subscriber()
    sub.add_replica("r", CFG.geometry, "tcp://127.0.0.1:0", bind=True, curve_public_key=keys.public)
    replica = Replica(CFG, endpoint=sub.bound_endpoint("r"), curve_secret_key=keys.secret)
    sub.set_replay_endpoint("r", "tcp://127.0.0.1:" + replica.pub.replay_endpoint.rsplit(":")[-1])
    assert replica.pub.curve_public_key == keys.public
    return sub, replica


@pytest.mark.parametrize("rogue_keys", ["none", "its own"])
def test_only_the_keyed_publisher_reaches_the_mirror(rogue_keys: str) -> None:
    sub, replica = curve_pair()
    rogue = CTX.socket(zmq.PUB)
    if rogue_keys == "its own":  # a CURVE server, but with a secret not the replica's
        curve.serve(rogue, curve.generate().secret)
    rogue.connect(sub.bound_endpoint("r"))
    try:
        stream = sub.stream("r")
        forged = encode_batch(EventBatch(time.time(), [AllBlocksCleared()], 0))
        for i, tokens in enumerate(shared_prefix(3)):
            replica.run(f"q{i}", tokens, decode=2)
            for seq in range(replica.pub.next_seq + 3):  # every number it could want
                rogue.send_multipart([b"", seq.to_bytes(8, "big"), forged])
            settle(sub, "r", replica.pub)
        time.sleep(0.3)
        sub.poll(100)
        assert mirrored(stream) == resident(replica.mgr) and any(mirrored(stream))
        assert stream.exact and stream.num_rejected == 0 and stream.num_restarts == 0
        assert stream.num_bad_payloads == 0
    finally:
        rogue.close(linger=0)
        replica.close()
        sub.close()


def test_a_key_is_read_from_itself_or_from_a_zmq_certificate(tmp_path: Path) -> None:
    public_file, secret_file = zmq.auth.create_certificates(str(tmp_path), "replica")
    public, secret = zmq.auth.load_certificate(secret_file)
    assert secret is not None
    assert curve.read_key(secret_file) == secret.decode()
    assert curve.read_key(public_file, "public-key") == public.decode()
    assert curve.read_key(secret.decode()) == secret.decode()
    assert curve.public_of(secret.decode()) == public.decode()
    with pytest.raises(ValueError, match="neither a 40-character Z85 key nor a readable"):
        curve.read_key(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no secret-key of 40 Z85 characters"):
        curve.read_key(public_file)


def test_serve_refuses_a_bad_key_in_one_line() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvreuse",
            "serve",
            "--fake",
            "--port",
            "0",
            "--kv-events-endpoint",
            "tcp://*:0",
            "--kv-events-curve-secret-key",
            "not-a-key",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvreuse serve: --kv-events-curve-secret-key:")


def test_a_publisher_binds_loopback_unless_told_otherwise() -> None:
    assert DEFAULT_ENDPOINT.startswith("tcp://127.0.0.1:")
    pub = Publisher(CFG.geometry, endpoint="tcp://127.0.0.1:0", bind=True)
    try:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")
    finally:
        pub.close()
