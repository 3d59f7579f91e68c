#!/usr/bin/env python3
"""The router's decision against Dynamo's KV indexer, on the same event stream and queries.

R replicas (`--replicas`, default 1, 4 and 16) of one full-attention group of 16-token blocks
(`--blocks` per replica) serve requests that start with one of `PREFIXES` shared prefixes (1,024
tokens) and carry a fresh tail (512 tokens), handed out round robin; each replica is a
KVCacheManager, and after each wave its events are converted as the live path converts them
(`Converter`). The stream is recorded once per R, with a query (the next wave's prompts) after
every batch, written to one file, and then replayed from it by both, each round in a fresh
process of its own (a process that built other routers first would time this one on a heap
they fragmented: 30 % slower for 16 replicas after 1 and 4, seen here):

* kvreuse: the batches applied to a `Router` (exact policy) replica by replica; a decision is
  `router.route(router.query(tokens))`: the prompt's chain hashed, then one walk over the
  router's index of which replicas hold each key (`kvreuse.events.holders`);
* Dynamo: `benchmarks/mocker/indexer.py` in `.venv-mocker` (ai-dynamo-runtime, built by
  `bash benchmarks/mocker/setup_venv.sh`): the same events as Dynamo's KvCacheEvents into one
  `RadixTree`; a decision is `compute_block_hash_for_seq` then `find_matches`.

Only decisions are timed (thread CPU per decision); rounds alternate which side runs first.
Prints one JSON line per R: both sides' median µs per decision (median of the rounds' medians),
the ratio Dynamo / kvreuse (≥ 1: kvreuse's decision costs no more), and how many queries got
the same best match from both (Dynamo's blocks × 16, capped below the prompt's last token as
the replica caps it, against kvreuse's best predicted hit).

    .venv/bin/python benchmarks/router_bench.py [--replicas 1,4,16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvreuse.core import CacheConfig, GroupSpec, KVCacheManager, Request
from kvreuse.events import Converter
from kvreuse.events.wire import BlockRemoved, BlockStored, WireEvent
from kvreuse.fleet.routing.router import Router

ROOT = Path(__file__).resolve().parents[1]
INDEXER = ROOT / "benchmarks" / "mocker" / "indexer.py"
MOCKER_PYTHON = ROOT / ".venv-mocker" / "bin" / "python"
SETUP = "bash benchmarks/mocker/setup_venv.sh"
BLOCK, PREFIX, TAIL, PREFIXES, WAVE = 16, 1024, 512, 32, 8


def config(num_blocks: int) -> CacheConfig:
    groups = [GroupSpec(kind="full", block_size=BLOCK)]
    return CacheConfig(num_blocks=num_blocks, groups=groups, enable_events=True)


def record(num_replicas: int, num_blocks: int, num_waves: int, seed: int = 7) -> list[Any]:
    """The stream: ("events", replica, wire events) and ("query", tokens), in order."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(PREFIX)] for _ in range(PREFIXES)]
    cfg = config(num_blocks)
    managers = [KVCacheManager(cfg) for _ in range(num_replicas)]
    converters = [Converter(m.geo) for m in managers]
    stream: list[Any] = []
    n = 0
    for _ in range(num_waves):
        wave = []
        for _ in range(WAVE):
            tokens = rng.choice(prefixes) + [rng.randrange(32000) for _ in range(TAIL)]
            wave.append((f"q{n}", n % num_replicas, tokens))
            n += 1
        stream += [("query", tokens) for _, _, tokens in wave]
        for rid, r, tokens in wave:
            mgr = managers[r]
            mgr.add_request(Request(rid, tokens))
            res = mgr.lookup(rid)
            mgr.allocate(rid, len(tokens) - res.hit, lookup=res)
            step = mgr.seal_step()
            mgr.commit(step.step_id, {rid: (len(tokens), [0])})
            mgr.finish(rid)
        for r, mgr in enumerate(managers):
            stream.append(("events", r, converters[r].convert(mgr.take_events())))
    return stream


def kvreuse_side(stream: list[Any], num_replicas: int, num_blocks: int) -> dict[str, Any]:
    router = Router(config(num_blocks), "exact")
    for r in range(num_replicas):
        router.add_replica(f"r{r}")
    costs: list[int] = []
    best: list[int] = []
    gc.collect()
    for item in stream:
        if item[0] == "events":
            router.apply(item[1], item[2])
            continue
        t0 = time.thread_time_ns()
        decision = router.route(router.query(item[1]))
        costs.append(time.thread_time_ns() - t0)
        best.append(max(decision.predicted or (0,)))
    return {"query_ns": costs, "best": best}


def read_stream(path: Path) -> list[Any]:
    """The stream `dynamo_file` wrote, as `record` made it: each run of one replica's events
    between two queries is one batch again."""
    stream: list[Any] = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            op = json.loads(line)
            if op["op"] == "query":
                stream.append(("query", op["tokens"]))
                continue
            if op["op"] == "stored":
                ev: WireEvent = BlockStored(
                    op["hashes"], op["parent"], op["tokens"], BLOCK, None, None, None
                )
            else:
                ev = BlockRemoved(op["hashes"], None)
            last = stream[-1] if stream else None
            if last is not None and last[0] == "events" and last[1] == op["worker"]:
                last[2].append(ev)
            else:
                stream.append(("events", op["worker"], [ev]))
    return stream


def kvreuse_process(path: Path, num_replicas: int, num_blocks: int) -> dict[str, Any]:
    """kvreuse's side in a fresh process, as Dynamo's runs: a process that built other routers
    before would time this one on a heap they fragmented."""
    cmd = [sys.executable, __file__, "--replay", str(path), "--replicas", str(num_replicas)]
    proc = subprocess.run([*cmd, "--blocks", str(num_blocks)], capture_output=True, text=True)
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no output"
        raise SystemExit(f"router_bench: the kvreuse side failed: {last}")
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def dynamo_file(stream: list[Any], path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        for item in stream:
            if item[0] == "query":
                f.write(json.dumps({"op": "query", "tokens": item[1]}) + "\n")
                continue
            for ev in item[2]:
                f.write(json.dumps(_dynamo_op(item[1], ev)) + "\n")


def _dynamo_op(worker: int, ev: WireEvent) -> dict[str, Any]:
    if isinstance(ev, BlockStored):
        return {
            "op": "stored",
            "worker": worker,
            "hashes": ev.block_hashes,
            "parent": ev.parent_block_hash,
            "tokens": ev.token_ids,
        }
    if isinstance(ev, BlockRemoved):
        return {"op": "removed", "worker": worker, "hashes": ev.block_hashes}
    raise SystemExit(f"router_bench: an event this stream should not hold: {ev!r}")


def dynamo_side(path: Path, python: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [str(python), str(INDEXER), str(path), str(BLOCK)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no output"
        raise SystemExit(f"router_bench: the indexer failed: {last}")
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def run(num_replicas: int, ns: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    stream = record(num_replicas, ns.blocks, ns.waves)
    queries = [item[1] for item in stream if item[0] == "query"]
    path = tmp / f"stream-{num_replicas}.jsonl"
    dynamo_file(stream, path)
    ours: list[float] = []
    theirs: list[float] = []
    kv: dict[str, Any] = {}
    dyn: dict[str, Any] = {}
    for r in range(ns.rounds):
        for side in ("kvreuse", "dynamo") if r % 2 == 0 else ("dynamo", "kvreuse"):
            if side == "kvreuse":
                kv = kvreuse_process(path, num_replicas, ns.blocks)
                ours.append(statistics.median(kv["query_ns"]) / 1e3)
            else:
                dyn = dynamo_side(path, ns.mocker_python)
                theirs.append(statistics.median(dyn["query_ns"]) / 1e3)
    # the replica computes the last prompt token: a hit stops at the last unit boundary below it
    dyn_best = [
        min(b * BLOCK, (len(q) - 1) // BLOCK * BLOCK)
        for b, q in zip(dyn["best_blocks"], queries, strict=True)
    ]
    agree = sum(a == b for a, b in zip(kv["best"], dyn_best, strict=True))
    kv_us, dyn_us = statistics.median(ours), statistics.median(theirs)
    return {
        "metric": "router_decision",
        "replicas": num_replicas,
        "blocks_per_replica": ns.blocks,
        "queries": len(queries),
        "kvreuse_us": {"median": round(kv_us, 1), "rounds": [round(x, 1) for x in ours]},
        "dynamo_us": {"median": round(dyn_us, 1), "rounds": [round(x, 1) for x in theirs]},
        "ratio": round(dyn_us / kv_us, 3),
        "same_best_match": agree,
        "hits_seen": sum(1 for b in kv["best"] if b > 0),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", default="1,4,16", help="comma list (default: 1,4,16)")
    ap.add_argument("--blocks", type=int, default=4096, help="blocks per replica (default 4096)")
    ap.add_argument("--waves", type=int, default=200, help="waves of 8 requests (default 200)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--mocker-python", type=Path, default=MOCKER_PYTHON, help=argparse.SUPPRESS)
    ap.add_argument("--replay", type=Path, help=argparse.SUPPRESS)  # kvreuse's side, one stream
    ns = ap.parse_args(argv)
    if ns.replay is not None:
        num = int(ns.replicas)
        print(json.dumps(kvreuse_side(read_stream(ns.replay), num, ns.blocks)))
        return 0
    try:
        counts = [int(x) for x in ns.replicas.split(",") if x]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or ns.rounds < 1 or ns.waves < 1 or ns.blocks < 2:
        print("router_bench: --replicas is a comma list of counts ≥ 1; --rounds, --waves ≥ 1, "
              "--blocks ≥ 2", file=sys.stderr)  # fmt: skip
        return 2
    if not ns.mocker_python.exists():
        print(
            f"router_bench: the mocker's venv is absent: build it with `{SETUP}`", file=sys.stderr
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp:
        for n in counts:
            print(json.dumps(run(n, ns, Path(tmp))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
