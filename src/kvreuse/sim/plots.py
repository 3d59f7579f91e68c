"""PNG plots for the simulation report (matplotlib, headless).

cached_vs_prompt.png: per request, cached against prompt tokens. Up to `BARS_UP_TO` requests
it is a bar per request; beyond, bars would be slivers, so it is a scatter of (prompt, cached),
one dot per request against the line of a request served wholly from cache, beside a histogram
of the requests by the share of their prompt served from cache (which counts the requests that
fall on one dot).

usage_hit_rate.png: over simulated time, the pool held by running requests and the cumulative
hit rate, and below them the blocks evicted so far. Usage counts only running requests'
blocks (finished ones stay cached but are free to evict, as in vLLM's kv_cache_usage), so a run
can evict thousands of blocks at a low usage; the lower panel shows them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvreuse.sim.run import SimResult

BARS_UP_TO = 400  # requests drawn as bars; more are drawn as a scatter and running totals
PROMPT, CACHED, EVICTED = "#9fb3c8", "#2b6cb0", "#c05621"


def write_plots(
    out: Path, name: str, result: SimResult, on_plot: Callable[[int, int], None] | None = None
) -> list[Path]:
    """cached_vs_prompt.png (per request) and usage_hit_rate.png (over simulated time)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    paths = [out / "cached_vs_prompt.png", out / "usage_hit_rate.png"]
    prompt, cached = result.tally.prompt_per_request, result.tally.cached_per_request
    if len(prompt) <= BARS_UP_TO:
        fig = _bars(plt, name, prompt, cached)
    else:
        fig = _scatter(plt, name, prompt, cached)
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)
    if on_plot is not None:
        on_plot(1, 2)
    fig = _usage(plt, name, result)
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    if on_plot is not None:
        on_plot(2, 2)
    return paths


def _bars(plt: Any, name: str, prompt: Any, cached: Any) -> Any:
    fig, ax = plt.subplots(figsize=(max(6.0, min(0.25 * len(prompt), 24.0)), 4.0))
    xs = range(len(prompt))
    ax.bar(xs, prompt, color=PROMPT, label="prompt tokens")
    ax.bar(xs, cached, color=CACHED, label="cached tokens")
    ax.set_xlabel("request (workload order)")
    ax.set_ylabel("tokens")
    ax.set_title(f"{name}: cached vs prompt tokens per request")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    fig.tight_layout()
    return fig


def _scatter(plt: Any, name: str, prompt: Any, cached: Any) -> Any:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12.0, 4.8))
    top = max(prompt) if len(prompt) else 1
    left.plot([0, top], [0, top], color="#718096", linewidth=1, label="all cached")
    left.scatter(prompt, cached, s=9, alpha=0.4, color=CACHED, linewidths=0, label="a request")
    left.set_xlabel("prompt tokens")
    left.set_ylabel("cached tokens")
    left.set_title(f"{len(prompt):,} requests: cached against prompt")
    left.legend(loc="upper left")
    # requests of equal lengths fall on one dot: the histogram counts them
    shares = [100 * c / p if p else 0.0 for p, c in zip(prompt, cached, strict=True)]
    right.hist(shares, bins=[5 * i for i in range(21)], color=CACHED, edgecolor="white")
    right.set_xlim(0, 100)
    right.set_xlabel("share of the prompt served from cache (%)")
    right.set_ylabel("requests")
    right.set_title("requests by their reuse")
    fig.suptitle(f"{name}: cached vs prompt tokens")
    fig.tight_layout()
    return fig


def _usage(plt: Any, name: str, result: SimResult) -> Any:
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(8.0, 5.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    times = [t for t, _, _ in result.timeline]
    top.plot(times, [100 * u for _, u, _ in result.timeline], label="pool held by running requests")
    top.plot(times, [100 * h for _, _, h in result.timeline], label="cumulative hit rate")
    top.set_ylabel("%")
    top.set_ylim(0, 100)
    top.set_title(f"{name}: pool usage, hit rate and evictions")
    top.legend(loc="upper right")
    evicted = result.evicted if len(result.evicted) == len(times) else [0] * len(times)
    bottom.plot(times, evicted, color=EVICTED, label="blocks evicted so far")
    bottom.set_ylabel("blocks")
    bottom.set_ylim(bottom=0)
    bottom.set_xlabel("simulated time (s, cost-model estimate)")
    bottom.legend(loc="upper left")
    fig.tight_layout()
    return fig
