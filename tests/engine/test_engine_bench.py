"""The engine benchmark runs and prints well-formed JSON lines (numbers are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_bench.py"


def test_engine_bench_emits_json_lines() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--json", "--prompt-tokens", "300"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    recs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert recs and all({"metric", "value", "unit", "params"} <= r.keys() for r in recs)
    runs = {r["params"]["run"]: r["params"] for r in recs if "run" in r["params"]}
    assert runs["cold"]["cached_tokens"] == 0 and runs["cold"]["computed_tokens"] == 300
    # identical resend on the DCP4 hybrid (u = 8): floor((300 - 1) / 8) * 8 = 296 reused
    assert runs["warm_identical"]["cached_tokens"] == 296
    assert runs["warm_extended"]["cached_tokens"] == 296  # 300 mod 8 = 4: the state is at 296
