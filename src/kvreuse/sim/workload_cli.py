"""`kvreuse workload KIND [options] > FILE.jsonl`: the generators' command line.

Every option is checked by its argparse type (a positive integer within a sane bound), so a
mistake is one usage line (exit 2), never a traceback or a run that fills the disk.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from kvreuse.deployment import GeometryError
from kvreuse.sim.generators import GENERATORS
from kvreuse.sim.workload import MAX_TOKENS_PER_REQUEST

MAX_COUNT = 1_000_000  # requests, sessions, turns, sequences, repeats


def int_range(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (argparse names the option in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be an integer in {low:,} … {high:,}, got {text!r}"
            )
        return value

    return parse


def positive_int(limit: int) -> Callable[[str], int]:
    """An argparse type: an integer in [1, limit]."""
    return int_range(1, limit)


def int_list(limit: int) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated integers, each in [1, limit]."""
    one = positive_int(limit)

    def parse(text: str) -> list[int]:
        try:
            values = [one(x.strip()) for x in text.split(",") if x.strip()]
        except argparse.ArgumentTypeError:
            values = []
        if not values:
            raise argparse.ArgumentTypeError(
                f"must be comma-separated integers in 1 … {limit:,}, got {text!r}"
            )
        return values

    return parse


def seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


TOKENS = positive_int(MAX_TOKENS_PER_REQUEST)
COUNT = positive_int(MAX_COUNT)


# per kind: (flag, parser of its value, default, help)
OPTIONS: dict[str, list[tuple[str, Callable[[str], Any], Any, str]]] = {
    "resend-grid": [
        (
            "--lengths",
            int_list(MAX_TOKENS_PER_REQUEST),
            "255,256,257,2047,2048,2049,4096,8191,8192,8193",
            "prompt lengths, comma-separated",
        ),
        ("--extra", TOKENS, 8, "tokens appended for the extended prompt"),
        ("--max-tokens", TOKENS, 1, "output tokens per request"),
    ],
    "shared-prefix": [
        ("--prefix-len", TOKENS, 4096, "tokens of the shared system prompt"),
        ("--suffix-len", TOKENS, 256, "tokens of each request's own suffix"),
        ("--requests", COUNT, 32, "requests, all arriving at time 0"),
        ("--max-tokens", TOKENS, 1, "output tokens per request"),
    ],
    "agent": [
        ("--sessions", COUNT, 1, "independent agent sessions"),
        ("--turns", COUNT, 64, "turns per session"),
        ("--user-len", TOKENS, 64, "tokens of each user message"),
        ("--tool-len", TOKENS, 256, "tokens of each tool result"),
        ("--max-tokens", TOKENS, 32, "output tokens per turn"),
    ],
    "retrieval": [
        ("--length", TOKENS, 32768, "tokens of the document"),
        ("--max-tokens", TOKENS, 16, "output tokens per request"),
    ],
    "pressure": [
        (
            "--sequences",
            COUNT,
            None,
            "distinct sequences (default: enough to fill 1.5 × the --geometry's cache)",
        ),
        ("--length", TOKENS, 8192, "tokens per sequence"),
        ("--repeats", COUNT, 2, "passes over the sequences (the first fills)"),
        ("--max-tokens", TOKENS, 1, "output tokens per request"),
        (
            "--geometry",
            str,
            "hybrid-dcp4",
            "preset or geometry file whose cache the default --sequences fills",
        ),
    ],
}


def add_parser(sub: Any) -> None:
    wl = sub.add_parser(
        "workload",
        help="generate a JSONL workload on stdout",
        description="Write a workload (one JSON request per line) to stdout.",
    )
    kinds = wl.add_subparsers(dest="kind", required=True, metavar="KIND")
    for kind, options in OPTIONS.items():
        doc = (GENERATORS[kind].__doc__ or "").split("\n\n")[0]
        p = kinds.add_parser(
            kind,
            help=doc.splitlines()[0],
            description=" ".join(doc.split()),
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        for flag, typ, default, text in options:
            # `--len` is accepted for `--length` (the workload format's name)
            aliases = ("--len",) if flag == "--length" else ()
            p.add_argument(flag, *aliases, type=typ, default=default, help=text)
        p.add_argument("--seed", type=seed, default=0, help="seed of the random prompts")
        p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    opts = {k: v for k, v in vars(args).items() if k not in ("command", "func", "kind")}
    try:
        lines = GENERATORS[args.kind](**opts)
    except (ValueError, GeometryError) as exc:
        print(f"kvreuse workload {args.kind}: {exc}", file=sys.stderr)
        return 2
    out = sys.stdout
    for line in lines:
        out.write(json.dumps(line) + "\n")
    return 0
