#!/usr/bin/env python3
"""Dynamo's KV indexer side of benchmarks/router_bench.py, run with `.venv-mocker/bin/python`.

Reads the recorded stream (JSON lines, one operation each):

    {"op": "stored", "worker": i, "hashes": [...], "parent": h | null, "tokens": [...]}
    {"op": "removed", "worker": i, "hashes": [...]}
    {"op": "query", "tokens": [...]}

applies every event to one `dynamo._core.RadixTree` as Dynamo's own KvCacheEvent (block_hash:
the replica's block key; tokens_hash: Dynamo's local hash of the block's 16 tokens, from
`compute_block_hash_for_seq`), and answers every query as Dynamo's router does: the query's
local block hashes (`compute_block_hash_for_seq`) then `find_matches`. Only the queries are
timed (thread CPU, per query). Prints one JSON object: the per-query nanoseconds and, per query,
the most blocks any worker matched.

    .venv-mocker/bin/python benchmarks/mocker/indexer.py STREAM.jsonl BLOCK_SIZE
"""

from __future__ import annotations

import json
import sys
import time

from dynamo._core import RadixTree, compute_block_hash_for_seq


def main(path: str, block_size: int) -> None:
    tree = RadixTree()
    event_id = 0
    costs: list[int] = []
    best: list[int] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            op = json.loads(line)
            kind = op["op"]
            if kind == "query":
                tokens = op["tokens"]
                t0 = time.thread_time_ns()
                local = compute_block_hash_for_seq(tokens, block_size)
                scores = tree.find_matches(local)
                costs.append(time.thread_time_ns() - t0)
                best.append(max(scores.scores.values(), default=0))
                continue
            event_id += 1
            if kind == "stored":
                local = compute_block_hash_for_seq(op["tokens"], block_size)
                blocks = [
                    {"block_hash": h, "tokens_hash": t}
                    for h, t in zip(op["hashes"], local, strict=True)
                ]
                data = {"stored": {"parent_hash": op["parent"], "blocks": blocks}}
            else:
                data = {"removed": {"block_hashes": op["hashes"]}}
            event = {"event_id": event_id, "data": data}
            tree.apply_event(op["worker"], json.dumps(event).encode())
    print(json.dumps({"query_ns": costs, "best_blocks": best}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
