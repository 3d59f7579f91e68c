#!/usr/bin/env python3
"""The figures the docs print, and the runs that made them.

A measured figure in README.md or docs/*.md sits between two markers that name its record and
its key, with an optional format (a factor, then a Python format spec):

    cold prefill <!--fig engine cold.wall_s .2f-->2.07<!--/fig--> s
    answers in <!--fig engine warm_identical.wall_s *1000:.0f-->18<!--/fig--> ms

and a whole block (a transcript, a table a command prints) has a marker on the line above its
fence: `<!-- figure: qualify transcript -->`. Each record is docs/figures/NAME.json: the command
that made it, the machine, the date, and its values. This script

    figures.py record NAME [NAME …]   runs NAME's command and writes its record
    figures.py write                  puts every record's values into the docs
    figures.py check                  exits 1, naming each figure that differs from its record

(tests/sim/test_figures.py runs the check). Records are written from fresh runs only: a figure
that no record holds is not a figure the docs may print.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "figures"
INLINE = re.compile(r"<!--fig (\S+) (\S+?)(?: (\S+?))?-->(.*?)<!--/fig-->", re.S)
BLOCK = re.compile(
    r"^<!-- figure: (\S+) (\S+) -->\n((?:<!-- .*? -->\n)*)(```\w*\n)(.*?\n)```", re.M | re.S
)


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def render(value: Any, fmt: str | None) -> str:
    """`value` as the doc prints it: `fmt` is `[*FACTOR:]SPEC` (`*1000:.0f`: seconds as ms)."""
    if fmt is None:
        return str(value)
    factor, _, spec = fmt.rpartition(":") if fmt.startswith("*") else ("", "", fmt)
    if factor:
        value = value * float(factor[1:])
    return format(value, spec)


def load(name: str) -> dict[str, Any]:
    path = RECORDS / f"{name}.json"
    if not path.is_file():
        raise KeyError(f"no record docs/figures/{name}.json")
    return json.loads(path.read_text(encoding="utf-8"))


def value(name: str, key: str) -> Any:
    values = load(name)["values"]
    if key not in values:
        raise KeyError(f"docs/figures/{name}.json has no value {key!r}")
    return values[key]


def differences() -> list[str]:
    """Every figure in the docs that differs from its record (or names none)."""
    out = []
    for doc in docs():
        text = doc.read_text(encoding="utf-8")
        where = doc.relative_to(ROOT)
        for m in INLINE.finditer(text):
            name, key, fmt, shown = m.groups()
            try:
                want = render(value(name, key), fmt)
            except (KeyError, ValueError, TypeError) as exc:
                out.append(f"{where}: {name} {key}: {exc}")
                continue
            if shown != want:
                out.append(f"{where}: {name} {key} prints {shown!r}, its record {want!r}")
        for m in BLOCK.finditer(text):
            name, key, _, _, body = m.groups()
            try:
                want = str(value(name, key)).rstrip("\n") + "\n"
            except KeyError as exc:
                out.append(f"{where}: {exc}")
                continue
            if body != want:
                out.append(f"{where}: the block of {name} {key} differs from its record")
    return out


def write() -> int:
    for doc in docs():
        text = doc.read_text(encoding="utf-8")

        def inline(m: re.Match[str]) -> str:
            name, key, fmt, _ = m.groups()
            spec = f" {fmt}" if fmt else ""
            return f"<!--fig {name} {key}{spec}-->{render(value(name, key), fmt)}<!--/fig-->"

        def block(m: re.Match[str]) -> str:
            name, key, directives, fence, _ = m.groups()
            body = str(value(name, key)).rstrip("\n") + "\n"
            return f"<!-- figure: {name} {key} -->\n{directives}{fence}{body}```"

        new = BLOCK.sub(block, INLINE.sub(inline, text))
        if new != text:
            doc.write_text(new, encoding="utf-8")
            print(f"figures: wrote {doc.relative_to(ROOT)}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------ recipes
def machine(saved: bool = False, note: str | None = None) -> str:
    """This machine and its load: measured at the start of a recipe's own run; for a saved
    run's output, what `--note` says of it (else that its load was not recorded)."""
    from kvreuse.core.spi import describe_core_path

    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    if saved:
        load = note or "a saved run's output; the load during that run was not recorded"
    else:
        load = f"load average {load1:.1f} at the start" + (f"; {note}" if note else "")
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_implementation()} "
        f"{platform.python_version()}, {describe_core_path()}; {load}"
    )


def run(command: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> str:
    done = subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    if done.returncode != 0:
        raise SystemExit(f"figures: {' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def json_lines(out: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """A benchmark's JSON lines (`metric`, `value`, `params`) as flat values: per line,
    `P.metric` and `P.param` for each scalar param, P the line's `keys` params joined by '.'
    (without keys: `metric` and `metric.param`)."""
    values: dict[str, Any] = {}
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        params = rec.get("params", {})
        prefix = ".".join(str(params[k]) for k in keys if k in params)
        pre = f"{prefix}." if prefix else ""
        values[f"{pre}{rec['metric']}"] = rec["value"]
        at = pre or f"{rec['metric']}."  # without keys, a line's params go under its metric
        for k, v in params.items():
            if isinstance(v, int | float | str) and k not in keys:
                values[f"{at}{k}"] = v
    return values


def _engine() -> tuple[str, dict[str, Any]]:
    command = "benchmarks/engine_bench.py --json"
    values = json_lines(run([sys.executable, *command.split()]), ("run",))
    extra = "benchmarks/engine_bench.py --json --geometry tiny-attention"
    other = json_lines(run([sys.executable, *extra.split()]), ("run",))
    values.update({f"tiny-attention.{k}": v for k, v in other.items()})
    return f"{command}; {extra}", values


def _sim_memory() -> tuple[str, dict[str, Any]]:
    command = "benchmarks/sim_memory.py --json"
    return command, json_lines(run([sys.executable, *command.split()]), ("preset",))


def _qualify() -> tuple[str, dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = run(
            [sys.executable, "-m", "kvreuse", "qualify", "--out", "qualify-out"],
            env={"COLUMNS": "100"},
            cwd=Path(tmp),
        )
        report = json.loads((Path(tmp) / "qualify-out" / "qualify.json").read_text())
    shown = "$ kvreuse qualify --out qualify-out            # per-scenario progress goes to stderr"
    lines = [line.rstrip() for line in out.rstrip("\n").splitlines()]
    values = {"transcript": "\n".join([shown, *lines]) + "\n", "seconds": report["seconds"]}
    return "kvreuse qualify --out qualify-out (COLUMNS=100)", values


def _fleet_example() -> tuple[str, dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        wl = Path(tmp) / "agent.jsonl"
        wl.write_text(
            run(
                [
                    sys.executable,
                    "-m",
                    "kvreuse",
                    "workload",
                    "agent",
                    "--sessions",
                    "8",
                    "--turns",
                    "6",
                ]
            )
        )
        args = "simulate --geometry hybrid-dcp4 agent.jsonl --out out --replicas 3 --policy "
        args += "round-robin --policy text-prefix --policy attention-chain --policy exact"
        out = run([sys.executable, "-m", "kvreuse", *args.split(), "--quiet"], cwd=Path(tmp))
    command = "kvreuse workload agent --sessions 8 --turns 6 > agent.jsonl; kvreuse " + args
    return command, {"table": out}


def _suite() -> tuple[str, dict[str, Any]]:
    import time

    start = time.monotonic()
    done = subprocess.run(
        # addopts cleared: the project's own -q on top of this one would print no summary line
        [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    wall = time.monotonic() - start
    summary = [line for line in done.stdout.splitlines() if re.search(r"\d+ passed", line)]
    last = summary[-1] if summary else ""
    counts = {w: int(n) for n, w in re.findall(r"(\d+) (passed|skipped|failed|errors?)", last)}
    if done.returncode != 0 or counts.get("failed"):
        failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        raise SystemExit("\n  ".join([f"figures: the suite failed: {last}", *failed]))
    values = {"wall_s": round(wall, 1), "minutes": round(wall / 60, 1), **counts}
    return "python -m pytest", values


def _saved(path: str | None, command: str) -> str:
    """The output of `command`, run now, or read from `path` where it was saved from a run of
    that very command (a run of minutes, made beside other work)."""
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    return run([sys.executable, *command.split()])


def _trace(trace: str, capacity: str | None) -> Callable[..., tuple[str, dict[str, Any]]]:
    def recipe(saved: str | None = None) -> tuple[str, dict[str, Any]]:
        command = f"benchmarks/trace_bench.py {trace}.jsonl --json"
        if capacity:
            command += f" --capacity-tokens {capacity}"
        return command, json_lines(_saved(saved, command), ())

    return recipe


def _fleet_bench(saved: str | None = None) -> tuple[str, dict[str, Any]]:
    command = (
        "benchmarks/fleet_bench.py --trace synthetic_trace.jsonl --policy exact "
        "--policy round-robin"
    )
    return command, json_lines(_saved(saved, command), ("workload", "policy"))


def _picked(saved: str, metric: str | None, prefix: Callable[[dict[str, Any]], str],
            fields: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    """A benchmark's own JSON lines (not `json_lines`' metric/value/params) as flat values: per
    line of `metric` (None: every line), `PREFIX.name` for each name → dotted path in `fields`
    that the line has."""
    values: dict[str, Any] = {}
    for line in Path(saved).read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if metric is not None and rec.get("metric") != metric:
            continue
        pre = prefix(rec)
        for name, path in fields.items():
            v: Any = rec
            for part in path.split("."):
                v = v.get(part) if isinstance(v, dict) else None
            if v is not None:
                values[f"{pre}.{name}"] = v
    return values


def _mocker(saved: str | None = None) -> tuple[str, dict[str, Any]]:
    """From the JSON lines mocker_bench.py prints: per case both tools' median CPU seconds, the
    ratio, both hit rates, the per-request agreement and (with --hybrid) hybrid-dcp4's."""
    command = (
        "benchmarks/mocker_bench.py --conversation conversation_trace.jsonl --synthetic "
        "synthetic_trace.jsonl --rounds 3 --hybrid > mocker.jsonl"
    )
    if saved is None:
        raise SystemExit("figures: run the command, then record mocker --from its output")
    fields = {k: k for k in ("requests", "pool_blocks", "ratio", "mocker_hit_rate")}
    fields.update({k: k for k in ("kvreuse_hit_rate", "hybrid_over_attention", "hybrid_hit_rate")})
    for k in ("mocker_cpu_s", "kvreuse_cpu_s", "hybrid_cpu_s"):
        fields[k] = f"{k}.median"
    fields["agree"] = "agreement.agree"
    return command, _picked(saved, "case", lambda rec: rec["case"], fields)


def _router(saved: str | None = None) -> tuple[str, dict[str, Any]]:
    """From the JSON lines router_bench.py prints: per replica count, both sides' median µs per
    decision, the ratio and the queries with the same best match."""
    command = "benchmarks/router_bench.py --rounds 3 > router.jsonl"
    if saved is None:
        raise SystemExit("figures: run the command, then record router --from its output")
    fields = {"kvreuse_us": "kvreuse_us.median", "dynamo_us": "dynamo_us.median"}
    fields.update({k: k for k in ("ratio", "queries", "same_best_match")})
    return command, _picked(saved, None, lambda rec: f"r{rec['replicas']}", fields)


def _fleet_mooncake(saved: str | None = None) -> tuple[str, dict[str, Any]]:
    """From the --json file fleet_mooncake.py writes: per trace and policy, the summary's
    figures the docs print."""
    command = (
        "benchmarks/fleet_mooncake.py --conversation conversation_trace.jsonl --synthetic "
        "synthetic_trace.jsonl --json fleet_mooncake.json --plot docs/img/fleet_mooncake.png"
    )
    if saved is None:
        raise SystemExit("figures: run the command, then record fleet_mooncake --from its JSON")
    values: dict[str, Any] = {}
    runs = json.loads(Path(saved).read_text(encoding="utf-8"))
    for s in runs:
        pre, case = f"{s['trace']}.{s['policy']}", s["case"]
        values[f"{pre}.{case}"] = s["hit_rate"]
        values[f"{pre}.{case}_ttft_s"] = s["ttft_mean_s"]
        values[f"{pre}.{case}_wall_s"] = s.get("wall_seconds")
        if case == "store":
            store = s["tiers"]["store"]
            values[f"{pre}.store_hit_tokens"] = store["hit_tokens"]
            values[f"{pre}.store_load_s"] = store["load_seconds"]
            continue
        values[f"{pre}.evicted"] = sum(r["evicted_blocks"] for r in s["per_replica"])
        p = s["prediction"] or {}
        values[f"{pre}.over_predicted"] = p.get("over_predicted")
        values[f"{pre}.mean_abs_error"] = p.get("mean_abs_error_tokens")
    for s in runs:
        pre = f"{s['trace']}.{s['policy']}"
        local, pooled = values.get(f"{pre}.local"), values.get(f"{pre}.store")
        values[f"{pre}.ratio"] = pooled / local if local and pooled is not None else None
    return command, values


def _tiers_conversation(saved: str | None = None) -> tuple[str, dict[str, Any]]:
    """docs/tiers.md's table: hybrid-dcp4 on the conversation trace, device alone, with a
    host tier, with host and store, and one device as large as device and host."""
    command = "benchmarks/tiers_trace.py conversation.jsonl --geometry hybrid-dcp4"
    return command, json_lines(_saved(saved, command), ("case",))


def _tiers_fleet(saved: str | None = None) -> tuple[str, dict[str, Any]]:
    """docs/tiers.md's fleet table: 4 replicas of hybrid-dcp4 with a host tier each, the exact
    router scoring tiers or devices only."""
    command = (
        "benchmarks/tiers_trace.py conversation.jsonl --geometry hybrid-dcp4 --replicas 4 "
        "--device 1M --host 8M"
    )
    return command, json_lines(_saved(saved, command), ("case",))


LOAD_WEIGHTS = (0.0, 0.02, 0.1, 1.0)


def _fleet_load_weight(saved: str | None = None) -> tuple[str, dict[str, Any]]:
    """The `exact` router's load weight on two workloads: 8 agent sessions × 6 turns on 3
    replicas of hybrid-dcp4, and Mooncake's synthetic trace (path in `saved`) on 10 replicas of
    3 M tokens (fleet_bench's node)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from fleet_bench import import_trace, node

    from kvreuse.deployment import preset
    from kvreuse.fleet.simulation.run import FleetOptions, simulate_fleet
    from kvreuse.sim.generators import agent
    from kvreuse.sim.workload import load_workload

    if saved is None:
        raise SystemExit("figures: record fleet_load_weight --from SYNTHETIC_TRACE.jsonl")
    runs = [
        (
            "agent",
            preset("hybrid-dcp4"),
            3,
            load_workload(json.dumps(x) for x in agent(8, 6, 64, 256, 32)),
        )
    ]
    trace = import_trace(saved)
    if isinstance(trace, str):
        raise SystemExit(f"figures: {trace}")
    runs.append(("synthetic", node(3_000_000), 10, trace))
    values: dict[str, Any] = {}
    for name, dep, replicas, workload in runs:
        for w in LOAD_WEIGHTS:
            options = FleetOptions(replicas=replicas, policy="exact", load_weight=w)
            summary, _ = simulate_fleet(dep, workload, options, sink=lambda row: None)
            pre = f"{name}.{w:g}"
            values[f"{pre}.hit_rate"] = summary["hit_rate"]
            values[f"{pre}.max_over_mean"] = summary["balance"]["max_over_mean"]
            values[f"{pre}.ttft_mean_s"] = summary["ttft_mean_s"]
    command = (
        "fleet_load_weight: simulate_fleet with policy exact and load_weight 0, 0.02, 0.1, 1 on "
        "kvreuse workload agent --sessions 8 --turns 6 (3 × hybrid-dcp4) and on "
        "synthetic_trace.jsonl (10 × 3 M tokens, fleet_bench's node)"
    )
    return command, values


def _events(saved: str | None = None) -> tuple[str, dict[str, Any]]:
    command = "benchmarks/events_bench.py --repeat 5"
    values = json_lines(_saved(saved, command), ("geometry", "publisher"))
    for geometry in ("attention-16", "hybrid-dcp4"):  # the core's own event building
        take = values.get(f"{geometry}.take.request_cycle_cpu_us")
        off = values.get(f"{geometry}.off.request_cycle_cpu_us")
        if take is not None and off is not None:
            values[f"{geometry}.take_minus_off_cpu_us"] = round(take - off, 2)
    return command, values


def _sweep_conversation(saved: str | None = None) -> tuple[str, dict[str, Any]]:
    """docs/sweeps.md's worked example, from the sweep.json its commands write (`saved`: the
    --out folder): per case `GEOMETRY.CAPACITY.FIELD`, the geometry as given (a file's stem)."""
    command = (
        "kvreuse geometry show hybrid-dcp4 > hybrid-dcp4-sparse.toml (+ its [cost]); kvreuse "
        "sweep conversation_trace.jsonl --trace mooncake --time-scale 4 --geometry "
        "hybrid-dcp4-ckpt256 --geometry hybrid-dcp4-ckpt2048 --geometry hybrid-dcp4-sparse.toml "
        "--capacity 1M,3M,10M,50M,inf --jobs 2 --out conv-sweep"
    )
    if saved is None:
        raise SystemExit("figures: run the commands, then record sweep_conversation --from DIR")
    from kvreuse.vocab import exact_size

    doc = json.loads((Path(saved) / "sweep.json").read_text(encoding="utf-8"))
    values: dict[str, Any] = {}
    for case in doc["cases"]:
        name = Path(case["geometry"]).stem.removeprefix("hybrid-dcp4-")
        pre = f"{name}.{exact_size(case['capacity_tokens'])}"
        for key, v in case.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                values[f"{pre}.{key}"] = v
    values["wall_s"] = sum(case.get("wall_s", 0.0) for case in doc["cases"])
    values["elapsed_s"] = doc["elapsed_s"]  # the sweep's own wall time
    return command, values


def _tiers_sweep(saved: str | None = None) -> tuple[str, dict[str, Any]]:
    """docs/tiers.md's sweep: hybrid-dcp4 on the conversation trace, per tier setup and device
    capacity (`saved`: the --out folder): `SETUP.CAPACITY.FIELD`, the setup's label without
    spaces ("device", "host30M", "host10M+store20M")."""
    command = (
        "kvreuse sweep conversation.jsonl --geometry hybrid-dcp4 --capacity 1M,3M,10M,33M,inf "
        "--tiers none --tiers host=30M --tiers host=10M,store=20M --jobs 2 --out tiers-sweep"
    )
    if saved is None:
        raise SystemExit("figures: run the command, then record tiers_sweep --from DIR")
    from kvreuse.vocab import exact_size

    doc = json.loads((Path(saved) / "sweep.json").read_text(encoding="utf-8"))
    values: dict[str, Any] = {}
    for case in doc["cases"]:
        setup = case["tier_setup"].replace("device only", "device").replace(" ", "")
        pre = f"{setup}.{exact_size(case['capacity_tokens'])}"
        values[f"{pre}.hit_rate"] = case["hit_rate"]
        values[f"{pre}.ttft_p50_s"] = case["ttft_p50_s"]
        tiers = case.get("tiers", {})
        values[f"{pre}.tier_hit_tokens"] = sum(
            t["hit_tokens"] for t in tiers.values() if isinstance(t, dict)
        )
    values["wall_s"] = round(sum(case.get("wall_s", 0.0) for case in doc["cases"]), 1)
    return command, values


RECIPES: dict[str, Callable[..., tuple[str, dict[str, Any]]]] = {
    "tiers_sweep": _tiers_sweep,
    "sweep_conversation": _sweep_conversation,
    "events": _events,
    "fleet_load_weight": _fleet_load_weight,
    "trace_conversation_all": _trace("conversation_trace", None),
    "trace_conversation_50m": _trace("conversation_trace", "50000000"),
    "trace_conversation_3m": _trace("conversation_trace", "3000000"),
    "trace_synthetic_all": _trace("synthetic_trace", None),
    "trace_synthetic_3m": _trace("synthetic_trace", "3000000"),
    "fleet_bench": _fleet_bench,
    "fleet_mooncake": _fleet_mooncake,
    "mocker": _mocker,
    "router": _router,
    "tiers_conversation": _tiers_conversation,
    "tiers_fleet": _tiers_fleet,
    "engine": _engine,
    "sim_memory": _sim_memory,
    "qualify": _qualify,
    "fleet_example": _fleet_example,
    "suite": _suite,
}


def record(name: str, saved: str | None = None, note: str | None = None) -> None:
    if name not in RECIPES:
        raise SystemExit(f"figures: no recipe {name!r}; recipes: {', '.join(RECIPES)}")
    where = machine(saved is not None, note)
    command, values = RECIPES[name](saved) if saved else RECIPES[name]()
    doc = {
        "command": command,
        "machine": where,
        "date": datetime.date.today().isoformat(),
        "values": values,
    }
    RECORDS.mkdir(parents=True, exist_ok=True)
    (RECORDS / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(f"figures: recorded docs/figures/{name}.json", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="action", required=True)
    rec = sub.add_parser("record", help="run a recipe's command and write its record")
    rec.add_argument("names", nargs="+", metavar="NAME")
    rec.add_argument(
        "--from",
        dest="saved",
        metavar="FILE",
        help="one NAME: read its command's output saved from a run of it (today, this machine)",
    )
    rec.add_argument(
        "--note", help="how the machine was loaded during the run (recorded with the machine)"
    )
    sub.add_parser("write", help="put every record's values into the docs")
    sub.add_parser("check", help="exit 1 when a doc's figure differs from its record")
    args = ap.parse_args(argv)
    if args.action == "record":
        if args.saved and len(args.names) != 1:
            ap.error("--from takes one NAME")
        for name in args.names:
            record(name, args.saved, args.note)
        return 0
    if args.action == "write":
        return write()
    problems = differences()
    for line in problems:
        print(f"figures: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
