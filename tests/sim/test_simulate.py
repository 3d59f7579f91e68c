"""The simulator run: the resend grid and agent checks, and reconciliation that fails loudly when
a counter is wrong."""

from __future__ import annotations

import itertools
import json

import pytest

from kvreuse.deployment import PRESETS, preset
from kvreuse.sim.generators import agent, resend_grid, shared_prefix
from kvreuse.sim.run import simulate
from kvreuse.sim.workload import load_workload

LENGTHS = [255, 256, 257, 2047, 2048, 2049, 4096, 8191, 8192, 8193]


def load(objs: list[dict]):
    return load_workload([json.dumps(o) for o in objs])


def test_resend_grid_on_the_dcp4_hybrid() -> None:
    res = simulate(preset("hybrid-dcp4"), load(resend_grid(LENGTHS)))
    rows = {r["id"]: r for r in res.requests}
    for p in LENGTHS:
        warm = (p - 1) // 256 * 256
        assert rows[f"cold-{p}"]["cached_tokens"] == 0
        assert rows[f"warm-{p}"]["cached_tokens"] == warm, p
        assert rows[f"appended-{p}"]["cached_tokens"] >= warm
    assert res.summary["reconciled"], res.summary["reconciliation"]


def test_64_turn_agent_reuses_what_the_previous_turn_computed() -> None:
    res = simulate(preset("hybrid-dcp4"), load(agent(1, 64, 64, 256, 32)))
    rows = res.requests
    assert rows[0]["cached_tokens"] == 0
    for prev, cur in itertools.pairwise(rows):
        computed = prev["prompt_tokens"] + prev["output_tokens"] - 1  # all but the last token
        assert cur["cached_tokens"] == computed // 256 * 256, cur["id"]
    assert res.summary["reconciled"]


def test_burst_summary_and_timeline() -> None:
    res = simulate(preset("attention-16"), load(shared_prefix(1024, 64, 16)))
    s = res.summary
    assert s["requests"] == 16 and s["hits"] > 0 and 0 < s["hit_rate"] < 1
    assert s["reconciled"] and res.timeline and s["simulated_seconds"] > 0
    assert all(r["ttft_estimate_s"] > 0 for r in res.requests)


def test_reconciliation_fails_when_a_counter_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvreuse.core import metrics

    real = metrics.snapshot

    def doctored(*args, **kwargs):  # a test double that over-reports hits by one token
        out = real(*args, **kwargs)
        out["prefix_cache_hits"] += 1
        return out

    monkeypatch.setattr(metrics, "snapshot", doctored)  # where the manager's metrics() reads it
    res = simulate(preset("attention-16"), load(resend_grid([100])))
    assert not res.summary["reconciled"]
    assert res.summary["reconciliation"]["cached_tokens_equal_hits"] is False


def test_cli_writes_outputs_and_exit_codes(tmp_path) -> None:
    import subprocess
    import sys

    wl = tmp_path / "w.jsonl"
    wl.write_text("\n".join(json.dumps(o) for o in resend_grid([300])) + "\n")
    run = [sys.executable, "-m", "kvreuse", "simulate"]
    out = subprocess.run(
        [*run, "--geometry", "hybrid-dcp4", str(wl), "--out", str(tmp_path / "o"), "--json"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["requests"] == 3 and summary["reconciled"]
    rows = [json.loads(x) for x in (tmp_path / "o" / "requests.jsonl").read_text().splitlines()]
    assert [r["cached_tokens"] for r in rows] == [0, 256, 256]
    assert "hit rate" in (tmp_path / "o" / "report.md").read_text()
    for png in ("cached_vs_prompt.png", "usage_hit_rate.png"):
        assert (tmp_path / "o" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    geo = tmp_path / "g.toml"
    geo.write_text(
        '[cache]\nnum_blocks = 64\nbogus = 1\n[[groups]]\nkind = "full"\nblock_size = 16\n'
    )
    bad = subprocess.run(
        [*run, str(geo), str(wl), "--out", str(tmp_path / "p")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown key(s) ['bogus']" in bad.stderr


@pytest.mark.parametrize("name", ["attention-16", "hybrid-dcp4"])
def test_burst_deferral_computes_the_shared_prompt_once(name: str) -> None:
    """32 requests with one 4,096-token system prompt arrive together.

    With deferral, the prefix is computed once and every other request waits for it and reuses
    all 4,096 tokens (a multiple of both presets' units): 4,096 + 32 · 64 prefill tokens. Without
    deferral the requests admitted in the first step compute the prefix again.
    """
    from kvreuse.sim.run import without_deferral

    wl = load(shared_prefix(4096, 64, 32))
    s = simulate(preset(name), wl).summary
    assert s["reconciled"] and s["deferral_waits"] > 0
    assert s["prefill_tokens_computed"] == 4096 + 32 * 64
    assert s["hits"] == 31 * 4096
    off = without_deferral(preset(name), wl)
    assert off["prefill_tokens_computed"] > s["prefill_tokens_computed"]
    assert off["prefill_tokens_computed"] + off["hits"] == s["prefill_tokens_computed"] + s["hits"]


def test_report_shows_the_deferral_comparison(tmp_path) -> None:
    from kvreuse.cli import main

    wl = tmp_path / "burst.jsonl"
    wl.write_text("\n".join(json.dumps(o) for o in shared_prefix(4096, 64, 8)) + "\n")
    out = tmp_path / "o"
    assert (
        main(
            [
                "simulate",
                "--geometry",
                "attention-16",
                str(wl),
                "--out",
                str(out),
                "--quiet",
                "--no-plots",
                "--json",
            ]
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    off = summary["without_deferral"]
    assert off["prefill_tokens_computed"] > summary["prefill_tokens_computed"] == 4096 + 8 * 64
    report = (out / "report.md").read_text()
    assert "## In-batch prefix sharing" in report
    assert f"| without deferral | {off['prefill_tokens_computed']:,} |" in report


def test_a_prompt_larger_than_the_cache_is_named_not_a_reconciliation_failure(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvreuse.cli import main

    wl = tmp_path / "big.jsonl"
    lines = [
        {"id": "big", "prompt": {"random": {"seed": 1, "len": 20_000}}, "max_tokens": 1},
        {"id": "after", "prompt": {"history": "big"}, "max_tokens": 1},
        {"id": "small", "prompt": {"random": {"seed": 2, "len": 100}}, "max_tokens": 1},
    ]
    wl.write_text("\n".join(json.dumps(o) for o in lines) + "\n")
    geo = tmp_path / "g.toml"
    geo.write_text('[cache]\nnum_blocks = 64\n[[groups]]\nkind = "full"\nblock_size = 16\n')
    out = tmp_path / "o"
    assert main(["simulate", str(geo), str(wl), "--out", str(out), "--quiet", "--no-plots"]) == 1
    err = capsys.readouterr().err.splitlines()
    # 63 usable blocks of 16 tokens: the longest request that fits holds 63 · 16 tokens. The
    # pool is the file's own choice, so the run goes on after saying so (a preset's is refused)
    assert err == [
        f"kvreuse simulate: 2 of 3 requests can never fit {geo}'s pool (64 blocks, 1,008 tokens) "
        "and would be refused; the largest, after, holds 1,251 blocks at its peak: "
        "--capacity-tokens 20.1K fits every request (inf: a pool that never evicts)",
        "kvreuse simulate: 2 requests exceed the cache (capacity 1,008 tokens): big, after; "
        "raise num_blocks or shorten them",
    ]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reconciled"] and summary["too_large"] == {"count": 2, "ids": ["big", "after"]}
    rows = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert [r["finish_reason"] for r in rows] == ["too_large", "too_large", "length"]
    # a refused request produced no token: no time estimate
    assert [r["ttft_estimate_s"] is None for r in rows] == [True, True, False]


def test_a_simulation_leaves_no_cyclic_garbage() -> None:
    """simulate() pauses the cycle collector; that is safe only while nothing builds cycles."""
    import gc

    wl = load(agent(2, 4, 32, 64, 8) + shared_prefix(300, 40, 8, max_tokens=4))
    gc.collect()
    gc.disable()
    try:
        res = simulate(preset("sliding-hybrid"), wl)
        del res
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_draft_acceptance_rate_drives_decode_steps() -> None:
    """With drafts on, every accepted draft saves a decode step; outputs and reuse don't change."""
    from kvreuse.deployment import load_geometry

    dep = load_geometry(
        '[cache]\nnum_blocks = 2048\nspec_mode = "lookahead"\nlookahead_tokens = 1\n'
        "num_spec_tokens = 3\n"
        '[[groups]]\nkind = "full"\nblock_size = 16\n'
    )
    wl = load(shared_prefix(256, 32, 4, max_tokens=40))
    runs = {rate: simulate(dep, wl, draft_accept_rate=rate) for rate in (0.0, 1.0)}
    none, every = runs[0.0].summary, runs[1.0].summary
    assert none["reconciled"] and every["reconciled"]
    assert every["steps"] < none["steps"]
    assert none["hits"] == every["hits"]
    assert all(r["output_tokens"] == 40 for run in runs.values() for r in run.requests)


def test_peak_usage_of_an_evicting_run_is_its_busiest_step() -> None:
    """Usage is sampled where it peaks (after a step's allocations), not after the finished
    requests released their blocks, which made an evicting run report 0 %."""
    from kvreuse.sim.generators import pressure

    res = simulate(preset("attention-16"), load(pressure(None, 1024, 2, geometry="attention-16")))
    s = res.summary
    assert s["evicted_blocks"] > 0 and s["reconciled"]
    usage = [u for _, u, _ in res.timeline]
    assert s["peak_usage"] > 0 and s["peak_usage"] == max(usage)
    # one 1,024-token sequence at a time: its 64 pages of the 8,191 usable blocks
    assert s["peak_usage"] == 64 / 8191


def test_pressure_evicts_on_the_dcp4_hybrid() -> None:
    from kvreuse.sim.generators import pressure

    s = simulate(preset("hybrid-dcp4"), load(pressure(None, 8192, 2))).summary
    assert s["reconciled"] and s["evicted_blocks"] > 1000
    assert 0 < s["hit_rate"] < 0.5  # the replay finds the newest sequences, not the oldest


@pytest.mark.parametrize("name", ["hybrid-dcp4", "sliding-hybrid", "attention-16"])
def test_resend_grid_warm_ttft_is_below_cold(name: str) -> None:
    """A warm resend computes only what it does not reuse; the grid runs one request at a
    time, so its TTFT is that compute, not the queue behind other lengths."""
    res = simulate(preset(name), load(resend_grid(LENGTHS)))
    rows = {r["id"]: r for r in res.requests}
    for p in LENGTHS:
        cold, warm = rows[f"cold-{p}"], rows[f"warm-{p}"]
        assert cold["queue_s"] == warm["queue_s"] == 0
        assert warm["ttft_estimate_s"] <= cold["ttft_estimate_s"], p
        if p >= 2048:  # nearly all reused: at least 4 × faster under the cost model
            assert warm["ttft_estimate_s"] < cold["ttft_estimate_s"] / 4, p


@pytest.mark.parametrize("name", sorted(n for n in PRESETS if n.startswith("tiny-")))
def test_the_default_resend_grid_runs_on_every_tiny_preset(name: str) -> None:
    s = simulate(preset(name), load(resend_grid(LENGTHS))).summary
    assert s["reconciled"] and s["too_large"]["count"] == 0 and s["requests"] == 30


def test_the_spec_presets_speculate() -> None:
    wl = load(shared_prefix(64, 16, 2, max_tokens=40))
    steps = {
        r: simulate(preset("tiny-spec-drop"), wl, draft_accept_rate=r).summary["steps"]
        for r in (0.0, 1.0)
    }
    assert steps[1.0] < steps[0.0]  # accepted drafts save decode steps


def test_a_recurrent_only_geometry_simulates_with_an_unbounded_capacity() -> None:
    from kvreuse.deployment import load_geometry

    dep = load_geometry(
        '[cache]\nnum_blocks = 16\n[[groups]]\nkind = "recurrent"\nblock_size = 16\n'
    )
    s = simulate(dep, load(resend_grid([100]))).summary
    assert s["reconciled"] and s["capacity_tokens"] is None


def test_rows_reach_a_sink_in_workload_order_and_are_not_kept() -> None:
    wl = load(agent(3, 4, 16, 32, 4) + shared_prefix(100, 20, 6, max_tokens=3))
    got: list[str] = []
    res = simulate(preset("attention-16"), wl, sink=lambda row: got.append(row["id"]))
    assert got == [w.request_id for w in wl] and res.requests == []
    assert res.tally.num_rows == len(wl) and res.summary["reconciled"]


def test_the_summary_table_has_a_row_per_kind_not_per_request(tmp_path) -> None:
    from pathlib import Path

    from kvreuse.sim.report import summary_table
    from kvreuse.sim.tally import MAX_KINDS

    res = simulate(preset("attention-16"), load(shared_prefix(64, 16, 300)))
    table = summary_table("attention-16", res, Path("o")).splitlines()
    assert [line.split()[:2] for line in table[1:2]] == [["p*", "300"]]
    assert len(table) == 7  # kinds, note, blank, hit rate, pool, reconciliation
    many = [
        {"id": f"{chr(97 + i)}{chr(97 + i)}-1", "prompt": {"tokens": [1, 2]}, "max_tokens": 1}
        for i in range(26)
    ]
    res = simulate(preset("attention-16"), load(many))
    kinds = list(res.tally.kinds)
    assert len(kinds) == MAX_KINDS and kinds[-1] == "(other)"
    assert res.tally.kinds["(other)"].num_requests == 26 - (MAX_KINDS - 1)
