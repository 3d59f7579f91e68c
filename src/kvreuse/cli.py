"""Command line: `kvreuse demo | workload | simulate | sweep | geometry | serve | qualify |
fleet | route` (also `python -m kvreuse`).

The demo runs a cold request and an identical warm resend on the groups of the `hybrid-dcp4`
preset (full attention, local block 2048 × dcp 4 = 8192-token pages, a 256-token recurrent
group, hash unit 256) and prints what was reused and why.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
from collections.abc import Sequence
from typing import NoReturn

from kvreuse.core import CacheConfig, KVCacheManager, Request
from kvreuse.deployment import resolve
from kvreuse.geometry_cli import add_geometry
from kvreuse.vocab import Help, add_num_blocks, size, size_list


def demo_config(num_blocks: int = 4096) -> CacheConfig:
    """The hybrid-dcp4 preset's groups (full 2048 × dcp 4, recurrent 256, u = 256)."""
    return dataclasses.replace(resolve("hybrid-dcp4").cache, num_blocks=num_blocks)


def _run_once(mgr: KVCacheManager, rid: str, tokens: list[int]) -> dict[str, object]:
    mgr.add_request(Request(rid, prompt_token_ids=tokens))
    res = mgr.lookup(rid)
    plan = mgr.allocate(rid, num_new_tokens=len(tokens) - res.hit, lookup=res)
    if plan is None:
        raise RuntimeError(f"demo: request {rid} does not fit the pool")
    step = mgr.seal_step()
    mgr.commit(step.step_id, {rid: (len(tokens), [0])})
    stats = mgr.finish(rid)
    mgr.check_invariants()
    return {
        "request": rid,
        "prompt_tokens": len(tokens),
        "cached_tokens": stats.cached_tokens,
        "reason": stats.reason,
        "copies": len(step.copies),
        "saves": [s.position for s in plan.saves],
        "explain": res.explain(),
    }


def run_demo(lengths: Sequence[int], seed: int) -> list[dict[str, object]]:
    mgr = KVCacheManager(demo_config())
    rng = random.Random(seed)
    out = []
    for length in lengths:
        tokens = [rng.randrange(32000) for _ in range(length)]
        out.append(_run_once(mgr, f"cold-{length}", tokens))
        out.append(_run_once(mgr, f"warm-{length}", tokens))
    return out


DEMO_MAX_LENGTH = 1 << 20  # tokens per demo prompt; the demo's pool holds far more


def _cmd_demo(args: argparse.Namespace) -> int:
    rows = run_demo(args.lengths, args.seed)
    if args.json:
        for row in rows:
            print(json.dumps({k: v for k, v in row.items() if k != "explain"}))
        return 0
    print("geometry: full attention 2048 x dcp 4 = 8192-token pages + recurrent 256, unit 256")
    for row in rows:
        print(
            f"\n{row['request']:>12}: {row['cached_tokens']:>5,} of {row['prompt_tokens']:,} "
            f"tokens reused ({row['reason']}); copies {row['copies']}, "
            f"checkpoints saved at {row['saves']}"
        )
        print(row["explain"])
    return 0


def _serve_option_error(args: argparse.Namespace) -> str | None:
    """The first bad `serve` option as one line, or None."""
    from kvreuse.serve import ops_options as ops

    if not 0 <= args.port <= 65535:
        return f"--port must be a TCP port in [0, 65535], got {args.port}"
    problem = ops.option_error(args)
    if problem is not None:
        return problem
    for flag, value in (
        ("--max-pending", args.max_pending),
        ("--max-body-bytes", args.max_body_bytes),
    ):
        if value < 1:
            return f"{flag} must be at least 1, got {value}"
    for flag, num in (
        ("--stream-stall-timeout", args.stream_stall_timeout),
        ("--drain-timeout", args.drain_timeout),
    ):
        if not num > 0:
            return f"{flag} must be a number of seconds > 0, got {num}"
    problem = _tier_option_error(args)
    if problem is not None:
        return problem
    from kvreuse.events.options import option_error

    return option_error(args)


def _tier_option_error(args: argparse.Namespace) -> str | None:
    url = args.store_url
    if url is not None and args.store_capacity is None:
        return "--store-url names the store tier's server: give --store-capacity too"
    if args.store_capacity is not None and url is None and not args.fake:
        return "--store-capacity needs --store-url redis://HOST:PORT (the store's bytes) or --fake"
    if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
        from kvreuse.serve.store_view import redacted

        return f"--store-url must be a redis://, rediss:// or unix:// URL, got {redacted(url)!r}"
    if not (math.isfinite(args.store_lease) and 0.05 <= args.store_lease <= 3600):
        return f"--store-lease must be seconds in [0.05, 3600], got {args.store_lease}"
    if args.store_shared and url is None:
        return "--store-shared needs --store-url and --store-capacity (the store they share)"
    return None


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvreuse.events.options import describe, open_publisher
    from kvreuse.serve import ops_options as ops
    from kvreuse.serve.backend import TierOptions, default_backend, fake_backend
    from kvreuse.serve.server import bind, run_server

    args.admin_token = ops.admin_token(args.admin_token)
    problem = _serve_option_error(args)
    if problem is not None:
        print(f"kvreuse serve: {problem}", file=sys.stderr)
        return 2
    sockets: list = []  # closed again if anything below fails
    try:
        sockets.append(bind(args.host, args.port))
        metrics = ops.bind_metrics(args)
        if metrics is not None:
            sockets.append(metrics)
        tiers = TierOptions(
            args.host_capacity,
            args.store_capacity,
            args.store_admission,
            args.store_url,
            args.store_shared,
            args.store_lease,
        )
        if args.fake:
            backend = fake_backend(args.geometry, num_blocks=args.num_blocks, tiers=tiers)
        else:
            backend = default_backend(args.model, args.geometry, args.num_blocks, tiers)
        kv_events = open_publisher(args, backend.mgr.geo)
    except (RuntimeError, ValueError, OSError) as exc:
        where = f" ({exc.strerror})" if isinstance(exc, OSError) and exc.strerror else ""
        text = f"cannot listen on {args.host}:{args.port}{where}" if where else str(exc)
        print(f"kvreuse serve: {text}", file=sys.stderr)
        for sock in sockets:
            sock.close()
        return 2
    from kvreuse.serve.app import create_app

    ports = [sock.getsockname()[1] for sock in sockets]
    app = create_app(
        backend,
        max_pending=args.max_pending,
        force_include_usage=args.force_include_usage,
        max_body_bytes=args.max_body_bytes,
        stream_stall_timeout=args.stream_stall_timeout,
        admin_token=args.admin_token,
        metrics_port=ports[1] if len(ports) > 1 else None,
        kv_events=kv_events,
    )
    for note in backend.notes:
        print(f"kvreuse serve: {note}", file=sys.stderr)
    print(
        f"kvreuse serve: {backend.name} on http://{_host(args.host)}:{ports[0]}/v1", file=sys.stderr
    )
    if len(sockets) > 1:
        print(f"kvreuse serve: metrics on {ops.metrics_url(args, sockets[1])}", file=sys.stderr)
    if kv_events is not None:
        print(f"kvreuse serve: {describe(kv_events)}", file=sys.stderr)
    return run_server(app, sockets, args.drain_timeout)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from kvreuse.serve.options import add_arguments

    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible server with exact cached-token usage",
        description="Serve the reference engine (or a fake model) behind an OpenAI-compatible "
        "API whose usage reports the exact cached tokens, with Prometheus metrics and, "
        "optionally, KV events for routers.",
        formatter_class=Help,
    )
    add_arguments(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_qualify(args: argparse.Namespace) -> int:
    from kvreuse.qualify import main as qualify_main

    return qualify_main(args)


def _add_qualify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "qualify",
        help="check a server's cached tokens against the spec",
        description="Check every cached_tokens a server reports against the spec's rules. "
        "Exit codes: 0 passed, 1 failed, 2 usage error or no server to check, 130 Ctrl-C.",
        formatter_class=Help,
    )
    p.add_argument("--url", default=None, help="server to check (default: start one in-process)")
    p.add_argument("--out", default="qualify-out", help="directory for qualify.json / .md")
    p.add_argument("--quick", action="store_true", help="small scenarios (seconds)")
    p.add_argument("--model", default=None, help="in-process server: model directory")
    p.add_argument("--geometry", default=None, help="in-process server: preset or TOML file")
    p.add_argument("--fake", action="store_true", help="in-process server: fake model")
    add_num_blocks(
        p, "in-process server: cache size (default: 192, 48 with --quick; small enough to fill)"
    )
    p.add_argument(
        "--max-fill-tokens",
        type=size(0, 2**63 - 1),
        default=None,
        help="token budget of scenario (e); larger caches are skipped "
        "(default: 60,000, 12,000 with --quick)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=_cmd_qualify)


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (and --help named) instead of two."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class _Version(argparse.Action):
    """--version: the text is made when asked (it reads the installed metadata)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(
            option_strings,
            argparse.SUPPRESS,  # as argparse's own: no attribute on the parsed namespace
            default=argparse.SUPPRESS,
            nargs=0,
            help="show program's version number and exit",
        )

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> NoReturn:
        print(f"kvreuse {_version()}")  # on stdout, as argparse's own version action
        parser.exit()


def _add_demo(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo",
        help="cold request + identical resend on a DCP4 hybrid",
        description="A cold request and its identical resend on the cache manager alone, with "
        "the hybrid-dcp4 groups: the tokens reused, the reason, copies and checkpoints, and "
        "the lookup's explanation.",
        formatter_class=Help,
    )
    demo.add_argument(
        "--lengths",
        type=size_list(1, DEMO_MAX_LENGTH),
        default="2048,2049",
        help="comma-separated prompt lengths in tokens",
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    demo.add_argument("--json", action="store_true", help="one JSON object per request")
    demo.set_defaults(func=_cmd_demo)


def _add_workload(sub: argparse._SubParsersAction) -> None:
    from kvreuse.sim.workload_cli import add_parser

    add_parser(sub)


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    from kvreuse.fleet.simulation.cli import add_fleet_arguments, fleet_requested, run_fleet
    from kvreuse.sim.cli import add_parser
    from kvreuse.sim.vllm_cli import add_engine_argument, run_vllm

    add_parser(sub)
    simulate = sub.choices["simulate"]  # --replicas N runs a fleet (kvreuse.fleet sits above sim)
    add_fleet_arguments(simulate)
    add_engine_argument(simulate)  # --engine vllm refuses the fleet's options itself
    single = simulate.get_default("func")
    simulate.set_defaults(
        func=lambda a: (
            run_vllm(a) if a.engine == "vllm" else run_fleet(a) if fleet_requested(a) else single(a)
        )
    )


def _add_sweep(sub: argparse._SubParsersAction) -> None:
    from kvreuse.sim.sweep_cli import add_parser

    add_parser(sub)


def _add_fleet_front(sub: argparse._SubParsersAction) -> None:
    from kvreuse.fleet.serving.cli import add_parser

    add_parser(sub)  # `kvreuse fleet` and `kvreuse route`


# Each command's subparser, in the order --help lists them; the front adds two commands.
_COMMANDS = (
    (("demo",), _add_demo),
    (("workload",), _add_workload),
    (("simulate",), _add_simulate),
    (("sweep",), _add_sweep),
    (("geometry",), add_geometry),
    (("serve",), _add_serve),
    (("qualify",), _add_qualify),
    (("fleet", "route"), _add_fleet_front),
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `command` (one of its commands) only that command's
    subparser is built, so a run imports what its command needs and nothing else."""
    parser = Parser(
        prog="kvreuse",
        description="Exact prefix-cache reuse for LLM serving: simulate a deployment, serve "
        "the reference model, route a fleet, qualify a server. `kvreuse COMMAND --help` "
        "describes each command.",
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)
    for names, add in _COMMANDS:
        if command is None or command in names:
            add(sub)
    return parser


def _version() -> str:
    """The package version and the core path in use: native C kernels or pure Python."""
    from importlib.metadata import PackageNotFoundError, version

    from kvreuse.core.spi import describe_core_path

    try:
        number = version("kvreuse")
    except PackageNotFoundError:  # run from a source tree that was never installed
        number = "unknown"
    return f"{number}, {describe_core_path()}"


# The optional packages each extra brings (pyproject.toml), to name the one a command needs.
EXTRAS = {
    **dict.fromkeys(("tqdm", "matplotlib"), "sim"),
    **dict.fromkeys(("torch", "safetensors", "tokenizers"), "engine"),
    **dict.fromkeys(
        ("fastapi", "starlette", "pydantic", "uvicorn", "prometheus_client", "httpx", "rich"),
        "server",
    ),
}
SIGPIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader left


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    named = words[0] if words and any(words[0] in names for names, _ in _COMMANDS) else None
    args = build_parser(named).parse_args(words)
    try:
        return int(args.func(args))
    except ModuleNotFoundError as exc:
        extra = EXTRAS.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        print(
            f"kvreuse {args.command}: needs {exc.name}, which is not installed: "
            f"pip install -e '.[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"kvreuse {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader left (`| head`): stop quietly; point stdout at /dev/null so the final
        # flush at exit does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return SIGPIPE_EXIT


if __name__ == "__main__":
    raise SystemExit(main())
