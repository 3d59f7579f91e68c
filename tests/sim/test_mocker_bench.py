"""benchmarks/mocker_bench.py runs kvreuse's simulator and NVIDIA Dynamo's mocker (in
`.venv-mocker`) on the same Mooncake trace excerpts and pool: its JSON lines have their shape,
and where every request fits the pool both tools count the same cached tokens, request by
request. Speed is the benchmark's to measure, not the test's: only its presence is checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "mocker_bench.py"
DATA = ROOT / "tests" / "data"
MOCKER_PYTHON = ROOT / ".venv-mocker" / "bin" / "python"
TRACES = [
    "--conversation",
    str(DATA / "mooncake_conversation_excerpt.jsonl"),
    "--synthetic",
    str(DATA / "mooncake_synthetic_excerpt.jsonl"),
]

needs_mocker = pytest.mark.needs(
    MOCKER_PYTHON.exists(), "Dynamo's mocker venv", "bash benchmarks/mocker/setup_venv.sh"
)


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(BENCH), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@needs_mocker
def test_both_tools_report_side_by_side_and_agree_where_everything_fits() -> None:
    proc = _bench(*TRACES, "--rounds", "1")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["metric"] for r in records] == ["env", "settings", "case", "case", "case"]
    settings = records[1]
    assert settings["block_size"] == 512 and settings["mocker"]["ai_dynamo_runtime"]
    assert len(settings["differences"]) >= 3
    cases = records[2:]
    assert [c["case"] for c in cases] == [
        "conversation-1000-3m",
        "synthetic-all",
        "conversation-all",
    ]
    for c in cases:
        for tool in ("mocker", "kvreuse"):
            cpu = c[f"{tool}_cpu_s"]
            assert len(cpu["rounds"]) == 1 and cpu["median"] == cpu["rounds"][0] > 0, c["case"]
            wall = c[f"{tool}_wall_s"]  # a child's wall time covers its start: never zero
            assert len(wall["rounds"]) == 1 and wall["median"] == wall["rounds"][0] > 0, c["case"]
        # the ratio is of the medians before they are rounded to the printed 3 decimals
        m, k = c["mocker_cpu_s"]["median"], c["kvreuse_cpu_s"]["median"]
        assert (m - 5e-4) / (k + 5e-4) <= c["ratio"] <= (m + 5e-4) / (k - 5e-4), c["case"]
        assert c["requests"] == 30 and c["fits"], c["case"]  # 30 records, a pool for all
        assert c["queries"] == {"mocker": c["prompt_tokens"], "kvreuse": c["prompt_tokens"]}
        assert c["mocker_hits"] > 0 and c["kvreuse_hits"] == c["mocker_hits"], c["case"]
        assert c["hit_rates_equal"] and c["kvreuse_hit_rate"] == c["mocker_hit_rate"]
        assert c["agreement"] == {"compared": 30, "agree": 30}, c["case"]
        assert c["kvreuse_reconciled"] and c["deterministic"]


@needs_mocker
def test_limit_takes_the_first_requests_of_each_trace() -> None:
    proc = _bench(*TRACES, "--rounds", "1", "--cases", "conversation-all", "--limit", "10")
    assert proc.returncode == 0, proc.stderr
    (case,) = [r for r in map(json.loads, proc.stdout.splitlines()) if r["metric"] == "case"]
    assert case["requests"] == 10 and case["agreement"]["compared"] == 10
    assert "hybrid_cpu_s" not in case  # only with --hybrid


@needs_mocker
def test_hybrid_runs_kvreuse_on_hybrid_dcp4_in_the_same_rounds() -> None:
    args = ["--rounds", "2", "--cases", "conversation-all", "--limit", "10", "--hybrid"]
    proc = _bench(*TRACES, *args)
    assert proc.returncode == 0, proc.stderr
    (case,) = [r for r in map(json.loads, proc.stdout.splitlines()) if r["metric"] == "case"]
    hyb, att = case["hybrid_cpu_s"], case["kvreuse_cpu_s"]
    assert len(hyb["rounds"]) == len(att["rounds"]) == 2 and min(hyb["rounds"]) > 0
    h, k = hyb["median"], att["median"]  # (rounded to 3 decimals; the ratio is not)
    assert (h - 5e-4) / (k + 5e-4) <= case["hybrid_over_attention"] <= (h + 5e-4) / (k - 5e-4)
    assert case["hybrid_reconciled"] and 0 < case["hybrid_hit_rate"] < 1


def test_a_missing_trace_is_one_error_line() -> None:
    proc = _bench("--conversation", str(DATA / "absent.jsonl"), "--cases", "conversation-all")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == f"mocker_bench: --conversation: no such file: {DATA}/absent.jsonl"


def test_a_case_without_its_trace_and_an_unknown_case_are_one_error_line_each() -> None:
    proc = _bench("--cases", "synthetic-all")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        "mocker_bench: case synthetic-all needs --synthetic FILE (Mooncake's synthetic_trace.jsonl)"
    )
    proc = _bench(*TRACES, "--cases", "synthetic")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "--cases: expected a comma list of conversation-1000-3m" in proc.stderr


def test_a_missing_mocker_venv_names_its_setup_script() -> None:
    proc = _bench(*TRACES, "--mocker-python", str(ROOT / "absent" / "python"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().endswith("build it with `bash benchmarks/mocker/setup_venv.sh`")
