"""`core_bench.py --paths native,pure` runs each core path in its own subprocess and tags every
record with it (numbers are not asserted: speed is measured by benchmarks, not by tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvreuse.core import native

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "core_bench.py"


def _run(*args: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--json", "--quick", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_both_paths_report_side_by_side_with_memory_on_each() -> None:
    records = _run("--only", "hash,memory", "--paths", "native,pure", "--rounds", "2")
    unavailable = {r["params"]["path"] for r in records if r["metric"] == "path_unavailable"}
    assert unavailable <= {"native"}  # only when the kernels were not built
    paths = ["pure"] if unavailable else ["native", "pure"]
    for path in paths:
        mine = [r for r in records[1:] if r["params"].get("path") == path]
        memory = [r for r in mine if r["metric"] == "bytes_per_cached_block"]
        assert len(memory) == 1 and memory[0]["value"] > 0, path  # first round only
        hashes = [r for r in mine if r["metric"] == "hash_tokens_per_s"]
        assert {r["params"]["round"] for r in hashes} == {0, 1}, path
    assert all("path" in r["params"] for r in records)


def test_without_paths_records_name_this_process_path() -> None:
    records = _run("--only", "memory")
    assert {r["params"]["path"] for r in records} == {native.ACTIVE}


def test_a_bad_paths_value_is_one_clear_error() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--json", "--quick", "--paths", "native,fast"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and proc.stdout == ""
    assert (
        proc.stderr.strip() == "--paths: expected a comma list of native, pure, got 'native,fast'"
    )
