"""`kvreuse serve`'s options, apart from the command (`kvreuse.cli`), so that `kvreuse fleet`
can ask serve's own parser how the options it passes on to its replicas resolve. Needs none of
the server's packages.
"""

from __future__ import annotations

import argparse

from kvreuse.events.options import add_arguments as add_kv_events
from kvreuse.serve import defaults
from kvreuse.serve.ops_options import add_arguments as add_operator_options
from kvreuse.vocab import add_num_blocks, add_tier_options


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every option of `kvreuse serve`."""
    p.add_argument("--model", default=None, help="model directory (default: the embedded tiny)")
    p.add_argument("--geometry", default=None, help="geometry preset name or TOML file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    add_num_blocks(p, "the cache's pool in blocks (default: the geometry's)")
    add_tier_options(p, "the cache")
    p.add_argument(
        "--store-url",
        default=None,
        metavar="URL",
        help="the Redis server that holds the store tier's bytes (redis://HOST:PORT/DB); "
        "needed by --store-capacity unless --fake",
    )
    p.add_argument(
        "--store-shared",
        action="store_true",
        help="share the store tier with every server of this model and cache layout on "
        "--store-url (its index kept in the server too; the servers take their steps in "
        "turn)",
    )
    p.add_argument(
        "--store-lease",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long a server's turn on a shared store lasts before the others may take it: "
        "a server paused longer finds its turn fenced out and its writes refused (default 10)",
    )
    p.add_argument(
        "--max-pending",
        type=int,
        default=defaults.MAX_PENDING,
        help="requests in flight before 429",
    )
    p.add_argument("--fake", action="store_true", help="deterministic fake model (no torch)")
    p.add_argument(
        "--force-include-usage",
        action="store_true",
        help="end every stream with a usage chunk, asked for or not",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=defaults.MAX_BODY_BYTES,
        help="largest request body (413 beyond; default 8 MiB)",
    )
    p.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=defaults.STREAM_STALL_S,
        help="seconds a stream may wait for a client that stopped reading",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=defaults.DRAIN_TIMEOUT_S,
        help="on SIGTERM, seconds running requests get to finish",
    )
    add_operator_options(p, "/reset_prefix_cache")
    add_kv_events(p)


def serve_parser(parser_class: type[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """`kvreuse serve`'s own parser, alone, built with `parser_class`: `kvreuse fleet` asks it
    how the options it passes on to its replicas resolve (abbreviations included)."""
    sub = parser_class(prog="kvreuse").add_subparsers()
    p = sub.add_parser("serve")
    add_arguments(p)
    return p
