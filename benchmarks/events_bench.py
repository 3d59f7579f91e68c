#!/usr/bin/env python3
"""What publishing KV events costs the step loop, and what the publisher thread does with it.

Workload: requests of 2,048 tokens sharing a 1,024-token prefix (--quick: 512 of 256), run
through lookup + allocate + seal/commit, finished in waves of 32, as core_bench.py's
request_cycle does; after each wave the manager's events are taken and (publisher on) handed
to `Publisher.publish`. Geometries: full attention (block 16) and a DCP4 hybrid (local block 32
× 4, recurrent 8, unit 8, scaled from the hybrid-dcp4 preset).

Metrics (stdout, one JSON object per line: metric, value, unit, params, impl):
  request_cycle_us          per request, in the caller's thread; params.publisher is "off"
                            (events off), "take" (events on, taken and dropped) or a mode
                            (groups, legacy, routable: taken and published)
  request_cycle_cpu_us      the same as the caller thread's CPU time (time.thread_time): on a
                            shared machine, steadier than the wall clock; "take" − "off" is
                            the core's own event building, the figure the publisher thread's
                            time is compared with
  publisher_thread_us       per request, the publisher thread's CPU time to convert, encode and
                            send (no subscriber, so PUB drops at once); it runs beside the
                            caller but shares the GIL, so part of it shows in the caller's time
  payload_bytes_per_request bytes of msgpack sent per request

Usage: .venv/bin/python benchmarks/events_bench.py [--quick] [--repeat N]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import kvreuse
from kvreuse import CacheConfig, GroupSpec, KVCacheManager, Request
from kvreuse.events import Publisher

IMPL = f"kvreuse-{kvreuse.__version__}"
GEOMETRIES = {
    "attention-16": CacheConfig(num_blocks=2, groups=[GroupSpec(kind="full", block_size=16)]),
    "hybrid-dcp4": CacheConfig(
        num_blocks=2,
        dcp_size=4,
        hash_unit=8,
        groups=[GroupSpec(kind="full", block_size=32), GroupSpec(kind="recurrent", block_size=8)],
    ),
}
SETTINGS = ("off", "take", "groups", "legacy", "routable")


@dataclass(frozen=True)
class Sizes:
    num_requests: int
    prompt: int
    prefix: int
    wave: int = 32


def emit(metric: str, value: float, unit: str, **params: Any) -> None:
    print(
        json.dumps({"metric": metric, "value": value, "unit": unit, "params": params, "impl": IMPL})
    )


def run_cycle(cfg: CacheConfig, s: Sizes, setting: str) -> dict[str, float]:
    blocks = (s.wave + 2) * (s.prompt // 16 + 4) * 4
    mgr = KVCacheManager(replace(cfg, num_blocks=blocks, enable_events=setting != "off"))
    pub = None
    if setting not in ("off", "take"):
        pub = Publisher(mgr.geo, endpoint="tcp://*:0", mode=setting)  # type: ignore[arg-type]
    rng = random.Random(3)
    prefix = [rng.randrange(32000) for _ in range(s.prefix)]
    rids = []
    for i in range(s.num_requests):
        r = random.Random(1000 + i)
        toks = prefix + [r.randrange(32000) for _ in range(s.prompt - s.prefix)]
        mgr.add_request(Request(f"q{i}", toks))
        rids.append(f"q{i}")
    gc.collect()
    pc, cpu = time.perf_counter_ns, time.thread_time_ns
    caller = caller_cpu = 0
    live: list[str] = []
    for i, rid in enumerate(rids):
        t0, c0 = pc(), cpu()
        res = mgr.lookup(rid)
        mgr.allocate(rid, s.prompt - res.hit, lookup=res)
        step = mgr.seal_step()
        mgr.commit(step.step_id, {rid: (s.prompt, [0])})
        live.append(rid)
        if len(live) == s.wave or i == len(rids) - 1:
            for r in live:
                mgr.finish(r)
            live.clear()
            if setting != "off":
                events = mgr.take_events()
                if pub is not None:
                    pub.publish(events)
        caller += pc() - t0
        caller_cpu += cpu() - c0
    out = {
        "request_cycle_us": caller / 1e3 / s.num_requests,
        "request_cycle_cpu_us": caller_cpu / 1e3 / s.num_requests,
    }
    if pub is not None:
        assert pub.flush(120), "the publisher did not drain"
        out["publisher_thread_us"] = pub.send_ns / 1e3 / s.num_requests
        out["payload_bytes_per_request"] = sum(len(p) for _, p in pub.buffer) / s.num_requests
        out["batches"] = pub.next_seq
        pub.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per setting; medians reported")
    args = ap.parse_args()
    s = Sizes(96, 256, 128) if args.quick else Sizes(512, 2048, 1024)
    emit("env", 0, "", python=platform.python_version(), machine=platform.machine())
    for name, cfg in GEOMETRIES.items():
        for setting in SETTINGS:
            runs = [run_cycle(cfg, s, setting) for _ in range(max(1, args.repeat))]
            params = dict(
                geometry=name,
                publisher=setting,
                stat=f"median of {len(runs)}",
                num_requests=s.num_requests,
                prompt_len=s.prompt,
                prefix_len=s.prefix,
                wave=s.wave,
            )
            for metric, unit in (
                ("request_cycle_us", "us"),
                ("request_cycle_cpu_us", "us"),
                ("publisher_thread_us", "us"),
                ("payload_bytes_per_request", "bytes"),
            ):
                if metric in runs[0]:
                    value = statistics.median(r[metric] for r in runs)
                    emit(metric, round(value, 2), unit, **params)


if __name__ == "__main__":
    main()
