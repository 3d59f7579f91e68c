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
import time
from collections.abc import Iterator

from kvreuse.deployment import Deployment, resolve
from kvreuse.qualify.predictor import RulePredictor, ShadowPredictor
from kvreuse.qualify.report import print_report, write_report
from kvreuse.qualify.runner import Client, QualifyError, Runner
from kvreuse.qualify.scenarios import run_all

__all__ = ["Client", "QualifyError", "RulePredictor", "Runner", "ShadowPredictor", "main"]

QUALIFY_NUM_BLOCKS = {False: 192, True: 48}  # in-process cache by --quick: fillable on a CPU


def main(args: argparse.Namespace) -> int:
    """Run every scenario against `args.url` (or an in-process server); 0 when all passed."""
    started = time.monotonic()
    try:
        with _server(args) as url:
            client = Client(url)
            try:
                geo = _given_geometry(args) if args.url and args.geometry else client.geometry()
                runner = Runner(client, geo, args.seed)
                run_all(runner, quick=args.quick, max_fill=args.max_fill_tokens)
            finally:
                client.close()
    except QualifyError as exc:
        print(f"kvreuse qualify: FAILED: {exc}")
        return 1
    seconds = time.monotonic() - started
    write_report(runner, args.out, url, seconds)
    print_report(runner, seconds)
    failures = runner.failures()
    for f in failures:
        print(f"FAIL {f}")
    print(
        f"kvreuse qualify: {'PASSED' if not failures else 'FAILED'} "
        f"({len(failures)} failure(s)); report in {args.out}/qualify.md"
    )
    return 0 if not failures else 1


def _given_geometry(args: argparse.Namespace) -> Deployment:
    """`--geometry` with `--url`: the server's geometry, when it does not serve its own."""
    try:
        return resolve(args.geometry)
    except ValueError as exc:  # GeometryError, or the core's ConfigError
        raise QualifyError(str(exc)) from None


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
    except (RuntimeError, ValueError, OSError) as exc:
        raise QualifyError(str(exc)) from None
    with ServerThread(create_app(backend)) as url:
        yield url
