"""The simulator run: the resend grid and agent checks, and reconciliation that fails loudly when
a counter is wrong."""

from __future__ import annotations

import itertools
import json

import pytest

from kvreuse.deployment import preset
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

    monkeypatch.setattr(metrics, "snapshot", doctored)
    import kvreuse.core.manager as manager

    monkeypatch.setattr(manager, "snapshot", doctored)
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


def test_a_prompt_larger_than_the_cache_fails_the_run_loudly(tmp_path) -> None:
    from kvreuse.cli import main

    wl = tmp_path / "big.jsonl"
    lines = [
        {"id": "big", "prompt": {"random": {"seed": 1, "len": 20_000}}, "max_tokens": 1},
        {"id": "after", "prompt": {"history": "big"}, "max_tokens": 1},
    ]
    wl.write_text("\n".join(json.dumps(o) for o in lines) + "\n")
    geo = tmp_path / "g.toml"
    geo.write_text('[cache]\nnum_blocks = 64\n[[groups]]\nkind = "full"\nblock_size = 16\n')
    out = tmp_path / "o"
    assert main(["simulate", str(geo), str(wl), "--out", str(out), "--quiet", "--no-plots"]) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reconciliation"]["every_request_fits"] is False
    rows = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert [r["finish_reason"] for r in rows] == ["too_large", "too_large"]


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

    geo = load_geometry(
        '[cache]\nnum_blocks = 2048\nspec_mode = "lookahead"\nlookahead_tokens = 1\n'
        "num_spec_tokens = 3\n"
        '[[groups]]\nkind = "full"\nblock_size = 16\n'
    )
    wl = load(shared_prefix(256, 32, 4, max_tokens=40))
    runs = {rate: simulate(geo, wl, draft_accept_rate=rate) for rate in (0.0, 1.0)}
    none, every = runs[0.0].summary, runs[1.0].summary
    assert none["reconciled"] and every["reconciled"]
    assert every["steps"] < none["steps"]
    assert none["hits"] == every["hits"]
    assert all(r["output_tokens"] == 40 for run in runs.values() for r in run.requests)
