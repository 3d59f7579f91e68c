"""qualify's outputs: a rich table on stdout, qualify.json and qualify.md."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvreuse.qualify.runner import Runner, Scenario


def _summary(sc: Scenario) -> dict[str, Any]:
    bad = sum(1 for r in sc.rows if r.failures)
    return {
        "scenario": sc.name,
        "requests": len(sc.rows),
        "cached_tokens": sum(r.cached for r in sc.rows),
        "hits_delta": sc.hits_delta,
        "evicted_blocks": sc.evicted,
        "rules_checked": sc.evicted == 0,
        "failed_requests": bad,
        "seconds": round(sc.seconds, 2),
        "skipped": sc.skipped,
        "status": "skip" if sc.skipped else ("FAIL" if bad or sc.failures else "pass"),
    }


def write_report(
    runner: Runner, out: str, url: str, seconds: float, interrupted: bool = False
) -> None:
    """qualify.json and qualify.md (`interrupted`: Ctrl-C stopped the run; the finished
    scenarios are reported and the run did not pass)."""
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    failures = runner.failures()
    verdict = "INTERRUPTED" if interrupted else "PASSED" if not failures else "FAILED"
    doc = {
        "url": url,
        "model": runner.client.model,
        "passed": not failures and not interrupted,
        "interrupted": interrupted,
        "seconds": round(seconds, 2),
        "failures": failures,
        "scenarios": [
            _summary(sc) | {"rows": [asdict(r) for r in sc.rows]} for sc in runner.scenarios
        ],
    }
    (path / "qualify.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [
        f"# kvreuse qualify: {verdict}",
        "",
        f"Server {url}, model `{runner.client.model}`, {seconds:.1f} s.",
        "",
        "| scenario | requests | Σ cached | Δ hits counter | evicted blocks | rules checked "
        "| failed | seconds | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for sc in runner.scenarios:
        s = _summary(sc)
        lines.append(
            f"| {s['scenario']} | {s['requests']:,} | {s['cached_tokens']:,} "
            f"| {s['hits_delta']:,.0f} | {s['evicted_blocks']:,.0f} "
            f"| {'yes' if s['rules_checked'] else 'no'} "
            f"| {s['failed_requests']:,} | {s['seconds']} | {s['status']} |"
        )
    lines += [
        "",
        "## Requests",
        "",
        "| scenario | request | prompt | cached | rules | shadow | answer | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for sc in runner.scenarios:
        for r in sc.rows:
            ans = "" if r.answer_ok is None else ("same" if r.answer_ok else "DIFFERS")
            rules = "n/a" if r.rules is None else r.rules
            lines.append(
                f"| {r.scenario} | {r.request} | {r.prompt_tokens:,} | {r.cached:,} "
                f"| {rules if isinstance(rules, str) else f'{rules:,}'} | {r.shadow:,} | {ans} "
                f"| {'FAIL' if r.failures else 'ok'} |"
            )
    if failures:
        lines += ["", "## Failures", ""] + [f"- {f}" for f in failures]
    (path / "qualify.md").write_text("\n".join(lines) + "\n")


def print_report(runner: Runner, seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvreuse qualify ({seconds:.1f} s)")
    for col in (
        "scenario",
        "requests",
        "Σ cached",
        "Δ hits",
        "evicted",
        "rules",
        "failed",
        "s",
        "status",
    ):
        table.add_column(col, justify="left" if col in ("scenario", "status") else "right")
    for sc in runner.scenarios:
        s = _summary(sc)
        style = {"pass": "green", "FAIL": "bold red", "skip": "yellow"}[s["status"]]
        table.add_row(
            s["scenario"],
            f"{s['requests']:,}",
            f"{s['cached_tokens']:,}",
            f"{s['hits_delta']:,.0f}",
            f"{s['evicted_blocks']:,.0f}",
            "yes" if s["rules_checked"] else "no",
            f"{s['failed_requests']:,}",
            f"{s['seconds']:.1f}",
            f"[{style}]{s['status']}[/{style}]",
        )
    Console(width=120).print(table)
    for sc in runner.scenarios:
        if sc.skipped:
            print(f"note: {sc.name} skipped: {sc.skipped}")
