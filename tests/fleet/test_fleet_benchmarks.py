"""fleet_bench and fleet_mooncake run and print what they claim (their numbers are not asserted:
speed is measured by benchmarks, never by timed tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_fleet_bench_reports_a_run_and_says_when_the_trace_is_missing(tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCHMARKS / "fleet_bench.py"), "--requests", "40"]
    cmd += ["--replicas", "3", "--capacity-tokens", "200000", "--trace", str(tmp_path / "none")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    run, missing = records
    assert run["metric"] == "fleet_sim_wall_s" and run["value"] > 0
    params = run["params"]
    assert params["requests"] == 40 and params["replicas"] == 3 and params["reconciled"]
    assert 0 < params["hit_rate"] < 1 and params["router_us_per_request"] > 0
    assert missing["metric"] == "trace_unavailable"
    assert "cannot read the trace" in missing["params"]["reason"]


def test_fleet_mooncake_tabulates_and_plots_local_against_pooled(tmp_path: Path) -> None:
    """A small trace in Mooncake's format: ten documents, each asked about by many requests
    spread over time, so that a per-node cache misses what a pooled one keeps."""
    trace = tmp_path / "trace.jsonl"
    lines = []
    for i in range(60):
        doc = i % 10
        ids = [1000 * doc + j for j in range(4)] + [100_000 + i]
        record = {"timestamp": 500 * i, "input_length": 5 * 512 - 100, "output_length": 4}
        lines.append(json.dumps({**record, "hash_ids": ids}))
    trace.write_text("\n".join(lines) + "\n")
    plot, out = tmp_path / "plot.png", tmp_path / "runs.json"
    cmd = [sys.executable, str(BENCHMARKS / "fleet_mooncake.py"), "--synthetic", str(trace)]
    cmd += [
        "--replicas",
        "3",
        "--capacity-tokens",
        "100000",
        "--plot",
        str(plot),
        "--json",
        str(out),
    ]
    cmd += ["--policy", "round-robin", "--policy", "exact"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    table = proc.stdout.splitlines()
    assert table[0].startswith("| policy | synthetic: local | synthetic: with store")
    assert [row.split(" | ")[0] for row in table[2:]] == ["| round-robin", "| exact"]
    runs = json.loads(out.read_text())
    rr, rr_store, exact, _ = runs
    cases = [(r["policy"], r["case"]) for r in runs[:2]]
    assert cases == [("round-robin", "local"), ("round-robin", "store")]
    assert rr_store["hit_rate"] > rr["hit_rate"]  # it loads what other replicas computed
    assert rr_store["tiers"]["store"]["hit_tokens"] > 0
    assert exact["hit_rate"] > rr["hit_rate"]
    assert all(r["reconciled"] for r in runs)
    assert plot.stat().st_size > 10_000
