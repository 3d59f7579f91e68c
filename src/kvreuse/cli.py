"""Command line: `kvreuse demo | workload | simulate | serve | qualify` (also `python -m kvreuse`).

The demo runs a cold request and an identical warm resend on the groups of the `hybrid-dcp4`
preset (full attention, local block 2048 × dcp 4 = 8192-token pages, a 256-token recurrent
group, hash unit 256) and prints what was reused and why.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvreuse.core import CacheConfig, GroupSpec, KVCacheManager, Request


def demo_config(num_blocks: int = 4096) -> CacheConfig:
    return CacheConfig(
        num_blocks=num_blocks,
        dcp_size=4,
        hash_unit=256,
        groups=[
            GroupSpec(kind="full", block_size=2048),
            GroupSpec(kind="recurrent", block_size=256),
        ],
    )


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


def _cmd_demo(args: argparse.Namespace) -> int:
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    if not lengths or min(lengths) < 1:
        print(
            f"kvreuse demo: --lengths must be positive integers, got {args.lengths!r}",
            file=sys.stderr,
        )
        return 2
    rows = run_demo(lengths, args.seed)
    if args.json:
        for row in rows:
            print(json.dumps({k: v for k, v in row.items() if k != "explain"}))
        return 0
    print("geometry: full attention 2048 x dcp 4 = 8192-token pages + recurrent 256, unit 256")
    for row in rows:
        print(
            f"\n{row['request']:>12}: {row['cached_tokens']:>5} of {row['prompt_tokens']} "
            f"tokens reused ({row['reason']}); copies {row['copies']}, "
            f"checkpoints saved at {row['saves']}"
        )
        print(row["explain"])
    return 0


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _cmd_workload(args: argparse.Namespace) -> int:
    from kvreuse.sim.generators import GENERATORS

    opts = {k: v for k, v in vars(args).items() if k not in ("command", "func", "kind")}
    try:
        lines = GENERATORS[args.kind](**opts)
    except ValueError as exc:
        print(f"kvreuse workload {args.kind}: {exc}", file=sys.stderr)
        return 2
    for line in lines:
        print(json.dumps(line))
    return 0


def _add_workload(sub: argparse._SubParsersAction) -> None:
    wl = sub.add_parser("workload", help="generate a JSONL workload on stdout")
    kinds = wl.add_subparsers(dest="kind", required=True)
    # per kind: (flag, parser of its value, default)
    specs: dict[str, list[tuple[str, Callable[[str], Any], Any]]] = {
        "resend-grid": [
            ("--lengths", _ints, "255,256,257,2047,2048,2049,4096,8191,8192,8193"),
            ("--extra", int, 8),
            ("--max-tokens", int, 1),
        ],
        "shared-prefix": [
            ("--prefix-len", int, 4096),
            ("--suffix-len", int, 256),
            ("--requests", int, 32),
            ("--max-tokens", int, 1),
        ],
        "agent": [
            ("--sessions", int, 1),
            ("--turns", int, 64),
            ("--user-len", int, 64),
            ("--tool-len", int, 256),
            ("--max-tokens", int, 32),
        ],
        "retrieval": [("--length", int, 32768), ("--max-tokens", int, 16)],
        "pressure": [
            ("--sequences", int, 8),
            ("--length", int, 8192),
            ("--repeats", int, 2),
            ("--max-tokens", int, 1),
        ],
    }
    for kind, options in specs.items():
        p = kinds.add_parser(kind)
        for flag, typ, default in options:
            # `--len` is accepted for `--length` (the workload format's name)
            aliases = ("--len",) if flag == "--length" else ()
            p.add_argument(flag, *aliases, type=typ, default=default)
        p.add_argument("--seed", type=int, default=0)
        p.set_defaults(func=_cmd_workload)


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvreuse.serve.backend import default_backend, fake_backend
    from kvreuse.serve.server import serve_forever

    try:
        if args.fake:
            backend = fake_backend(args.geometry, num_blocks=args.num_blocks)
        else:
            backend = default_backend(args.model, args.geometry, args.num_blocks)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"kvreuse serve: {exc}", file=sys.stderr)
        return 2
    from kvreuse.serve.app import create_app

    app = create_app(
        backend, max_pending=args.max_pending, force_include_usage=args.force_include_usage
    )
    print(f"kvreuse serve: {backend.name} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    serve_forever(app, args.host, args.port)
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server with exact cached-token usage")
    p.add_argument("--model", default=None, help="model directory (default: the embedded tiny)")
    p.add_argument("--geometry", default=None, help="geometry preset name or TOML file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--num-blocks", type=int, default=None, help="override the cache size")
    p.add_argument("--max-pending", type=int, default=256, help="requests in flight before 429")
    p.add_argument("--fake", action="store_true", help="deterministic fake model (no torch)")
    p.add_argument(
        "--force-include-usage",
        action="store_true",
        help="end every stream with a usage chunk, asked for or not",
    )
    p.set_defaults(func=_cmd_serve)


def _cmd_qualify(args: argparse.Namespace) -> int:
    from kvreuse.qualify import main as qualify_main

    return qualify_main(args)


def _add_qualify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("qualify", help="check a server's cached tokens against the spec")
    p.add_argument("--url", default=None, help="server to check (default: start one in-process)")
    p.add_argument("--out", default="qualify-out", help="directory for qualify.json / .md")
    p.add_argument("--quick", action="store_true", help="small scenarios (seconds)")
    p.add_argument("--model", default=None, help="in-process server: model directory")
    p.add_argument("--geometry", default=None, help="in-process server: preset or TOML file")
    p.add_argument("--fake", action="store_true", help="in-process server: fake model")
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="in-process server: cache size (default 256, small enough to fill)",
    )
    p.add_argument(
        "--max-fill-tokens",
        type=int,
        default=None,
        help="token budget of scenario (e); larger caches are skipped",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_qualify)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvreuse", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="cold request + identical resend on a DCP4 hybrid")
    demo.add_argument("--lengths", default="2048,2049", help="comma-separated prompt lengths")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="one JSON object per request")
    demo.set_defaults(func=_cmd_demo)
    _add_workload(sub)
    from kvreuse.sim.cli import add_parser as _add_simulate

    _add_simulate(sub)
    _add_serve(sub)
    _add_qualify(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
