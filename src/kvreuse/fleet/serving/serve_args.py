"""What `kvreuse fleet` passes to each of its `kvreuse serve` replicas: its own replica options
(which the front must know too), then the options after `--`, checked by serve's own parser;
and what `kvreuse route` reads of a replica started elsewhere (`replica_spec`).

The check asks `kvreuse serve`'s parser (`kvreuse.serve.options.serve_parser`) which options
the words after `--` set, so an abbreviation (`--kv-events-mo`, which serve's argparse takes for
`--kv-events-mode`) or an `--opt=value` form is judged exactly as the replica will read it,
and a word the replica would refuse is one line from the fleet before any replica starts.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

# Options `kvreuse fleet` sets on each replica itself; given after `--` they are refused.
FLEET_OWNED: tuple[str, ...] = ("--host", "--port", "--metrics-port", "--metrics-host")
FLEET_OWNED += ("--kv-events-endpoint", "--kv-events-replay-endpoint", "--kv-events-mode")
FLEET_OWNED += ("--kv-events-curve-secret-key",)  # each replica's own, from the front
# The fleet's own replica options: the front must know them (geometry, tokenizer).
FLEET_OPTIONS = ("--geometry", "--model", "--fake", "--num-blocks", "--max-pending")
SERVE_HELP = "kvreuse serve --help lists the replicas' options"


class UsageError(ValueError):
    """A bad option or replica; printed as one line, exit code 2."""


class _Probe(argparse.ArgumentParser):
    """serve's parser as the fleet asks it: what would end the replica is a UsageError."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"after --: {message} ({SERVE_HELP})")

    def print_help(self, file: object = None) -> None:
        pass

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:  # --help
        raise UsageError(f"after --: the replicas take no --help ({SERVE_HELP})")


def given_serve_options(serve_args: list[str]) -> set[str]:
    """The destinations of the serve options that `serve_args` set, as serve's parser reads
    them; UsageError for words it would refuse."""
    from kvreuse.serve.options import serve_parser

    parser = serve_parser(_Probe)
    unset = object()
    # argparse fills in a default only where the namespace has no value yet
    probe = argparse.Namespace(**dict.fromkeys(vars(parser.parse_args([])), unset))
    parsed = parser.parse_args(serve_args, namespace=probe)
    return {dest for dest, value in vars(parsed).items() if value is not unset}


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _as_typed(flag: str, serve_args: list[str]) -> str:
    """`flag` as the user spelled it, for the message: `--kv-events-mo (taken as …)`."""
    for arg in serve_args:
        word = arg.split("=", 1)[0]
        if word.startswith("--") and word != flag and flag.startswith(word):
            return f"{word} (taken as {flag})"
    return flag


def replica_args(args: argparse.Namespace) -> list[str]:
    """What every replica gets: the fleet's replica options, then those after `--`."""
    given = given_serve_options(list(args.serve_args))
    for flag in FLEET_OWNED:
        if _dest(flag) in given:
            typed = _as_typed(flag, args.serve_args)
            raise UsageError(f"{typed} is set by kvreuse fleet for each replica; leave it out")
    for flag in FLEET_OPTIONS:
        if _dest(flag) in given:
            typed = _as_typed(flag, args.serve_args)
            raise UsageError(f"{typed} is an option of kvreuse fleet: give it before --")
    out: list[str] = []
    if args.geometry is not None:
        out += ["--geometry", args.geometry]
    if args.model is not None:
        out += ["--model", args.model]
    if args.fake:
        out.append("--fake")
    if args.num_blocks is not None:
        out += ["--num-blocks", str(args.num_blocks)]
    if args.max_pending is not None:
        out += ["--max-pending", str(args.max_pending)]
    return out + list(args.serve_args)


def replica_spec(text: str) -> tuple[str, str, str | None, str | None]:
    """URL, events and replay endpoints, and the publisher's CURVE public key (a Z85 key or a
    zmq certificate file) of one --replica."""
    from kvreuse.events.common import endpoint_problem

    parts = text.split(",")
    if not 2 <= len(parts) <= 4 or not all(parts[:2]) or (len(parts) == 4 and not parts[2]):
        raise UsageError(
            f"--replica must be URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT[,CURVE_KEY]], got {text!r}"
        )
    url, events = parts[0].rstrip("/"), parts[1]
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--replica: the URL must start with http:// or https://, got {url!r}")
    for endpoint in parts[1:3]:
        problem = endpoint_problem(endpoint)
        if problem is not None:
            raise UsageError(f"--replica {text}: {problem}, got {endpoint!r}")
    key = None
    if len(parts) == 4:
        from kvreuse.events.curve import read_key

        try:
            key = read_key(parts[3], "public-key")
        except ValueError as exc:
            raise UsageError(f"--replica {url}: CURVE key: {exc}") from None
    return url, events, parts[2] if len(parts) >= 3 else None, key
