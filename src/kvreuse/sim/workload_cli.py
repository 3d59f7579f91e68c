"""`kvreuse workload KIND [options] > FILE.jsonl`: the generators' command line, and
`kvreuse workload import FORMAT FILE`, which converts a public trace (kvreuse.sim.traces).

Every option is checked by its argparse type (a positive integer within a sane bound), so a
mistake is one usage line (exit 2), never a traceback or a run that fills the disk.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import IO, Any

from kvreuse.deployment import GeometryError
from kvreuse.sim.generators import GENERATORS
from kvreuse.sim.traces import FORMATS, ImportOptions, ImportStats, add_time_scale, import_trace
from kvreuse.sim.workload import MAX_BLOCK_TOKENS, MAX_TOKENS_PER_REQUEST, WorkloadError
from kvreuse.vocab import Help, int_range, number, size, size_list

MAX_COUNT = 1_000_000  # requests, sessions, turns, sequences, repeats


def positive_int(limit: int) -> Callable[[str], int]:
    """An argparse type: an integer in [1, limit]."""
    return int_range(1, limit)


def tokens(limit: int) -> Callable[[str], int]:
    """An argparse type: a count of tokens in [1, limit], as a size (`4096`, `32K`)."""
    return size(1, limit)


def seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


TOKENS = tokens(MAX_TOKENS_PER_REQUEST)
COUNT = positive_int(MAX_COUNT)


# per kind: (flag, parser of its value, default, help)
OPTIONS: dict[str, list[tuple[str, Callable[[str], Any], Any, str]]] = {
    "resend-grid": [
        (
            "--lengths",
            size_list(1, MAX_TOKENS_PER_REQUEST),
            "255,256,257,2047,2048,2049,4096,8191,8192,8193",
            "prompt lengths in tokens, comma-separated",
        ),
        ("--extra", TOKENS, 8, "tokens appended to each prompt for its appended-P request"),
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
            "distinct sequences (default: as many as fill 1.5 × the --geometry's pool)",
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


# per kind: the one-line help `kvreuse workload --help` lists, and the description of its own
# --help, written for the command line (the generators' docstrings name their parameters)
ABOUT: dict[str, tuple[str, str]] = {
    "resend-grid": (
        "per length: a cold request, its identical resend, the prompt with tokens appended",
        "For each of --lengths P: a cold request (cold-P), an identical resend (warm-P) and "
        "the prompt with --extra tokens appended (appended-P). One request at a time, each "
        "waiting for the one before, so a request's TTFT is its own prefill.",
    ),
    "shared-prefix": (
        "requests arriving together that share one system prompt",
        "--requests requests, all arriving at time 0, each a --prefix-len-token system prompt "
        "shared by all followed by a --suffix-len-token suffix of its own (a burst).",
    ),
    "agent": (
        "multi-turn agent sessions, each turn continuing the previous one's history",
        "--sessions sessions of --turns turns: each turn's prompt is the previous turn's prompt "
        "and generated tokens, then a --tool-len-token tool result and a --user-len-token user "
        "message.",
    ),
    "retrieval": (
        "one long document, cold, then warm",
        "One --length-token document sent twice: cold, then an identical warm resend.",
    ),
    "pressure": (
        "long sequences that overfill the pool, then replayed",
        "Long sequences one after another, then replayed (--repeats passes in all), each pass "
        "in the reverse order of the one before: a replay first finds the newest sequences "
        "cached and then the ones evicted. By default as many sequences as fill 1.5 × the "
        "pool of --geometry.",
    ),
}


def add_parser(sub: Any) -> None:
    wl = sub.add_parser(
        "workload",
        help="generate a JSONL workload on stdout",
        description="Write a workload (one JSON request per line) to stdout.",
    )
    kinds = wl.add_subparsers(dest="kind", required=True, metavar="KIND")
    for kind, options in OPTIONS.items():
        summary, description = ABOUT[kind]
        p = kinds.add_parser(kind, help=summary, description=description, formatter_class=Help)
        for flag, typ, default, text in options:
            # `--len` is accepted for `--length` (the workload format's name)
            aliases = ("--len",) if flag == "--length" else ()
            p.add_argument(flag, *aliases, type=typ, default=default, help=text)
        p.add_argument("--seed", type=seed, default=0, help="seed of the random prompts")
        p.set_defaults(func=run)
    _add_import(kinds)


def _add_import(kinds: Any) -> None:
    p = kinds.add_parser(
        "import",
        help="convert a public trace (mooncake, bailian) into a workload",
        description="Convert a request trace into a workload on stdout, one line per record "
        "read (memory does not grow with the trace). mooncake: Mooncake's FAST'25 traces "
        "(timestamp in ms, 512-token hash blocks); bailian: Alibaba Bailian's Qwen traces "
        "(chat and parent ids, timestamp in s, 16-token hash blocks). A bad record is one "
        "error line naming the file, the line and the field (exit 2).",
        formatter_class=Help,
    )
    p.add_argument("format", choices=sorted(FORMATS), help="the trace's format")
    p.add_argument("file", help="the trace, JSON lines ('-': standard input)")
    p.add_argument(
        "--block-tokens",
        type=tokens(MAX_BLOCK_TOKENS),
        default=None,
        help="tokens per hash id (default: the format's, 512 for mooncake, 16 for bailian)",
    )
    p.add_argument(
        "--limit",
        type=positive_int(2**63 - 1),
        default=None,
        help="write at most N requests (default: all)",
    )
    add_time_scale(p, ImportOptions.time_scale)
    p.add_argument(
        "--sample",
        type=number(0, 1, low_open=True),
        default=1.0,
        help="keep this fraction of the requests (bailian: of the sessions), chosen by --seed",
    )
    p.add_argument("--seed", type=seed, default=0, help="seed of --sample")
    p.set_defaults(func=run_import)


def run_import(args: argparse.Namespace) -> int:
    options = ImportOptions(args.block_tokens, args.limit, args.time_scale, args.sample, args.seed)
    stats = ImportStats()
    prog = f"kvreuse workload import {args.format}"
    name = "<stdin>" if args.file == "-" else args.file
    try:
        trace = _open(args.file)
    except OSError as exc:
        print(f"{prog}: {name}: cannot read the trace ({exc.strerror})", file=sys.stderr)
        return 2
    try:
        with trace:
            out = sys.stdout
            for line in import_trace(args.format, trace, name, options, stats):
                out.write(_json(line))
    except WorkloadError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if isinstance(exc, BrokenPipeError):
            raise  # the reader left: `kvreuse` exits quietly (141)
        print(f"{prog}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"{prog}: {stats.summary()}", file=sys.stderr)
    return 0


def _open(path: str) -> IO[bytes]:
    if path == "-":
        return open(sys.stdin.fileno(), "rb", closefd=False)
    return open(path, "rb")


def run(args: argparse.Namespace) -> int:
    opts = {k: v for k, v in vars(args).items() if k not in ("command", "func", "kind")}
    try:
        lines = GENERATORS[args.kind](**opts)
    except (ValueError, GeometryError) as exc:
        print(f"kvreuse workload {args.kind}: {exc}", file=sys.stderr)
        return 2
    out = sys.stdout
    for line in lines:
        out.write(_json(line))
    return 0


def _json(line: dict[str, Any]) -> str:
    """A workload line as JSON. Every number was checked finite before; were one not, this
    refuses it (ValueError) rather than write NaN or Infinity, which JSON does not have."""
    return json.dumps(line, allow_nan=False) + "\n"
