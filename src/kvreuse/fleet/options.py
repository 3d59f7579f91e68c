"""The options every fleet command declares alike: how a replica is built (`kvreuse fleet` and
the Ray Serve application pass them on to each replica's `kvreuse serve`) and the routing
cost's load weight (those two and `kvreuse simulate --replicas`). Imports no extra."""

from __future__ import annotations

from typing import Any

from kvreuse.fleet import DEFAULT_LOAD_WEIGHT
from kvreuse.vocab import add_num_blocks, number

MAX_LOAD_WEIGHT = 1e9  # prefill tokens per token of load: far past any that still routes by cache


def add_replica_options(p: Any) -> None:
    """`--geometry`, `--model`, `--fake`, `--num-blocks`: every replica's `kvreuse serve`."""
    p.add_argument("--geometry", default=None, help="preset or TOML file of every replica")
    p.add_argument("--model", default=None, help="replicas: model directory (default: tiny)")
    p.add_argument("--fake", action="store_true", help="replicas: deterministic fake model")
    add_num_blocks(p, "each replica's pool, in blocks")


def add_load_weight(p: Any, help: str) -> None:
    """`--load-weight X`: prefill tokens one token of a replica's load is worth
    (DEFAULT_LOAD_WEIGHT unless given)."""
    p.add_argument(
        "--load-weight", type=number(0, MAX_LOAD_WEIGHT), default=DEFAULT_LOAD_WEIGHT, help=help
    )
