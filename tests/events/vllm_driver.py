"""Run by vLLM 0.33.0's own interpreter (benchmarks/vllm/setup_venv.sh builds it): vLLM's side
of the golden tests. It imports nothing from kvreuse.

    python vllm_driver.py DIR

1. decodes every `DIR/kvreuse-*.msgpack` payload with vLLM's `KVEventBatch` decoder and writes
   what it decoded, as plain data, to `DIR/decoded.json`;
2. builds vLLM's own event structs from `DIR/events.json` (a list of batches, each a list of
   event maps), publishes them with vLLM's `ZmqEventPublisher` on the endpoints named in
   `DIR/endpoints.json`, prints "published", and serves replays until stdin closes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import msgspec
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)


def decode_ours(folder: Path) -> None:
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    decoded = {}
    for path in sorted(folder.glob("kvreuse-*.msgpack")):
        batch = decoder.decode(path.read_bytes())
        for event in batch.events:
            assert isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared)
        decoded[path.name] = msgspec.to_builtins(batch)
    (folder / "decoded.json").write_text(json.dumps(decoded))


def publish_theirs(folder: Path) -> None:
    endpoints = json.loads((folder / "endpoints.json").read_text())
    batches = json.loads((folder / "events.json").read_text())
    event_type = BlockStored | BlockRemoved | AllBlocksCleared
    publisher = ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=endpoints["endpoint"],
        replay_endpoint=endpoints["replay_endpoint"],
        topic=endpoints["topic"],
    )
    for events in batches:
        structs = [msgspec.convert(e, event_type) for e in events]
        publisher.publish(KVEventBatch(ts=time.time(), events=structs))
    deadline = time.monotonic() + 30
    while len(publisher._buffer) < len(batches) and time.monotonic() < deadline:
        time.sleep(0.01)
    print("published", flush=True)
    sys.stdin.read()  # the test closes stdin when it has what it needs
    publisher.shutdown()


if __name__ == "__main__":
    where = Path(sys.argv[1])
    decode_ours(where)
    publish_theirs(where)
