"""benchmarks/trace_bench.py runs a trace end to end (import, then simulate, as a user does) and
reports the simulator's reuse beside an independent count from the trace's ids; with room for
everything the two agree. (Its times are measured, never asserted.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"


@pytest.mark.parametrize(
    ("fmt", "name"),
    [
        ("mooncake", "mooncake_conversation_excerpt.jsonl"),
        ("bailian", "bailian_schema_excerpt.jsonl"),
    ],
)
def test_the_trace_benchmark_reuses_what_the_trace_ids_allow(fmt: str, name: str) -> None:
    trace = DATA / name
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "trace_bench.py"), str(trace), "--format", fmt],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    records = {r["metric"]: r for r in map(json.loads, done.stdout.splitlines())}
    recs = [json.loads(line) for line in trace.read_text().splitlines()]
    sim = records["simulate_wall_s"]["params"]
    assert sim["requests"] == len(recs) and sim["queries"] == sum(r["input_length"] for r in recs)
    assert sim["reconciled"] and sim["evicted_blocks"] == 0
    assert sim["hits"] == sim["trace_reuse"] > 0
    assert records["import_wall_s"]["params"]["prompt_tokens"] == sim["queries"]
