"""The plots show what a run did: evictions beside pool usage (usage counts only running
requests, so a run can evict thousands of blocks at a low usage), a cached-vs-prompt view that
stays readable at thousands of requests, and sweep lines that stay visible where geometries
agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvreuse.deployment import preset
from kvreuse.sim.generators import pressure, shared_prefix
from kvreuse.sim.run import simulate
from kvreuse.sim.workload import load_workload

plt = pytest.importorskip("matplotlib.pyplot", reason="plots need matplotlib: '.[sim]'")


def _load(lines: list[dict]) -> list:
    return load_workload(json.dumps(x) for x in lines)


def test_the_usage_plot_shows_the_evictions_a_low_usage_hides() -> None:
    from kvreuse.sim.plots import _usage

    res = simulate(preset("hybrid-dcp4"), _load(pressure(None, 8192, 2, geometry="hybrid-dcp4")))
    s = res.summary
    assert s["evicted_blocks"] > 1_000 and s["peak_usage"] < 0.05  # the case that hid them
    assert len(res.evicted) == len(res.timeline) and res.evicted[-1] == s["evicted_blocks"]
    fig = _usage(plt, "hybrid-dcp4", res)
    try:
        top, bottom = fig.axes
        (line,) = bottom.get_lines()
        assert max(line.get_ydata()) == s["evicted_blocks"]
        assert "evicted" in line.get_label()
        assert len(top.get_lines()) == 2
    finally:
        plt.close(fig)


def test_thousands_of_requests_are_a_scatter_and_a_histogram_not_bars(tmp_path: Path) -> None:
    from kvreuse.sim.plots import BARS_UP_TO, write_plots

    wl = _load(shared_prefix(64, 16, 3 * BARS_UP_TO))
    res = simulate(preset("attention-16"), wl)
    figures: list = []
    real_close = plt.close
    plt.close = lambda fig=None: figures.append(fig)  # keep them to look at
    try:
        write_plots(tmp_path, "attention-16", res)
    finally:
        plt.close = real_close
    scatter = figures[0]
    try:
        left, right = scatter.axes
        (dots,) = left.collections
        assert len(dots.get_offsets()) == len(wl)
        assert len(left.patches) == 0  # no bar per request
        assert sum(p.get_height() for p in right.patches) == len(wl)  # every request counted
        assert scatter.get_size_inches()[0] <= 12
    finally:
        for fig in figures:
            real_close(fig)
    assert (tmp_path / "cached_vs_prompt.png").stat().st_size > 0


def test_sweep_lines_that_coincide_stay_visible(tmp_path: Path) -> None:
    from kvreuse.sim import sweep_plots

    rows = [
        {"geometry": g, "capacity_tokens": c, "hit_rate": 0.3, "prefill_seconds": 5.0}
        for g in ("a", "b", "c")
        for c in (10**6, None)
    ]
    figures: list = []
    real_close = plt.close
    plt.close = lambda fig=None: figures.append(fig)
    try:
        sweep_plots.write_plots(tmp_path, rows)
    finally:
        plt.close = real_close
    try:
        for fig in figures:
            lines = fig.axes[0].get_lines()
            assert len({line.get_linestyle() for line in lines}) == 3
            assert len({line.get_marker() for line in lines}) == 3
            sizes = [line.get_markersize() for line in lines]
            assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 3
            assert all(line.get_markerfacecolor() == "none" for line in lines)
    finally:
        for fig in figures:
            real_close(fig)
