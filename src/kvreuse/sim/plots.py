"""PNG plots for the simulation report (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

from kvreuse.sim.run import SimResult


def write_plots(out: Path, name: str, result: SimResult) -> list[Path]:
    """cached_vs_prompt.png (per request) and usage_hit_rate.png (over simulated time)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    paths = []
    rows = result.requests
    fig, ax = plt.subplots(figsize=(max(6.0, min(0.25 * len(rows), 24.0)), 4.0))
    xs = range(len(rows))
    ax.bar(xs, [r["prompt_tokens"] for r in rows], color="#c8d3e0", label="prompt tokens")
    ax.bar(xs, [r["cached_tokens"] for r in rows], color="#2b6cb0", label="cached tokens")
    ax.set_xlabel("request (workload order)")
    ax.set_ylabel("tokens")
    ax.set_title(f"{name}: cached vs prompt tokens per request")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    fig.tight_layout()
    paths.append(out / "cached_vs_prompt.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8.0, 4.0))
    times = [t for t, _, _ in result.timeline]
    ax.plot(times, [100 * u for _, u, _ in result.timeline], label="pool usage (%)")
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
    return paths
