"""CURVE behind the fleet commands: `kvreuse fleet` keys every replica's event sockets by
itself, so batches forged onto the front's bound event port never reach a mirror; `kvreuse
route` takes a replica's public key in its `--replica` spec."""

from __future__ import annotations

import time

import httpx
import zmq
from test_front_util import command, wait_until

from kvreuse.events import curve
from kvreuse.events.wire import AllBlocksCleared, EventBatch, encode_batch

PROMPT = [ord(c) for c in "A system prompt that every request of the test shares. " * 3]


def send(url: str, tokens: list[int]) -> tuple[int, int, str]:
    """(predicted, delivered, mirror-exact header) of one completion."""
    body = {"model": "kvreuse-fake", "prompt": tokens, "max_tokens": 2, "temperature": 0}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    predicted = int(resp.headers["x-kvreuse-predicted-cached-tokens"])
    return predicted, cached, resp.headers["x-kvreuse-mirror-exact"]


def replica_row(url: str) -> dict[str, object]:
    rows = httpx.get(f"{url.removesuffix('/v1')}/fleet/replicas", timeout=10).json()["replicas"]
    assert isinstance(rows, list) and len(rows) == 1
    return dict(rows[0])


def test_a_fleet_reads_its_replicas_events_and_nothing_forged() -> None:
    with command(["fleet", "--replicas", "1", "--fake", "--port", "0"], "kvreuse fleet") as url:
        first = send(url, PROMPT + [1] * 40)
        assert first[0] == first[1] == 0
        again = send(url, PROMPT + [1] * 40)
        assert again[0] == again[1] > 0 and again[2] == "true"
        row = replica_row(url)
        rogue = zmq.Context.instance().socket(zmq.PUB)
        rogue.connect(str(row["events"]))  # the front's bound port, on loopback
        try:
            forged = encode_batch(EventBatch(time.time(), [AllBlocksCleared()], 0))
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                for seq in range(64):
                    rogue.send_multipart([b"", seq.to_bytes(8, "big"), forged])
                time.sleep(0.05)
        finally:
            rogue.close(linger=0)
        third = send(url, PROMPT + [1] * 40 + [2] * 20)
        assert third[0] == third[1] > 0 and third[2] == "true"
        row = replica_row(url)
        assert row["event_rejected"] == 0 and row["event_restarts"] == 0 and row["mirror_exact"]


def test_route_follows_a_keyed_replica(tmp_path: object) -> None:
    keys = curve.generate()
    events, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/ev-replay"
    serve = ["serve", "--fake", "--port", "0", "--kv-events-endpoint", events]
    serve += ["--kv-events-replay-endpoint", replay, "--kv-events-curve-secret-key", keys.secret]
    with command(serve, "kvreuse serve") as replica:
        base = replica.removesuffix("/v1")
        spec = f"{base},{events},{replay},{keys.public}"
        with command(["route", "--port", "0", "--replica", spec], "kvreuse route") as url:
            send(url, PROMPT + [3] * 30)
            wait_until(lambda: replica_row(url)["event_batches"] > 0)
            again = send(url, PROMPT + [3] * 30)
            assert again[0] == again[1] > 0 and again[2] == "true"
        wrong = f"{base},{events},{replay},{curve.generate().public}"
        with command(["route", "--port", "0", "--replica", wrong], "kvreuse route") as url:
            send(url, PROMPT + [4] * 30)
            time.sleep(0.5)
            assert replica_row(url)["event_batches"] == 0  # another key: nothing is believed
