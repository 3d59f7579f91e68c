"""`kvreuse simulate` with memory tiers below the pool: hits come back from the host and the
store, their loads cost simulated time, and the options speak the size language."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvreuse.core import TierSpec
from kvreuse.deployment import Deployment, preset
from kvreuse.sim.cli import with_pool
from kvreuse.sim.generators import agent
from kvreuse.sim.run import CostModel, simulate
from kvreuse.sim.workload import load_workload
from kvreuse.tiering import with_tiers

AGENT = [json.dumps(x) for x in agent(8, 6, 64, 256, 32)]  # 8 sessions that outgrow the pool


def small() -> Deployment:
    return with_pool(preset("attention-16"), None, 3000)


def test_a_host_tier_gives_back_what_the_pool_evicted() -> None:
    wl = load_workload(AGENT)
    alone = simulate(small(), wl).summary
    host = simulate(replace(small(), tiers=(TierSpec("host", 2000),)), wl).summary
    assert alone["evicted_blocks"] > 0 and alone["hit_rate"] < 0.05
    assert host["reconciled"] and host["hit_rate"] > 10 * alone["hit_rate"]
    t = host["tiers"]["host"]
    assert t["loaded_blocks"] > 0 and 0 < t["hit_tokens"] <= host["hits"]
    assert t["hit_tokens"] <= t["loaded_blocks"] * 16  # a load gives a page or less of one
    assert t["load_seconds"] > 0 and host["tiers"]["demoted_blocks"] > 0


def test_the_load_time_is_the_cost_models() -> None:
    """Free loads and slow loads give the same hits; slow ones take simulated time."""
    wl = load_workload(AGENT)
    dep = replace(small(), tiers=(TierSpec("host", 2000),))
    free = simulate(dep, wl, CostModel(host_tokens_per_s=1e15, host_step_s=0.0)).summary
    slow = simulate(dep, wl, CostModel(host_tokens_per_s=1000.0, host_step_s=0.01)).summary
    assert free["hits"] == slow["hits"]
    tokens = slow["tiers"]["host"]["loaded_blocks"] * 16
    assert slow["tiers"]["host"]["load_seconds"] >= tokens / 1000.0
    assert slow["simulated_seconds"] > free["simulated_seconds"]


def test_a_small_host_sends_its_oldest_blocks_to_the_store() -> None:
    wl = load_workload(AGENT)
    dep = replace(small(), tiers=(TierSpec("host", 50), TierSpec("store", 2000)))
    s = simulate(dep, wl).summary
    assert s["tiers"]["host"]["held_blocks"] == 50
    assert s["tiers"]["store"]["loaded_blocks"] > 0


def test_tier_options_take_sizes_and_size_in_blocks_of_the_pool() -> None:
    dep = with_tiers(preset("attention-16"), 3_000_000, 10_000)
    assert [(t.name, t.num_blocks) for t in dep.tiers] == [("host", 187_500), ("store", 625)]
    assert with_tiers(dep, None, None) is dep


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvreuse", *args], cwd=cwd, capture_output=True, text=True
    )


def test_the_command_line_reports_each_tier(tmp_path: Path) -> None:
    (tmp_path / "w.jsonl").write_text("\n".join(AGENT) + "\n")
    args = ["simulate", "--geometry", "attention-16", "--capacity-tokens", "3K"]
    done = run_cli(*args, "--host-capacity", "32K", "w.jsonl", "--out", "o", "--no-plots",
                   "--quiet", "--json", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["tiers"]["host"]["capacity_blocks"] == 2000


@pytest.mark.parametrize("value", ["lots", "-3", "1.5"])
def test_a_bad_tier_size_is_one_line(tmp_path: Path, value: str) -> None:
    (tmp_path / "w.jsonl").write_text("\n".join(AGENT) + "\n")
    done = run_cli("simulate", "--host-capacity", value, "w.jsonl", cwd=tmp_path)
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert "--host-capacity" in line and "Traceback" not in done.stderr


def test_a_sweep_puts_the_tiers_under_every_case(tmp_path: Path) -> None:
    (tmp_path / "w.jsonl").write_text("\n".join(AGENT) + "\n")
    args = ["sweep", "w.jsonl", "--geometry", "attention-16", "--capacity", "3K,10K"]
    done = run_cli(*args, "--host-capacity", "32K", "--out", "s", "--no-plots", "--quiet",
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "s" / "sweep.json").read_text())["cases"]
    assert [r["tiers"]["host"]["capacity_blocks"] for r in rows] == [2000, 2000]
    assert all(r["tiers"]["host"]["hit_tokens"] > 0 for r in rows)


def test_the_tiers_benchmark_compares_routing_with_and_without_the_tiers(tmp_path: Path) -> None:
    """benchmarks/tiers_trace.py --replicas: one JSON line per routing, both reconciled, the
    tier-aware one with a host prediction (the figures themselves are not asserted)."""
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "tiers_trace.py"
    excerpt = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_excerpt.jsonl"
    wl = tmp_path / "wl.jsonl"
    imported = subprocess.run(
        [sys.executable, "-m", "kvreuse", "workload", "import", "mooncake", str(excerpt)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    wl.write_text(imported.stdout)
    cmd = [sys.executable, str(bench), str(wl), "--geometry", "hybrid-dcp4", "--replicas", "2"]
    cmd += ["--device", "200K", "--host", "1M"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [x["params"]["case"] for x in lines] == ["tier-aware", "device-only"]
    assert all(x["params"]["reconciled"] and 0 <= x["value"] <= 1 for x in lines)
    assert lines[0]["params"]["predicted_host_tokens"] is not None
    assert lines[1]["params"]["predicted_host_tokens"] is None


def test_a_sweep_compares_tier_setups_case_by_case(tmp_path: Path) -> None:
    """`--tiers` repeated: every (setup, capacity) is a case, and each equals `kvreuse simulate`
    run alone with that pool and those tiers; the table and the plot tell the setups apart."""
    (tmp_path / "w.jsonl").write_text("\n".join(AGENT) + "\n")
    args = ["sweep", "w.jsonl", "--geometry", "attention-16", "--capacity", "3K,10K"]
    setups = ["--tiers", "none", "--tiers", "host=32K", "--tiers", "host=4K,store=28K"]
    done = run_cli(*args, *setups, "--out", "s", "--quiet", "--jobs", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "s" / "sweep.json").read_text())["cases"]
    want = [
        (s, c) for s in ("device only", "host 32K", "host 4K + store 28K") for c in (3000, 10**4)
    ]
    assert [(r["tier_setup"], r["capacity_tokens"]) for r in rows] == want
    options = {
        "host 32K": ["--host-capacity", "32K"],
        "host 4K + store 28K": ["--host-capacity", "4K", "--store-capacity", "28K"],
    }
    for i, row in enumerate(rows):
        alone = [
            "simulate",
            "--geometry",
            "attention-16",
            "--capacity-tokens",
            str(row["capacity_tokens"]),
        ]
        alone += [
            *options.get(row["tier_setup"], []),
            "w.jsonl",
            "--out",
            f"a{i}",
            "--no-plots",
            "--quiet",
        ]
        assert run_cli(*alone, cwd=tmp_path).returncode == 0
        s = json.loads((tmp_path / f"a{i}" / "summary.json").read_text())
        assert (row["cached_tokens"], row["hit_rate"]) == (s["hits"], s["hit_rate"])
        assert row.get("tiers") == s.get("tiers")
    # the tiers give back what the small pool evicted
    by = {(r["tier_setup"], r["capacity_tokens"]): r for r in rows}
    assert by["host 32K", 3000]["cached_tokens"] > by["device only", 3000]["cached_tokens"]
    table = (tmp_path / "s" / "sweep.md").read_text()
    assert "| tiers " in table and "| from tiers |" in table and "| host 4K + store 28K |" in table
    assert (tmp_path / "s" / "hit_rate_vs_capacity.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        (["--tiers", "disk=3M"], "give none, or host=N and/or store=N"),
        (["--tiers", "host=3M,host=4M"], "give none, or host=N and/or store=N"),
        (["--tiers", "host=lots"], "--tiers: 'host=lots': host "),
        (["--tiers", "none", "--tiers", "none"], "a setup is given twice"),
        (["--tiers", "host=3M", "--host-capacity", "3M"], "leave out --host-capacity"),
    ],
)
def test_a_bad_tier_setup_is_one_line(tmp_path: Path, setup: list[str], words: str) -> None:
    (tmp_path / "w.jsonl").write_text("\n".join(AGENT) + "\n")
    done = run_cli("sweep", "w.jsonl", "--geometry", "attention-16", "--out", "s", *setup,
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], done.stderr
