"""The sweep's plots (matplotlib, headless): hit rate and simulated prefill time against the
cache capacity, one line per geometry (and per tier setup below the pool, where the sweep
compares several), capacity on a log axis with `inf` drawn at its end.

Geometries often agree at some capacities (every one reuses the same with an unlimited cache,
say), and a line drawn over another hides it. Each geometry therefore has its own dash pattern
and a hollow marker, drawn smaller for each later geometry, so coinciding points show as
nested markers and coinciding lines as one dash pattern over another."""

from __future__ import annotations

import math
from pathlib import Path

from kvreuse.sim.sweep import Row
from kvreuse.vocab import exact_size

DASHES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P")


def _positions(rows: list[Row]) -> tuple[dict[int | None, float], list[float], list[str]]:
    """Where each capacity sits on the x axis, and the ticks: `inf` one decade past the
    largest finite capacity (or at 1 when there is none)."""
    finite = sorted({r["capacity_tokens"] for r in rows if r["capacity_tokens"] is not None})
    where: dict[int | None, float] = {c: float(c) for c in finite}
    if any(r["capacity_tokens"] is None for r in rows):
        where[None] = 10.0 * finite[-1] if finite else 1.0
    ticks = sorted(where.items(), key=lambda kv: kv[1])
    return where, [x for _, x in ticks], [exact_size(c) for c, _ in ticks]


def write_plots(out: Path, rows: list[Row]) -> list[Path]:
    """hit_rate_vs_capacity.png and prefill_time.png in `out`."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    where, ticks, labels = _positions(rows)
    lines = list(dict.fromkeys(_line(r) for r in rows))
    names = _line_names(lines)
    panels = (
        ("hit_rate_vs_capacity.png", "hit rate (%)", "hit rate against cache capacity"),
        ("prefill_time.png", "simulated prefill time (s)", "prefill time against cache capacity"),
    )
    paths = []
    for name, ylabel, title in panels:
        fig, ax = plt.subplots(figsize=(8.0, 4.5))
        for i, key in enumerate(lines):
            mine = sorted(
                ((where[r["capacity_tokens"]], r) for r in rows if _line(r) == key),
                key=lambda xr: xr[0],
            )
            xs = [x for x, _ in mine]
            if name.startswith("hit_rate"):
                ys = [100 * r["hit_rate"] for _, r in mine]
            else:
                ys = [
                    math.nan if r["prefill_seconds"] is None else r["prefill_seconds"]
                    for _, r in mine
                ]
            ax.plot(
                xs,
                ys,
                label=names[key],
                linestyle=DASHES[i % len(DASHES)],
                marker=MARKERS[i % len(MARKERS)],
                markersize=max(4.0, 12.0 - 2.5 * i),
                markerfacecolor="none",
                markeredgewidth=1.5,
                linewidth=max(1.0, 2.5 - 0.5 * i),
            )
        ax.set_xscale("log")
        ax.set_xticks(ticks, labels)
        ax.minorticks_off()
        ax.set_xlabel(
            "device cache capacity (tokens)" if _tiered(lines) else "cache capacity (tokens)"
        )
        ax.set_ylabel(ylabel)
        if name.startswith("hit_rate"):
            ax.set_ylim(0, 100)
        else:
            ax.set_ylim(bottom=0)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def _line(row: Row) -> tuple[str, str]:
    return row["geometry"], row.get("tier_setup", "device only")


def _tiered(lines: list[tuple[str, str]]) -> bool:
    return any(tiers != "device only" for _, tiers in lines)


def _line_names(lines: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """A legend entry per line: the geometry, the tier setup, or both where both vary."""
    geometries = {g for g, _ in lines}
    setups = {t for _, t in lines}
    if len(setups) == 1 and not _tiered(lines):
        return {key: key[0] for key in lines}
    if len(geometries) == 1:
        return {key: key[1] for key in lines}
    return {key: f"{key[0]}, {key[1]}" for key in lines}
