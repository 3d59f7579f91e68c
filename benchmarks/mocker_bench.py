#!/usr/bin/env python3
"""kvreuse's simulator and NVIDIA Dynamo's mocker, side by side on Mooncake traces.

    .venv/bin/python benchmarks/mocker_bench.py --conversation conversation_trace.jsonl \\
        --synthetic synthetic_trace.jsonl [--cases NAME,…] [--limit N] [--rounds 3]

For each case both tools replay the same trace file (its first `limit` records) on the same
pool of 512-token blocks, 256 sequences and 8,192 batched tokens:

* the mocker (`dynamo._core.run_mocker_trace_replay`, offline, from ai-dynamo-runtime in
  `.venv-mocker`, built by `bash benchmarks/mocker/setup_venv.sh`) through
  benchmarks/mocker/replay.py, which also writes its per-request records;
* kvreuse: `kvreuse simulate --trace mooncake` (the trace imported in its own process) on an
  attention-only geometry file written for the case, with a cost model fitted to the mocker's
  single-request timings on the same pool (`replay.py calibrate`, not timed).

Each is a child process; its CPU time (user + system, every thread) is what `os.wait4`
reports for it. Rounds alternate which tool goes first. Prints JSON lines on stdout: `env`,
`settings` (everything the two runs share and every setting in which they differ), then one
`case` line per case: both tools' CPU seconds (median and each round), `ratio` = mocker CPU /
kvreuse CPU (medians; ≥ 1.0: kvreuse is at least as fast), both hit rates (first admissions),
and how many requests got the same cached tokens from both. The traces are not in the
repository: Mooncake's FAST'25 traces (github.com/kvcache-ai/Mooncake, FAST25-release/traces).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REPLAY = ROOT / "benchmarks" / "mocker" / "replay.py"
MOCKER_PYTHON = ROOT / ".venv-mocker" / "bin" / "python"
SETUP = "bash benchmarks/mocker/setup_venv.sh"
BLOCK, SEQS, BUDGET = 512, 256, 8192


@dataclass(frozen=True)
class Case:
    trace: str  # "conversation" or "synthetic": which --TRACE option names the file
    limit: int | None  # the first N records
    pool_tokens: int | None  # None: room for every block of every request


CASES = {
    "conversation-1000-3m": Case("conversation", 1000, 3_000_000),
    "synthetic-all": Case("synthetic", None, None),
    "conversation-all": Case("conversation", None, None),
}


class BenchError(Exception):
    """Bad input or a failed child: one line, exit code 2."""


def emit(metric: str, **fields: Any) -> None:
    print(json.dumps({"metric": metric, **fields}), flush=True)


def run_child(cmd: list[str], stdout: Any) -> tuple[float, float]:
    """Run `cmd`; its CPU seconds (user + system, every thread) and its wall seconds. A
    failure is a BenchError carrying the child's last stderr line."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = proc.stderr.read().decode("utf-8", "replace")
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - start
    code = os.waitstatus_to_exitcode(status)
    proc.returncode = code
    if code != 0:
        last = err.strip().splitlines()[-1] if err.strip() else f"exit code {code}"
        raise BenchError(f"{Path(cmd[1]).name} {' '.join(cmd[2:5])}: {last}")
    return usage.ru_utime + usage.ru_stime, wall


def slice_trace(src: Path, dst: Path, limit: int | None) -> tuple[int, int, int, int]:
    """Copy the first `limit` records of `src` to `dst`; their count, prompt tokens, the
    blocks that hold every request's prompt and output at once, and the longest request."""
    requests = prompt = blocks = longest = 0
    with src.open("rb") as f, dst.open("wb") as out:
        for line in f:
            if limit is not None and requests >= limit:
                break
            try:
                rec = json.loads(line)
                tokens = int(rec["input_length"]) + max(1, int(rec["output_length"]))
                prompt += int(rec["input_length"])
            except (ValueError, KeyError, TypeError) as e:
                msg = f"{src}: line {requests + 1} is not a Mooncake record ({e!r})"
                raise BenchError(msg) from None
            out.write(line)
            requests += 1
            blocks += -(-tokens // BLOCK)
            longest = max(longest, tokens)
    if not requests:
        raise BenchError(f"{src}: no records")
    return requests, prompt, blocks, longest


def calibrate(python: Path, blocks: int) -> dict[str, float]:
    """The mocker's single-request timings on `blocks` blocks, and kvreuse's [cost] fitted to
    them: a prefill of p tokens costs p / rate + chunk (exact at 512 and 8,192 tokens), a
    decode step the lone decoder's inter-token latency."""
    cmd = [str(python), str(REPLAY), "calibrate", "--blocks", str(blocks)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"replay.py calibrate: {proc.stderr.strip()}")
    t = json.loads(proc.stdout)
    small, large = t[f"ttft_ms_{BLOCK}"] / 1e3, t[f"ttft_ms_{BUDGET}"] / 1e3
    per_token = (large - small) / (BUDGET - BLOCK)
    return {
        **{f"mocker_{k}": v for k, v in t.items()},
        "prefill_tokens_per_s": 1 / per_token,
        "prefill_chunk_s": small - BLOCK * per_token,
        "decode_step_s": t[f"itl_ms_{BLOCK}"] / 1e3,
    }


def geometry_toml(num_blocks: int, max_model_len: int, cost: dict[str, float]) -> str:
    """kvreuse's side: one full-attention group of 512-token blocks (hash unit = block)."""
    return (
        "[cache]\n"
        f"num_blocks = {num_blocks}  # the mocker's num_gpu_blocks + the null block\n"
        f"max_num_seqs = {SEQS}\n"
        f"max_num_batched_tokens = {BUDGET}\n"
        f"max_model_len = {max_model_len}\n"
        "\n[[groups]]\n"
        'kind = "full"\n'
        f"block_size = {BLOCK}\n"
        "\n[cost]\n"
        f"prefill_tokens_per_s = {cost['prefill_tokens_per_s']!r}\n"
        f"prefill_chunk_s = {cost['prefill_chunk_s']!r}\n"
        f"decode_step_s = {cost['decode_step_s']!r}\n"
    )


def hybrid_toml(max_model_len: int, cost: dict[str, float]) -> str:
    """`--hybrid`: the hybrid-dcp4 preset (8,192-token DCP-4 attention pages, 256-token
    recurrent states, hash unit 256), which the mocker cannot model, on the same cost model;
    its pool is set on the command line (the same tokens as the case's)."""
    from kvreuse import deployment

    return (
        deployment.geometry_toml(deployment.preset("hybrid-dcp4")).replace(
            "[cache]\n", f"[cache]\nmax_model_len = {max_model_len}\n", 1
        )
        + "\n[cost]\n"
        + f"prefill_tokens_per_s = {cost['prefill_tokens_per_s']!r}\n"
        + f"prefill_chunk_s = {cost['prefill_chunk_s']!r}\n"
        + f"decode_step_s = {cost['decode_step_s']!r}\n"
    )


def run_mocker(python: Path, trace: Path, blocks: int, tmp: Path) -> dict[str, Any]:
    report = tmp / "mocker-requests.jsonl"
    cmd = [str(python), str(REPLAY), "run", str(trace), "--blocks", str(blocks)]
    out_path = tmp / "mocker-out.json"
    with out_path.open("w") as out:
        cpu, wall = run_child([*cmd, "--report", str(report)], out)
    result = json.loads(out_path.read_text())
    rows = [json.loads(line) for line in report.open()]
    first = [r["admission_history"][0]["reused_input_tokens"] for r in rows]
    result.update(
        cpu_s=cpu,
        wall_s=wall,
        hits=sum(first),
        queries=sum(r["input_length"] for r in rows),
        preemptions=sum(r["readmission_count"] for r in rows),
        per_request=Counter(
            (_key(r["arrival_time_ms"], r["input_length"]), c)
            for r, c in zip(rows, first, strict=True)
        ),
    )
    return result


def run_kvreuse(
    trace: Path, geometry: Path, tmp: Path, keys: list[Any], pool: list[str] | None = None
) -> dict[str, Any]:
    """`kvreuse simulate --trace mooncake` on the trace, a child process (`pool`: options that
    set its pool, as --hybrid's runs need)."""
    kvreuse = [sys.executable, "-m", "kvreuse"]
    out_dir = tmp / "kvreuse-out"
    sim = [*kvreuse, "simulate", str(geometry), str(trace), "--trace", "mooncake"]
    sim += ["--out", str(out_dir), *(pool or [])]
    sim += ["--no-compare", "--no-plots", "--quiet", "--json"]
    summary_path = tmp / "kvreuse-summary.json"
    with summary_path.open("w") as out:
        sim_cpu, sim_wall = run_child(sim, out)
    summary = json.loads(summary_path.read_text())
    with (out_dir / "requests.jsonl").open() as f:
        rows = [json.loads(line) for line in f]
    return {
        "cpu_s": sim_cpu,
        "wall_s": sim_wall,
        "hits": summary["hits"],
        "queries": summary["queries"],
        "preemptions": summary["preemptions"],
        "reconciled": summary["reconciled"],
        "per_request": Counter((keys[int(r["id"][1:]) - 1], r["cached_tokens"]) for r in rows),
    }


def _key(arrival_ms: float, input_length: int) -> tuple[float, int]:
    """A request's identity across the two outputs: the mocker's records carry no trace line,
    so (arrival, prompt length); the few ties are compared as multisets."""
    return (round(float(arrival_ms), 3), int(input_length))


def trace_keys(trace: Path) -> list[tuple[float, int]]:
    """Each record's key, its arrival counted from the trace's first (as the mocker does)."""
    with trace.open() as f:
        records = [(rec["timestamp"], rec["input_length"]) for rec in map(json.loads, f)]
    origin = min(t for t, _ in records)
    return [_key(t - origin, n) for t, n in records]


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": round(statistics.median(values), 3), "rounds": [round(v, 3) for v in values]}


def run_case(name: str, case: Case, trace: Path, ns: argparse.Namespace, tmp: Path) -> None:
    """Both tools on one case, `ns.rounds` alternating rounds; one `case` line."""
    tmp.mkdir()
    sliced = tmp / "trace.jsonl"
    limits = [x for x in (case.limit, ns.limit) if x is not None]
    requests, prompt, all_blocks, longest = slice_trace(trace, sliced, min(limits, default=None))
    pool = all_blocks if case.pool_tokens is None else -(-case.pool_tokens // BLOCK)
    cost = calibrate(ns.mocker_python, pool)
    geometry = tmp / "geometry.toml"
    geometry.write_text(geometry_toml(pool + 1, max(longest, BUDGET), cost))
    keys = trace_keys(sliced)
    hybrid = tmp / "hybrid.toml"
    hybrid.write_text(hybrid_toml(max(longest, BUDGET), cost))
    fits = pool >= all_blocks
    hybrid_pool = ["--capacity-tokens", "inf" if fits else str(pool * BLOCK)]
    tools = ["mocker", "kvreuse", *(["hybrid"] if ns.hybrid else [])]
    runs: dict[str, list[dict[str, Any]]] = {tool: [] for tool in tools}
    for r in range(ns.rounds):
        print(f"{name}: round {r + 1} of {ns.rounds} …", file=sys.stderr, flush=True)
        for tool in tools if r % 2 == 0 else tools[::-1]:
            if tool == "mocker":
                runs[tool].append(run_mocker(ns.mocker_python, sliced, pool, tmp))
            elif tool == "kvreuse":
                runs[tool].append(run_kvreuse(sliced, geometry, tmp, keys))
            else:
                runs[tool].append(run_kvreuse(sliced, hybrid, tmp, keys, hybrid_pool))
    head = {"case": name, "trace": trace.name, "requests": requests, "prompt_tokens": prompt}
    head.update(pool_blocks=pool, pool_tokens=pool * BLOCK, fits=fits)
    extra = hybrid_fields(runs["kvreuse"], runs["hybrid"]) if ns.hybrid else {}
    emit("case", **head, **compare(runs["mocker"], runs["kvreuse"], keys), **extra, cost_model=cost)


def hybrid_fields(kv: list[dict[str, Any]], hyb: list[dict[str, Any]]) -> dict[str, Any]:
    """--hybrid: hybrid-dcp4's CPU seconds and hit rate, and its CPU over attention's (medians
    of the same rounds; ≤ 2 is the target)."""
    kv_cpu, hyb_cpu = [x["cpu_s"] for x in kv], [x["cpu_s"] for x in hyb]
    return {
        "hybrid_cpu_s": spread(hyb_cpu),
        "hybrid_over_attention": round(statistics.median(hyb_cpu) / statistics.median(kv_cpu), 4),
        "hybrid_hit_rate": round(hyb[0]["hits"] / hyb[0]["queries"], 6),
        "hybrid_reconciled": all(x["reconciled"] for x in hyb),
    }


def compare(mocker: list[dict[str, Any]], kv: list[dict[str, Any]], keys: list[Any]) -> dict:
    """The case line's measurements: CPU per tool and round, hit rates, per-request agreement
    (the first round's; `deterministic` says whether every round counted the same hits)."""
    m, k = mocker[0], kv[0]
    mocker_cpu, kv_cpu = [x["cpu_s"] for x in mocker], [x["cpu_s"] for x in kv]
    same_requests = Counter(key for key, _ in m["per_request"].elements()) == Counter(keys)
    return {
        "rounds": len(mocker),
        "mocker_cpu_s": spread(mocker_cpu),
        "kvreuse_cpu_s": spread(kv_cpu),
        "ratio": round(statistics.median(mocker_cpu) / statistics.median(kv_cpu), 4),
        # wall beside CPU: a child whose CPU exceeds its wall ran several threads at once
        "mocker_wall_s": spread([x["wall_s"] for x in mocker]),
        "kvreuse_wall_s": spread([x["wall_s"] for x in kv]),
        "mocker_replay_call_cpu_s": spread([x["call_cpu_s"] for x in mocker]),
        "mocker_hit_rate": round(m["hits"] / m["queries"], 6),
        "kvreuse_hit_rate": round(k["hits"] / k["queries"], 6),
        "mocker_hits": m["hits"],
        "kvreuse_hits": k["hits"],
        "queries": {"mocker": m["queries"], "kvreuse": k["queries"]},
        "hit_rates_equal": m["hits"] == k["hits"] and m["queries"] == k["queries"],
        "mocker_hit_rate_all_admissions": m["summary"]["prefix_cache_reused_ratio"],
        "agreement": {
            "compared": len(keys) if same_requests else None,
            "agree": (m["per_request"] & k["per_request"]).total() if same_requests else None,
        },
        "preemptions": {"mocker": m["preemptions"], "kvreuse": k["preemptions"]},
        "deterministic": len({x["hits"] for x in mocker}) == len({x["hits"] for x in kv}) == 1,
        "kvreuse_reconciled": all(x["reconciled"] for x in kv),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


DIFFERENCES = [
    "in-flight sharing: the mocker lets a request reuse blocks that another request is still "
    "computing (two requests of one prefix admitted in one step both count it); kvreuse "
    "publishes a page when the step that computed it commits, and defers a request whose "
    "prefix is being computed (defer_shared_prefix, at most max_defer_steps = 8 steps)",
    "decode cost: the mocker's decode step grows with the batch and with the share of the pool "
    "in use (its polynomial timing model); kvreuse's decode_step_s is one constant, the "
    "mocker's inter-token latency of one 512-token request decoding alone on the case's pool",
    "prefill cost: the mocker's is a polynomial of the step's tokens; kvreuse's is "
    "tokens / prefill_tokens_per_s + prefill_chunk_s per request chunk, fitted to the "
    "mocker's cold single-request TTFT at 512 and 8,192 tokens (exact there)",
    "pool: the mocker's num_gpu_blocks excludes the null block, kvreuse's num_blocks "
    "includes it, so kvreuse gets num_gpu_blocks + 1",
    "max_model_len: the mocker's is unset; kvreuse's is the case's longest request",
    "clock: the mocker's starts at the trace's first timestamp, kvreuse's at 0 (it idles until "
    "the first arrival; the gaps between arrivals are the same)",
    "input: the mocker reads the trace's block ids; kvreuse imports each record as a workload "
    "line in the simulating process, builds 512 tokens per id (the id, then a run shared by "
    "every block) and hashes each distinct block path once (SHA-256)",
    "per-request output: the mocker writes its records to report_jsonl_path, kvreuse its "
    "requests.jsonl (both timed)",
]


def settings(python: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.metadata as m; print(m.version('ai-dynamo-runtime'))",
        ],
        capture_output=True,
        text=True,
    )
    return {
        "block_size": BLOCK,
        "max_num_seqs": SEQS,
        "max_num_batched_tokens": BUDGET,
        "hit_rate": "first admissions: Σ cached prompt tokens / Σ prompt tokens (the mocker's "
        "admission_history[0], kvreuse's per-request stats and counters)",
        "shared": "vLLM scheduling (mocker backend vllm), prefix caching and chunked prefill on, "
        "FCFS, the newest running request preempted (mocker preemption_mode lifo), LRU eviction, "
        "arrivals at the trace's timestamps (mocker arrival_speedup_ratio 1, kvreuse time scale 1)",
        "mocker": {
            "ai_dynamo_runtime": proc.stdout.strip() or None,
            "call": "dynamo._core.run_mocker_trace_replay(replay_mode='offline', "
            "trace_format='mooncake', trace_block_size=512, report_jsonl_path=…)",
        },
        "kvreuse": "kvreuse simulate GEOMETRY.toml TRACE --trace mooncake "
        "--no-compare --no-plots --quiet --json (one full-attention group, block_size 512)",
        "cpu": "user + system seconds of each child process (os.wait4), interpreter start included",
        "differences": DIFFERENCES,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversation", type=Path, help="Mooncake's conversation_trace.jsonl")
    ap.add_argument("--synthetic", type=Path, help="Mooncake's synthetic_trace.jsonl")
    ap.add_argument("--cases", default=",".join(CASES), help="comma list (default: all)")
    ap.add_argument("--limit", type=int, default=None, help="the first N requests of a trace")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    ap.add_argument(
        "--hybrid",
        action="store_true",
        help="also run kvreuse on hybrid-dcp4 (the same requests, pool tokens and cost model)",
    )
    ap.add_argument("--mocker-python", type=Path, default=MOCKER_PYTHON, help="the mocker's venv")
    return ap.parse_args(argv)


def check_args(ns: argparse.Namespace) -> list[str]:
    """The selected cases, or a BenchError naming what is wrong."""
    names = [n for n in ns.cases.split(",") if n]
    if not names or any(n not in CASES for n in names):
        raise BenchError(f"--cases: expected a comma list of {', '.join(CASES)}, got {ns.cases!r}")
    if ns.rounds < 1 or (ns.limit is not None and ns.limit < 1):
        raise BenchError("--rounds and --limit must be at least 1")
    for name in names:
        option = CASES[name].trace
        path = getattr(ns, option)
        if path is None:
            raise BenchError(f"case {name} needs --{option} FILE (Mooncake's {option}_trace.jsonl)")
        if not path.is_file():
            raise BenchError(f"--{option}: no such file: {path}")
    if not ns.mocker_python.exists():
        raise BenchError(
            f"the mocker's venv is absent ({ns.mocker_python}): build it with `{SETUP}`"
        )
    return names


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    try:
        names = check_args(ns)
        load = [round(x, 2) for x in os.getloadavg()]
        emit("env", python=platform.python_version(), cpus=os.cpu_count(), loadavg=load)
        emit("settings", **settings(ns.mocker_python))
        with tempfile.TemporaryDirectory(prefix="mocker-bench-") as tmp:
            for name in names:
                case = CASES[name]
                run_case(name, case, getattr(ns, case.trace), ns, Path(tmp) / name)
    except BenchError as e:
        print(f"mocker_bench: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
