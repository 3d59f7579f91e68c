"""The events benchmark runs and prints well-formed JSON lines (numbers are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "events_bench.py"


def test_events_bench_quick_emits_json_lines() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert records, proc.stderr
    cycles = {
        (r["params"]["geometry"], r["params"]["publisher"])
        for r in records
        if r["metric"] == "request_cycle_us"
    }
    for geometry in ("attention-16", "hybrid-dcp4"):
        for setting in ("off", "take", "groups", "legacy", "routable"):
            assert (geometry, setting) in cycles
    sent = [r for r in records if r["metric"] == "payload_bytes_per_request"]
    assert len(sent) == 6 and all(r["value"] > 0 for r in sent)
