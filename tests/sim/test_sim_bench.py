"""sim_bench runs and prints well-formed JSON lines (its numbers are not asserted: speed is
measured by benchmarks, never by timed tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_sim_bench_reports_each_preset_and_says_when_the_anchor_is_missing(
    tmp_path: Path,
) -> None:
    sim_bench = BENCHMARKS / "sim_bench.py"
    missing = str(tmp_path / "no-such-python")
    cmd = [sys.executable, str(sim_bench), "--json", "--requests", "30"]
    proc = subprocess.run(
        [*cmd, "--anchor", "--anchor-python", missing],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    runs = [r for r in records if r["metric"] == "sim_requests_per_s"]
    assert [r["params"]["preset"] for r in runs] == ["attention-16", "hybrid-dcp4"]
    for r in runs:
        assert r["value"] > 0 and r["params"]["reconciled"] is True
        # half of every prompt is the shared prefix: reused, and nothing beyond it
        assert 0.3 < r["params"]["hit_rate"] <= 0.5
    assert records[-1]["metric"] == "anchor_unavailable"
    assert "no-such-python" in records[-1]["params"]["reason"]


def test_sim_memory_reports_the_peak_of_each_preset() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "sim_memory.py"), "--json", "--requests", "200"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["params"]["preset"] for r in records] == ["attention-16", "hybrid-dcp4"]
    for r in records:
        assert r["metric"] == "sim_peak_rss_mib" and r["unit"] == "MiB"
        assert r["value"] >= r["params"]["before_run_mib"] > 0 and r["params"]["reconciled"]
