"""PNG plots for the simulation report (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvreuse.sim.run import SimResult

BARS_UP_TO = 400  # requests drawn as bars; more are drawn as filled curves (one bar each is slow)


def write_plots(
    out: Path, name: str, result: SimResult, on_plot: Callable[[int, int], None] | None = None
) -> list[Path]:
    """cached_vs_prompt.png (per request) and usage_hit_rate.png (over simulated time)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    paths = []
    prompt, cached = result.tally.prompt_per_request, result.tally.cached_per_request
    fig, ax = plt.subplots(figsize=(max(6.0, min(0.25 * len(prompt), 24.0)), 4.0))
    xs = range(len(prompt))
    if len(prompt) <= BARS_UP_TO:
        ax.bar(xs, prompt, color="#c8d3e0", label="prompt tokens")
        ax.bar(xs, cached, color="#2b6cb0", label="cached tokens")
    else:
        ax.fill_between(xs, prompt, step="mid", color="#c8d3e0", label="prompt tokens")
        ax.fill_between(xs, cached, step="mid", color="#2b6cb0", label="cached tokens")
    ax.set_xlabel("request (workload order)")
    ax.set_ylabel("tokens")
    ax.set_title(f"{name}: cached vs prompt tokens per request")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    fig.tight_layout()
    paths.append(out / "cached_vs_prompt.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    if on_plot is not None:
        on_plot(1, 2)

    fig, ax = plt.subplots(figsize=(8.0, 4.0))
    times = [t for t, _, _ in result.timeline]
    ax.plot(times, [100 * u for _, u, _ in result.timeline], label="pool usage, step peak (%)")
    ax.plot(times, [100 * h for _, _, h in result.timeline], label="cumulative hit rate (%)")
    ax.set_xlabel("simulated time (s, cost-model estimate)")
    ax.set_ylabel("%")
    ax.set_ylim(0, 100)
    ax.set_title(f"{name}: pool usage and hit rate")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "usage_hit_rate.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    if on_plot is not None:
        on_plot(2, 2)
    return paths
