#!/usr/bin/env python3
"""CPU micro-benchmarks of the kvreuse core, on the workloads of vLLM's anchor benchmark.

Metrics (stdout; one JSON object per line with --json, else a table; progress on stderr):
  hash_tokens_per_s        chain extension over a 131,072-token prompt, unit 16, per algorithm
  lookup_full_hit_us       mgr.lookup() of a fully cached 131,072-token prompt (8,192 pages)
  lookup_miss_us           mgr.lookup() of the same prompt with a different first token
  lookup_cold_request_ms   one cold request: lookup + allocate + seal/commit + finish
  request_cycle_us         per request: lookup + allocate + seal/commit + finish, 1,000 requests
                           of 2,048 tokens sharing a 1,024-token prefix, waves of 32 (events off,
                           then on with take_events() once per wave)
  pool_bytes_per_block     tracemalloc bytes of an empty manager / num_blocks
  bytes_per_cached_block   tracemalloc bytes of the manager after caching 100,000 blocks / keys
  *_ratio                  (--with-anchor) kvreuse vs vLLM measured in the same run

Usage:
  .venv/bin/python benchmarks/core_bench.py --json [--quick] [--only hash,lookup,cycle,memory]
      [--with-anchor] [--rounds N] [--paths native,pure] [--out results.jsonl] [--profile]

Every record carries params.path, the core path that produced it ("native": the C kernels,
"pure": pure Python; see kvreuse.core.native). With --paths, each path runs in its own
subprocess (KVREUSE_PURE=0 or 1), alternating within each round, and the ratios are per path.
See benchmarks/README.md for the pinned workloads and how to read the ratios.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import platform
import pstats
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import kvreuse
from kvreuse import CacheConfig, GroupSpec, KVCacheManager, Request
from kvreuse.core import native
from kvreuse.core.hashing.digests import HASH_ALGOS, algo_available
from kvreuse.core.hashing.hasher import Hasher

sys.path.insert(0, str(Path(__file__).parent))
from anchor import (
    DEFAULT_ANCHOR_DIR,
    DEFAULT_ANCHOR_PYTHON,
    Ratio,
    emit_ratios,
    round_ratios,
    run_anchor,
)

A = TypeVar("A")
T = TypeVar("T")
IMPL = f"kvreuse-{kvreuse.__version__}"
BLOCK = 16  # block size = hash unit in every workload, like the anchor's fa-b16 geometry
BENCHES = ("hash", "lookup", "cycle", "memory")
ALIASES = {
    "request_cycle": "cycle",
    "batch": "cycle",
    "bytes": "memory",
    "hash_tokens_per_s": "hash",
    "lookup_full_hit": "lookup",
}
PATHS = ("native", "pure")
BENCH_SEED = "kvreuse-bench"  # hash_seed for xxh3_128 / blake3 (no per-process-seed warning)


@dataclass(frozen=True)
class Sizes:
    """Workload sizes; QUICK mirrors the anchor's --quick so quick ratios compare alike."""

    hash_tokens: int
    hash_repeat: int
    lookup_tokens: int
    lookup_repeat: int
    cycle_requests: int
    cycle_prompt: int
    cycle_prefix: int
    cycle_wave: int
    cycle_blocks: int
    mem_requests: int
    mem_tokens: int


FULL = Sizes(131_072, 7, 131_072, 15, 1000, 2048, 1024, 32, 16_384, 100, 16_000)
QUICK = Sizes(8192, 3, 8192, 5, 50, 2048, 1024, 16, 4096, 5, 16_000)


# ------------------------------------------------------------------------------------ output
class Emitter:
    """Writes result records to stdout (JSON lines or a table) and optionally to a file."""

    def __init__(self, as_json: bool, out: IO[str] | None) -> None:
        self.as_json = as_json
        self.out = out
        self.records: list[dict[str, Any]] = []
        # merged into every record's params (round, path)
        self.context: dict[str, Any] = {"path": native.ACTIVE}

    def emit(self, metric: str, value: Any, unit: str, **params: Any) -> dict[str, Any]:
        params = {**params, **self.context}
        rec = {"metric": metric, "value": value, "unit": unit, "params": params, "impl": IMPL}
        self.records.append(rec)
        line = json.dumps(rec)
        if self.as_json:
            print(line, flush=True)
        else:
            keys = ("algo", "events", "path", "round", "target", "ok")
            shown = {k: v for k, v in params.items() if k in keys}
            extra = " ".join(f"{k}={v}" for k, v in shown.items())
            val = f"{value:,.3f}" if isinstance(value, float) else f"{value}"
            print(f"{metric:34s} {val:>16s} {unit:10s} {extra}", flush=True)
        if self.out is not None:
            self.out.write(line + "\n")
            self.out.flush()
        return rec

    def find(self, metric: str, **match: Any) -> dict[str, Any] | None:
        for rec in self.records:
            if rec["metric"] == metric and all(rec["params"].get(k) == v for k, v in match.items()):
                return rec
        return None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def random_tokens(n: int, seed: int, vocab: int = 32000) -> list[int]:
    """The same generator and seeds as benchmarks/vllm/core_driver.py."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def full_config(num_blocks: int, events: bool = False) -> CacheConfig:
    return CacheConfig(
        num_blocks=num_blocks,
        groups=[GroupSpec(kind="full", block_size=BLOCK)],
        hash_unit=BLOCK,
        enable_events=events,
    )


def run_to_completion(mgr: KVCacheManager, rid: str, tokens: list[int]) -> int:
    """add (hashes) → lookup → allocate the rest → seal → commit with one sampled token → finish.
    Returns the hit."""
    mgr.add_request(Request(rid, prompt_token_ids=tokens))
    res = mgr.lookup(rid)
    plan = mgr.allocate(rid, num_new_tokens=len(tokens) - res.hit, lookup=res)
    if plan is None:
        raise MemoryError(f"{rid}: the pool is too small")
    step = mgr.seal_step()
    mgr.commit(step.step_id, {rid: (len(tokens), [0])})
    mgr.finish(rid)
    return res.hit


def _timed(prof: cProfile.Profile | None, fn: Callable[[A], T], arg: A) -> tuple[T, int]:
    """fn(arg)'s result and its wall time in ns, profiled when `prof` is given."""
    if prof is not None:
        prof.enable()
    t0 = time.perf_counter_ns()
    out = fn(arg)
    t1 = time.perf_counter_ns()
    if prof is not None:
        prof.disable()
    return out, t1 - t0


def _us(ns: float) -> float:
    return round(ns / 1e3, 3)


# ------------------------------------------------------------------------------------ hash
def bench_hash(em: Emitter, s: Sizes, prof: cProfile.Profile | None = None) -> None:
    tokens = random_tokens(s.hash_tokens, seed=1)  # the anchor's hash prompt
    for algo in HASH_ALGOS:
        if not algo_available(algo):
            em.emit("hash_tokens_per_s", None, "tokens/s", algo=algo, unavailable=True)
            log(f"hash {algo}: package not installed, skipped")
            continue
        seed = None if algo == "sha256" else BENCH_SEED
        hasher = Hasher(algo, BLOCK, 0, seed)
        samples: list[int] = []
        units = 0
        for _ in range(s.hash_repeat):
            chain = hasher.chain()
            gc.collect()
            units, ns = _timed(prof, chain.extend, tokens)
            samples.append(ns)
        best, med = min(samples), statistics.median(samples)
        em.emit(
            "hash_tokens_per_s",
            round(s.hash_tokens / (best / 1e9)),
            "tokens/s",
            algo=algo,
            stat=f"best of {s.hash_repeat}",
            median_tokens_per_s=round(s.hash_tokens / (med / 1e9)),
            best_ms=round(best / 1e6, 3),
            median_ms=round(med / 1e6, 3),
            ns_per_unit=round(med / units),
            num_tokens=s.hash_tokens,
            hash_unit=BLOCK,
            num_units=units,
            hash_seed=seed if seed is not None else "default",
            timed="Chain.extend over the whole prompt (chain built outside the timer)",
        )
        log(
            f"hash {algo:9s}: best {s.hash_tokens / best * 1e3:7.2f} M tok/s, median "
            f"{s.hash_tokens / med * 1e3:7.2f} M tok/s ({med / units:.0f} ns/unit)"
        )


# ------------------------------------------------------------------------------------ lookup
def bench_lookup(em: Emitter, s: Sizes, prof: cProfile.Profile | None = None) -> None:
    n = s.lookup_tokens
    num_blocks = n // BLOCK + 256  # 8,448 for 131,072 tokens, like the anchor
    mgr = KVCacheManager(full_config(num_blocks))
    tokens = random_tokens(n, seed=2)  # the anchor's lookup prompt
    # Producer: hashed outside the timer (the anchor's "hashing excluded").
    mgr.add_request(Request("cold", prompt_token_ids=tokens))
    gc.collect()
    t0 = time.perf_counter_ns()
    res = mgr.lookup("cold")
    plan = mgr.allocate("cold", num_new_tokens=n - res.hit, lookup=res)
    if plan is None:
        raise MemoryError("lookup: the pool is too small")
    step = mgr.seal_step()
    mgr.commit(step.step_id, {"cold": (n, [0])})
    mgr.finish("cold")
    cold_ns = time.perf_counter_ns() - t0
    common = dict(num_tokens=n, hash_unit=BLOCK, block_size=BLOCK, num_blocks=num_blocks)
    em.emit(
        "lookup_cold_request_ms",
        round(cold_ns / 1e6, 3),
        "ms",
        **common,
        timed="lookup + allocate + seal + commit (publishes every page) + finish; hashing excluded",
    )
    log(f"lookup cold request: {cold_ns / 1e6:.2f} ms")
    for label, toks in (("full_hit", tokens), ("miss", [tokens[0] + 1, *tokens[1:]])):
        mgr.add_request(Request(label, prompt_token_ids=toks))  # hashed here, before timing
        samples: list[int] = []
        hit = -1
        gc.collect()
        for _ in range(s.lookup_repeat):
            res, ns = _timed(prof, mgr.lookup, label)
            samples.append(ns)
            hit = res.hit
        if label == "full_hit" and hit != (n - 1) // BLOCK * BLOCK:
            raise AssertionError(f"lookup: full hit expected, got {hit} of {n}")
        if label == "miss" and hit != 0:
            raise AssertionError(f"lookup: miss expected, got hit {hit}")
        med = statistics.median(samples)
        em.emit(
            f"lookup_{label}_us",
            _us(med),
            "us",
            **common,
            stat=f"median of {s.lookup_repeat}",
            min_us=_us(min(samples)),
            max_us=_us(max(samples)),
            repeat=s.lookup_repeat,
            hit_tokens=hit,
            reason=res.reason,
            num_pages_hit=hit // BLOCK,
            timed="mgr.lookup(rid) of an added (already hashed) waiting request",
        )
        log(f"lookup {label:8s}: median {med / 1e3:9.1f} us (hit {hit} tokens)")


# ------------------------------------------------------------------------------------ cycle
def bench_cycle(em: Emitter, s: Sizes, events: bool, prof: cProfile.Profile | None = None) -> None:
    mgr = KVCacheManager(full_config(s.cycle_blocks, events=events))
    prefix = random_tokens(s.cycle_prefix, seed=3)
    reqs: list[tuple[str, int]] = []
    for i in range(s.cycle_requests):
        toks = prefix + random_tokens(s.cycle_prompt - s.cycle_prefix, seed=1000 + i)
        rid = f"req-{i}"
        mgr.add_request(Request(rid, prompt_token_ids=toks))  # hashed before the timed region
        reqs.append((rid, len(toks)))
    pc = time.perf_counter_ns
    t_lookup = t_alloc = t_commit = t_finish = t_events = 0
    total_hit = 0
    num_events = 0
    live: list[str] = []
    last = len(reqs) - 1
    gc.collect()
    if prof is not None:
        prof.enable()
    for i, (rid, num) in enumerate(reqs):
        t0 = pc()
        res = mgr.lookup(rid)
        t1 = pc()
        plan = mgr.allocate(rid, num - res.hit, lookup=res)
        t2 = pc()
        if plan is None:
            raise MemoryError("request_cycle: the pool is too small for the wave")
        step = mgr.seal_step()
        mgr.commit(step.step_id, {rid: (num, [0])})
        t3 = pc()
        t_lookup += t1 - t0
        t_alloc += t2 - t1
        t_commit += t3 - t2
        total_hit += res.hit
        live.append(rid)
        if len(live) == s.cycle_wave or i == last:
            t4 = pc()
            for r in live:
                mgr.finish(r)
            t5 = pc()
            t_finish += t5 - t4
            if events:
                num_events += len(mgr.take_events())
                t_events += pc() - t5
            live.clear()
    if prof is not None:
        prof.disable()
    n = len(reqs)
    total = t_lookup + t_alloc + t_commit + t_finish + t_events
    em.emit(
        "request_cycle_us",
        _us(total / n),
        "us",
        events=events,
        stat="mean per request",
        lookup_us=_us(t_lookup / n),
        allocate_us=_us(t_alloc / n),
        seal_commit_us=_us(t_commit / n),
        finish_us=_us(t_finish / n),
        take_events_us=_us(t_events / n),
        num_events=num_events,
        mean_hit_tokens=round(total_hit / n, 1),
        num_requests=n,
        prompt_len=s.cycle_prompt,
        prefix_len=s.cycle_prefix,
        wave=s.cycle_wave,
        num_blocks=s.cycle_blocks,
        block_size=BLOCK,
        hash_unit=BLOCK,
        evicted_blocks=mgr.pool.num_evicted_blocks,
        timed="sum of lookup, allocate, seal+commit, finish (and take_events once per wave)",
    )
    log(
        f"request cycle (events {'on' if events else 'off'}): {total / n / 1e3:.1f} us/request "
        f"(lookup {t_lookup / n / 1e3:.1f}, allocate {t_alloc / n / 1e3:.1f}, seal+commit "
        f"{t_commit / n / 1e3:.1f}, finish {t_finish / n / 1e3:.1f}, events "
        f"{t_events / n / 1e3:.1f}); mean hit {total_hit / n:.0f}"
    )


# ------------------------------------------------------------------------------------ memory
def bench_memory(em: Emitter, s: Sizes) -> None:
    num_blocks = s.mem_requests * (s.mem_tokens // BLOCK) + 65  # the anchor's 100,000 + 1 + 64
    # Inputs are generated before the window: it measures the cache, not the prompts.
    prompts = [random_tokens(s.mem_tokens, seed=50_000 + i) for i in range(s.mem_requests)]
    gc.collect()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    mgr = KVCacheManager(full_config(num_blocks))
    gc.collect()
    after_pool, _ = tracemalloc.get_traced_memory()
    for i, toks in enumerate(prompts):
        run_to_completion(mgr, f"m{i}", toks)
    gc.collect()
    after_cache, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    keys = sum(len(idx) for idx in mgr.pool.index)
    exported = len(mgr.export_entries())
    if exported != keys:
        raise AssertionError(f"memory: index holds {keys} keys, export_entries {exported}")
    params: dict[str, Any] = dict(
        num_blocks=num_blocks,
        cached_keys=keys,
        requests=s.mem_requests,
        tokens_per_request=s.mem_tokens,
        block_size=BLOCK,
        hash_unit=BLOCK,
        hash_algo="sha256",
        events=False,
        evicted_blocks=mgr.pool.num_evicted_blocks,
    )
    pool_bytes = after_pool - base
    em.emit(
        "pool_bytes_per_block",
        round(pool_bytes / num_blocks, 1),
        "bytes",
        **params,
        window="CacheConfig + KVCacheManager construction (empty pool, LRU queue, hasher)",
    )
    em.emit(
        "bytes_per_cached_block",
        round((after_cache - base) / keys, 1),
        "bytes",
        **params,
        index_bytes_per_key=round((after_cache - after_pool) / keys, 1),
        peak_bytes_per_key=round((peak - base) / keys, 1),
        window=(
            "from before CacheConfig/KVCacheManager construction to after the last finish: the "
            "pool arrays, the index (dict + 32-byte sha256 keys), finished-request stats and "
            "settled-step ids of every request; prompts generated before the window"
        ),
    )
    log(
        f"memory: pool {pool_bytes / num_blocks:.0f} B/block, resident "
        f"{(after_cache - base) / keys:.0f} B/cached block ({keys} keys), peak "
        f"{(peak - base) / 2**20:.1f} MiB"
    )
    del prompts


# ------------------------------------------------------------------------------------ main
def profile(which: list[str], s: Sizes, top: int) -> None:
    """cProfile of the timed regions (lookup full hit + miss, request cycle with events off)."""
    sink = Emitter(as_json=False, out=None)
    devnull = open(os.devnull, "w")  # noqa: SIM115 - results of profiled runs are discarded
    jobs = {
        "hash": lambda p: bench_hash(sink, s, p),
        "lookup": lambda p: bench_lookup(sink, s, p),
        "cycle": lambda p: bench_cycle(sink, s, False, p),
    }
    real_stdout = sys.stdout
    for name in which:
        if name not in jobs:
            continue
        prof = cProfile.Profile()
        sys.stdout = devnull
        try:
            jobs[name](prof)
        finally:
            sys.stdout = real_stdout
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        log(f"==== cProfile: {name} (timed regions only), top {top} by tottime ====")
        log(buf.getvalue())
    devnull.close()


def parse_only(text: str) -> list[str]:
    out: list[str] = []
    for raw in text.split(","):
        name = ALIASES.get(raw.strip(), raw.strip())
        if not name:
            continue
        if name not in BENCHES:
            raise SystemExit(f"--only: unknown benchmark {raw!r}; choose from {', '.join(BENCHES)}")
        if name not in out:
            out.append(name)
    return [b for b in BENCHES if b in out]


class PathView:
    """The records of one core path, for `anchor.round_ratios` / `emit_ratios`: finds only
    that path's records and tags the ratios it emits with it."""

    def __init__(self, em: Emitter, path: str) -> None:
        self.em, self.path = em, path
        self.context: dict[str, Any] = {}

    def find(self, metric: str, **match: Any) -> dict[str, Any] | None:
        return self.em.find(metric, path=self.path, **match)

    def emit(self, metric: str, value: Any, unit: str, **params: Any) -> dict[str, Any]:
        return self.em.emit(metric, value, unit, **params, path=self.path)


def parse_paths(text: str) -> list[str]:
    out = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in out if p not in PATHS]
    if bad or not out or len(set(out)) != len(out):
        raise SystemExit(f"--paths: expected a comma list of {', '.join(PATHS)}, got {text!r}")
    return out


def run_path(em: Emitter, path: str, todo: list[str], quick: bool) -> bool:
    """Run `todo` in a subprocess on `path` (KVREUSE_PURE) and re-emit its records tagged with
    this round; False (and one `path_unavailable` line) when that path is not what ran."""
    env = {**os.environ, "KVREUSE_PURE": "1" if path == "pure" else "0"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--only", ",".join(todo)]
    log(f"path {path}: {' '.join(cmd[1:])}")
    proc = subprocess.run(
        [*cmd, *(["--quick"] if quick else [])], env=env, stdout=subprocess.PIPE, text=True
    )
    recs = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    ran = recs[0]["params"].get("path") if recs else None
    if proc.returncode != 0 or ran != path:
        why = f"exit {proc.returncode}" if proc.returncode else f"the core ran on {ran!r}"
        em.emit("path_unavailable", None, "", path=path, reason=why, core=native.describe())
        log(f"path {path}: unavailable ({why})")
        return False
    for rec in recs[1:]:  # [0] is the child's env line
        params = {k: v for k, v in rec["params"].items() if k not in ("round", "path")}
        em.emit(rec["metric"], rec["value"], rec["unit"], **params, path=path)
    return True


def run_round(em: Emitter, todo: list[str], s: Sizes) -> None:
    if "hash" in todo:
        bench_hash(em, s)
    if "lookup" in todo:
        bench_lookup(em, s)
    if "cycle" in todo:
        bench_cycle(em, s, events=False)
        bench_cycle(em, s, events=True)
    if "memory" in todo:
        bench_memory(em, s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", action="store_true", help="one JSON object per line on stdout")
    ap.add_argument("--quick", action="store_true", help="small sizes (the anchor's --quick)")
    ap.add_argument("--only", default=",".join(BENCHES), help="comma list of " + ",".join(BENCHES))
    ap.add_argument("--out", help="also append the JSON lines to this file")
    ap.add_argument("--with-anchor", action="store_true", help="also run vLLM's anchor; ratios")
    ap.add_argument("--anchor-dir", type=Path, default=DEFAULT_ANCHOR_DIR)
    ap.add_argument("--anchor-python", type=Path, default=DEFAULT_ANCHOR_PYTHON)
    ap.add_argument("--anchor-repeat", type=int, default=3, help="the anchor's --repeat")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the timing benches N times (with --with-anchor: ours then vLLM's, "
        "alternating); ratios are medians over rounds",
    )
    ap.add_argument(
        "--paths",
        help="comma list of core paths (native, pure), each run in its own subprocess, "
        "alternating within each round; default: this process's path only",
    )
    ap.add_argument(
        "--profile", action="store_true", help="cProfile the timed regions instead (stderr)"
    )
    ap.add_argument("--profile-top", type=int, default=15)
    args = ap.parse_args(argv)
    which = parse_only(args.only)
    paths = parse_paths(args.paths) if args.paths is not None else None
    s = QUICK if args.quick else FULL
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.profile:
        profile(which, s, args.profile_top)
        return 0
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 - closed below
    em = Emitter(args.json, out)
    em.emit(
        "env",
        {"kvreuse": kvreuse.__version__, "python": platform.python_version()},
        "",
        cpus=os.cpu_count(),
        machine=platform.machine(),
        loadavg=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        quick=args.quick,
        only=which,
        core=native.describe(),
        paths=paths or [native.ACTIVE],
    )
    anchor = args.with_anchor
    live = paths or [native.ACTIVE]
    per_round: dict[str, list[list[Ratio]]] = {p: [] for p in live}
    for rnd in range(args.rounds):
        # with --paths every record names its own path (run_path); else this process's
        em.context = {"round": rnd} if paths else {"round": rnd, "path": native.ACTIVE}
        # memory is deterministic: measured in the first round only (on both sides)
        todo = [b for b in which if rnd == 0 or b != "memory"]
        if args.rounds > 1:
            log(f"---- round {rnd + 1} of {args.rounds}: {', '.join(todo)}")
        if paths is None:
            run_round(em, todo, s)
        else:
            order = live if rnd % 2 == 0 else live[::-1]  # alternate which path goes first
            live = [p for p in order if run_path(em, p, todo, args.quick)]
        if anchor and todo and live:
            recs = run_anchor(
                em, todo, args.quick, args.anchor_dir, args.anchor_python, args.anchor_repeat
            )
            if recs is None:
                anchor = False
            else:
                for p in live:
                    per_round[p].append(round_ratios(PathView(em, p), recs, rnd))
    em.context = {}
    for p, rows in per_round.items():
        if rows and p in live:
            emit_ratios(PathView(em, p), rows)
    if out is not None:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
