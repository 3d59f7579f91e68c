#!/usr/bin/env python3
"""Compare two `core_bench.py --json` result files (e.g. before and after a core change).

    python benchmarks/compare.py old.jsonl new.jsonl

Prints one row per metric present in both files (hashing rows per algorithm, request-cycle rows
per events setting): old value, new value, and new/old. Lines that are not JSON are skipped, so
a captured stdout works as well as an --out file; when a file holds several runs the last value
of each metric wins.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# Metrics where a larger value is better; for all others smaller is better.
HIGHER_IS_BETTER = ("hash_tokens_per_s",)


def key_of(rec: dict[str, Any]) -> str:
    p = rec.get("params", {})
    if "algo" in p:
        return f"{rec['metric']}[{p['algo']}]"
    if "events" in p and rec["metric"] == "request_cycle_us":
        return f"{rec['metric']}[events={'on' if p['events'] else 'off'}]"
    return str(rec["metric"])


def load(path: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec.get("value"), int | float) and not isinstance(rec["value"], bool):
            out[key_of(rec)] = rec
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    args = ap.parse_args(argv)
    old, new = load(args.old), load(args.new)
    common = [k for k in new if k in old]
    if not common:
        print("no metric in common", file=sys.stderr)
        return 1
    print(f"{'metric':44s} {'old':>14s} {'new':>14s} {'new/old':>8s}  better?")
    for k in common:
        a, b = float(old[k]["value"]), float(new[k]["value"])
        ratio = b / a if a else float("inf")
        metric = str(new[k]["metric"])
        higher = metric.endswith("_ratio") or metric in HIGHER_IS_BETTER
        better = ratio > 1 if higher else ratio < 1
        print(f"{k:44s} {a:14,.3f} {b:14,.3f} {ratio:8.3f}  {'yes' if better else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
