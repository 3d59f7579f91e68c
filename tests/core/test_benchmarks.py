"""The benchmark runs and prints well-formed JSON lines (its numbers are not asserted: speed is
measured by benchmarks, never by timed tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "core_bench.py"


def test_core_bench_quick_emits_json_lines() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--json", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert records, proc.stderr
    for rec in records:
        assert {"metric", "value", "unit", "params"} <= rec.keys()
    by_metric: dict[str, list[dict]] = {}
    for rec in records:
        by_metric.setdefault(rec["metric"], []).append(rec)
    algos = {r["params"]["algo"] for r in by_metric["hash_tokens_per_s"]}
    assert "sha256" in algos
    for name in (
        "lookup_full_hit_us",
        "lookup_miss_us",
        "request_cycle_us",
        "bytes_per_cached_block",
        "pool_bytes_per_block",
    ):
        assert all(r["value"] > 0 for r in by_metric[name]), name
    # the workloads did what they claim: a full hit of a 8,192-token prompt at unit 16 is 8,176
    assert by_metric["lookup_full_hit_us"][0]["params"]["hit_tokens"] == 8192 - 16
    assert by_metric["lookup_miss_us"][0]["params"]["hit_tokens"] == 0
    assert {r["params"]["events"] for r in by_metric["request_cycle_us"]} == {False, True}
