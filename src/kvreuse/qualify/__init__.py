"""`kvreuse qualify`: send scenarios to a server and check every cached_tokens it reports.

Per request: cached_tokens against the spec's rules (`RulePredictor`, while nothing was evicted)
and against a shadow replay (`ShadowPredictor`, always); per scenario: Σ cached_tokens against
the Δ of the server's prefix-cache hits counter (exact); warm answers against cold ones (greedy).
Scenarios, each after a reset of the prefix cache: (a) boundary grid cold/warm/appended,
(b) shared prefix, (c) agent turns, (d) long cold/warm retrieval, (e) pressure: fill the cache
past capacity, then replay it twice.

qualify is a client of the server: it talks HTTP to `--url`, or starts a `kvreuse.serve` server
in-process; the server never imports it. Modules: `runner` (the HTTP client, the per-request
bookkeeping and the checks), `predictor` (what cached_tokens must be), `scenarios`, `report`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from kvreuse.deployment import Deployment, resolve
from kvreuse.qualify.predictor import RulePredictor, ShadowPredictor
from kvreuse.qualify.progress import ScenarioProgress
from kvreuse.qualify.report import print_report, write_report
from kvreuse.qualify.runner import Client, QualifyError, Runner, UsageError
from kvreuse.qualify.scenarios import run_all
from kvreuse.sim.cli import prepare_out

__all__ = [
    "Client",
    "QualifyError",
    "RulePredictor",
    "Runner",
    "ShadowPredictor",
    "UsageError",
    "main",
]

QUALIFY_NUM_BLOCKS = {False: 192, True: 48}  # in-process cache by --quick: fillable on a CPU
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C


def main(args: argparse.Namespace) -> int:
    """Run every scenario against `args.url` (or an in-process server). Exit code: 0 passed,
    1 failed, 2 usage error (nothing could be checked), 130 Ctrl-C (finished scenarios kept)."""
    started = time.monotonic()
    runner: Runner | None = None
    url = args.url or "in-process server"
    try:
        _check_out(Path(args.out))
        with _server(args) as url:
            client = Client(url)
            try:
                dep = _given_geometry(args) if args.url and args.geometry else client.geometry()
                runner = Runner(client, dep, args.seed, ScenarioProgress(not args.quiet))
                run_all(runner, quick=args.quick, max_fill=args.max_fill_tokens)
            finally:
                client.close()
    except UsageError as exc:
        print(f"kvreuse qualify: {exc}", file=sys.stderr)
        return 2
    except QualifyError as exc:
        print(f"kvreuse qualify: FAILED: {exc}")
        return 1
    except KeyboardInterrupt:
        return _interrupted(runner, args.out, url, time.monotonic() - started)
    seconds = time.monotonic() - started
    write_report(runner, args.out, url, seconds)
    print_report(runner, seconds)
    failures = runner.failures()
    for f in failures:
        print(f"FAIL {f}")
    print(
        f"kvreuse qualify: {'PASSED' if not failures else 'FAILED'} "
        f"({len(failures):,} failure(s)); report in {args.out}/qualify.md"
    )
    return 0 if not failures else 1


def _interrupted(runner: Runner | None, out: str, url: str, seconds: float) -> int:
    """Ctrl-C: keep the scenarios that finished, and say where they are."""
    scenarios = runner.scenarios if runner else []
    done = [sc for sc in scenarios if sc.finished]
    current = next((sc.name for sc in scenarios if not sc.finished), None)
    where = "before any scenario finished"
    if runner is not None and done:
        runner.scenarios = done
        write_report(runner, out, url, seconds, interrupted=True)
        where = f"after {len(done)} scenario(s); their report is in {out}/qualify.md"
    during = f" during {current}" if current else ""
    print(f"kvreuse qualify: interrupted{during} {where}", file=sys.stderr)
    return INTERRUPTED


def _check_out(out: Path) -> None:
    """--out must be a directory we can write, checked before the scenarios run (the simulator's
    own check, with qualify's file names)."""
    try:
        prepare_out(out, ("qualify.json", "qualify.md"))
    except OSError as exc:
        raise UsageError(str(exc)) from None


def _given_geometry(args: argparse.Namespace) -> Deployment:
    """`--geometry` with `--url`: the server's geometry, when it does not serve its own."""
    try:
        return resolve(args.geometry)
    except ValueError as exc:  # GeometryError, or the core's ConfigError
        raise UsageError(str(exc)) from None


@contextlib.contextmanager
def _server(args: argparse.Namespace) -> Iterator[str]:
    if args.url:
        yield args.url
        return
    from kvreuse.serve.app import create_app
    from kvreuse.serve.backend import default_backend, fake_backend
    from kvreuse.serve.server import ServerThread

    blocks = args.num_blocks or QUALIFY_NUM_BLOCKS[bool(args.quick)]
    try:
        backend = (
            fake_backend(args.geometry, num_blocks=blocks)
            if args.fake
            else default_backend(args.model, args.geometry, blocks)
        )
    except (RuntimeError, ValueError, OSError) as exc:  # bad --model, --geometry, no torch
        raise UsageError(str(exc)) from None
    with ServerThread(create_app(backend)) as url:
        yield url
