"""Command line: `kvreuse demo` (and `python -m kvreuse demo`).

The demo runs a cold request and an identical warm resend on the DCP4 hybrid geometry of the
issue (full attention, local block 2048 × dcp 4 = 8192-token pages, a 256-token recurrent
group, hash unit 256) and prints what was reused and why.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence

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
    specs = {
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
            p.add_argument(flag, type=typ, default=default)
        p.add_argument("--seed", type=int, default=0)
        p.set_defaults(func=_cmd_workload)


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
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
