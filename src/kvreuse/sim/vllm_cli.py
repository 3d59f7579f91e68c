"""`kvreuse simulate --engine vllm`: the command's options, inputs and outputs with vLLM's own
scheduler as the engine (`kvreuse.sim.vllm_engine`); docs/vllm.md.

The same workload formats, cost model and output files as `--engine kvreuse`; the options only
kvreuse's engine has are refused in one line, before vLLM is imported or anything runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvreuse.core import ConfigError
from kvreuse.deployment import GeometryError
from kvreuse.sched import DRAFT_ACCEPT_RATE
from kvreuse.sim.cli import _require_matplotlib, _writer, clear_outputs, prepare_out, read_inputs
from kvreuse.sim.cost import CostModel
from kvreuse.sim.fit import check_fit
from kvreuse.sim.report import PLOTS, kinds_table
from kvreuse.sim.run import SimResult
from kvreuse.sim.tally import REPORT_ROWS
from kvreuse.sim.vllm_build import VllmRefusal, check_expressible, import_vllm
from kvreuse.sim.vllm_engine import VllmStuck, simulate_vllm
from kvreuse.sim.workload import WorkloadError, WorkloadRequest

ENGINES = ("kvreuse", "vllm")
PROG = "kvreuse simulate"


def add_engine_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default="kvreuse",
        help="whose scheduler and prefix cache run the workload: kvreuse's, or vLLM's own v1 "
        "Scheduler and KVCacheManager (run with the venv of benchmarks/vllm/setup_venv.sh; "
        "docs/vllm.md)",
    )


def kvreuse_only_options(args: argparse.Namespace) -> list[str]:
    """The options given that only kvreuse's engine has."""
    given = [
        f"--{name.replace('_', '-')}"
        for name in ("replicas", "policy", "shared_tier_capacity")  # the fleet's (suppressed)
        if hasattr(args, name)
    ]
    if args.host_capacity is not None:
        given.append("--host-capacity")
    if args.store_capacity is not None:
        given.append("--store-capacity")
    if args.store_admission != "on-eviction":
        given.append("--store-admission")
    if args.no_fast_forward:
        given.append("--no-fast-forward")
    if args.draft_accept_rate != DRAFT_ACCEPT_RATE:
        given.append("--draft-accept-rate")
    return given


def _fail(message: object, code: int = 2) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return code


def _check_workload(workload: list[WorkloadRequest]) -> None:
    lora = next((w.request_id for w in workload if w.lora is not None), None)
    if lora is not None:
        raise VllmRefusal(
            f"request {lora!r} names a LoRA adapter; --engine vllm runs no adapters "
            '(allowed: requests without "lora")'
        )


def run_vllm(args: argparse.Namespace) -> int:
    only = kvreuse_only_options(args)
    if only:
        return _fail(
            f"--engine vllm: {', '.join(only)} only apply to kvreuse's engine; "
            "leave them out (or use --engine kvreuse)"
        )
    try:
        dep, workload = read_inputs(args)
        check_expressible(dep)
        _check_workload(workload)
        fit = check_fit(dep, workload)
        if fit.num_too_large:  # vLLM would leave them waiting forever
            raise VllmRefusal(fit.message(dep))
        cost = CostModel.for_deployment(
            dep, prefill_tokens_per_s=args.prefill_tokens_per_s, decode_step_s=args.decode_step_s
        )
        if not args.no_plots:
            _require_matplotlib()
        prepare_out(args.out)
        import_vllm()
    except (GeometryError, WorkloadError, ConfigError, OSError, ValueError) as exc:
        return _fail(exc)
    clear_outputs(args.out)
    from kvreuse.sim.progress import Progress

    progress = Progress(not args.quiet, PROG)
    with (args.out / "requests.jsonl").open("w", encoding="utf-8") as rows:
        try:
            with progress.phase("simulating on vLLM", len(workload), "req") as on_step:
                res = simulate_vllm(dep, workload, cost, _writer(rows), on_step)
        except (WorkloadError, VllmStuck) as exc:
            return _fail(exc)
        except KeyboardInterrupt:
            return _fail(
                f"interrupted; the finished requests are in {args.out}/requests.jsonl", 130
            )
    s = res.summary
    result = SimResult([], s, res.timeline, res.tally)
    if not args.no_plots:
        from kvreuse.sim.plots import write_plots

        with progress.phase("plotting", len(PLOTS), "plot") as on_plot:
            write_plots(args.out, dep.name, result, on_plot)
    (args.out / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    _write_report(args, dep.name, result)
    print(json.dumps(s, indent=2) if args.json else "\n".join(_table(dep.name, result, args)))
    if not s["reconciled"]:
        failed = [k for k, ok in s["reconciliation"].items() if not ok]
        return _fail(f"reconciliation failed: {failed}", 1)
    return 0


def _headline(name: str, result: SimResult) -> list[str]:
    s, v = result.summary, result.summary["vllm"]
    return [
        f"{name} on vLLM {v['vllm_version']} ({v['scheduler_cls']}, {v['coordinator_cls']}; "
        f"scheduler block {v['scheduler_block_size']:,}, hash block {v['hash_block_size']:,}): "
        f"{s['requests']:,} requests; {result.tally.hit_rate_line()}",
        f"{s['preemptions']:,} preemptions; simulated {s['simulated_seconds']:.3f} s over "
        f"{s['steps']:,} steps (cost model estimate)",
    ]


def _table(name: str, result: SimResult, args: argparse.Namespace) -> list[str]:
    s = result.summary
    return [
        *kinds_table(result),
        "(cached tok: vLLM's own count per request; queue and TTFT: cost-model estimates)",
        "",
        *_headline(name, result),
        f"reconciliation {'passed' if s['reconciled'] else 'FAILED'}; outputs in {args.out}/",
    ]


def _write_report(args: argparse.Namespace, name: str, result: SimResult) -> None:
    s, tally = result.summary, result.tally
    lines = [f"# Simulation report: {name} on vLLM", ""]
    if not args.no_plots:
        lines += [f"![{alt}]({file})" for file, alt in PLOTS] + [""]
    lines += [f"- {line}" for line in _headline(name, result)]
    lines.append(
        f"- reconciliation: {'passed' if s['reconciled'] else 'FAILED'} {s['reconciliation']}"
    )
    lines.append(
        "- not produced on vLLM's side: "
        + "; ".join(f"{k} ({why})" for k, why in s["not_produced"].items())
    )
    lines += ["", "## Requests by kind", "", "```", *kinds_table(result), "```", ""]
    lines += [
        f"## Requests (the first {min(tally.num_rows, REPORT_ROWS):,} of {tally.num_rows:,}; "
        "every one is in requests.jsonl)",
        "",
        "| id | prompt | cached | preemptions | queue (s) | TTFT (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in tally.first_rows:
        lines.append(
            f"| {r['id']} | {r['prompt_tokens']:,} | {r['cached_tokens']:,} | "
            f"{r['preemptions']:,} | {r['queue_s']:.4f} | {r['ttft_estimate_s']:.4f} |"
        )
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
