"""Golden tests against vLLM 0.33.0 itself, run in its own interpreter (vllm_driver.py beside
this file): kvreuse's payloads decode with vLLM's event structs to the same data; a stream vLLM's
`ZmqEventPublisher` sends (kvreuse's events re-encoded by vLLM's structs) is followed by
kvreuse's `Subscriber`, replay included, into a mirror equal to the replica's index."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
from replica import GEOMETRIES, Replica, agent_turns, shared_prefix

from kvreuse.core import TierSpec
from kvreuse.events import Subscriber, decode_batch

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm-anchor" / "bin" / "python"
DRIVER = Path(__file__).with_name("vllm_driver.py")

pytestmark = pytest.mark.needs(
    VLLM_PYTHON.exists(), "vLLM 0.33.0's venv", "bash benchmarks/vllm/setup_venv.sh"
)


# a pool too small for the workload, with a host tier and a store below it: its batches carry
# the tiers' events in vLLM's `medium` field
TIERED = replace(GEOMETRIES["dcp4-hybrid"], num_blocks=14)
TIERS = (TierSpec("host", num_blocks=6, medium="CPU"), TierSpec("store", num_blocks=12))


def kvreuse_batches(name: str, mode: str) -> tuple[Replica, list[bytes]]:
    """Run an agent and a shared-prefix workload; every payload the replica published."""
    if name == "dcp4-hybrid-tiered":
        replica = Replica(TIERED, tiers=TIERS, buffer_steps=100_000, mode=mode)
    else:
        replica = Replica(GEOMETRIES[name], buffer_steps=100_000, mode=mode)
    prompts = agent_turns(11, 6) + shared_prefix(12, 6)
    for i, tokens in enumerate(prompts):
        replica.run(f"q{i}", tokens, decode=4)
    assert replica.pub.flush()
    payloads = [payload for _, payload in replica.pub.buffer]
    assert len(payloads) == replica.pub.next_seq
    return replica, payloads


def write_ours(folder: Path) -> tuple[dict[str, Replica], dict[str, object]]:
    """kvreuse's payloads as files for vLLM, and what kvreuse itself decodes from each."""
    replicas = {}
    ours: dict[str, object] = {}
    for name, mode in [
        ("dcp4-hybrid", "groups"),
        ("sliding-hybrid", "groups"),
        ("spec-lookahead", "groups"),
        ("sliding-hybrid", "routable"),
        ("dcp4-hybrid-tiered", "groups"),
    ]:
        replica, payloads = kvreuse_batches(name, mode)
        replicas[f"{name}-{mode}"] = replica
        for seq, payload in enumerate(payloads):
            file = f"kvreuse-{name}-{mode}-{seq:04d}.msgpack"
            (folder / file).write_bytes(payload)
            ours[file] = msgspec.to_builtins(decode_batch(payload))
    return replicas, ours


@contextmanager
def vllm_side(folder: Path) -> Iterator[subprocess.Popen[str]]:
    """vLLM's driver, once it has decoded kvreuse's files and published its own stream."""
    log = (folder / "vllm.log").open("w")
    proc = subprocess.Popen(
        [str(VLLM_PYTHON), str(DRIVER), str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "published", (folder / "vllm.log").read_text()[-3000:]
        yield proc
    finally:
        if proc.stdin:
            proc.stdin.close()  # the driver shuts its publisher down and exits
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
        log.close()


def test_golden_both_ways_with_vllm(tmp_path: Path) -> None:
    replicas, ours = write_ours(tmp_path)
    # vLLM re-publishes the DCP4 hybrid's events, re-encoded by its own structs
    source = replicas["dcp4-hybrid-groups"]
    batches = [msgspec.to_builtins(decode_batch(p))[1] for _, p in source.pub.buffer]
    (tmp_path / "events.json").write_text(json.dumps(batches))
    sockets = Path(tempfile.mkdtemp(prefix="kvev"))  # ipc paths must stay short
    endpoints = {
        "endpoint": f"ipc://{sockets}/pub",
        "replay_endpoint": f"ipc://{sockets}/replay",
        "topic": "kv@pod-1@tiny",
    }
    (tmp_path / "endpoints.json").write_text(json.dumps(endpoints))
    try:
        with vllm_side(tmp_path), Subscriber() as sub:
            # 1. vLLM's decoder reads each of kvreuse's payloads as the same data
            theirs = json.loads((tmp_path / "decoded.json").read_text())
            assert theirs.keys() == ours.keys()
            for file, batch in ours.items():
                assert theirs[file] == json.loads(json.dumps(batch)), file
            tiered = [f for f in ours if "tiered" in f]
            media = {e.get("medium") for f in tiered for e in theirs[f][1]}
            assert {"CPU", "STORE"} <= media, media  # vLLM decoded the tiers' events too
            # 2. kvreuse's subscriber follows vLLM's publisher; the stream went out before it
            # subscribed, so it all arrives through vLLM's replay socket
            mirror = sub.add_replica(
                "vllm",
                source.cfg.geometry,
                endpoints["endpoint"],
                replay_endpoint=endpoints["replay_endpoint"],
                topic=endpoints["topic"],
            )
            deadline = time.monotonic() + 30
            while sub.stream("vllm").next_seq < len(batches) and time.monotonic() < deadline:
                sub.poll(50)
                sub.catch_up("vllm")
            stream = sub.stream("vllm")
            assert stream.next_seq == len(batches) and stream.exact
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
        for replica in replicas.values():
            replica.close()
    resident: dict[int, dict[int, int]] = {}
    for gid, boundary, key, _kind, _block in source.mgr.export_entries():
        resident.setdefault(gid, {})[int.from_bytes(key[-8:], "big")] = boundary
    for gid in range(len(source.cfg.geometry.groups)):
        assert mirror.entries(gid) == resident.get(gid, {})
