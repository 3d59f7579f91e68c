"""The publisher's options as `kvreuse serve` takes them, and their checks.

The flags are vLLM's `KVEventsConfig` field names (`--kv-events-endpoint` is its `endpoint`),
with its socket semantics: a wildcard endpoint (`tcp://*:5557`) or an `ipc://` one binds, a
specific address connects to a subscriber bound there; the replay endpoint binds. This module
needs neither pyzmq nor msgspec, so the command line can offer the flags without them.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from kvreuse.events.common import DEFAULT_BUFFER_STEPS, MODES, SECRET_ENV, endpoint_problem

if TYPE_CHECKING:
    from kvreuse.core import Geometry
    from kvreuse.events.publisher import Publisher


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--kv-events-*` flags (all off by default)."""
    g = parser.add_argument_group(
        "KV events", "publish the cache's KV events in vLLM's ZeroMQ format (docs/events.md)"
    )
    g.add_argument(
        "--kv-events-endpoint",
        metavar="ENDPOINT",
        help="publish here: tcp://*:5557 binds every interface, tcp://HOST:PORT connects to a "
        "subscriber bound there, ipc://PATH binds (default: no events)",
    )
    g.add_argument(
        "--kv-events-replay-endpoint",
        metavar="ENDPOINT",
        help="a ROUTER socket (binds) resending buffered batches to a subscriber that missed some",
    )
    g.add_argument(
        "--kv-events-mode",
        metavar="{" + ",".join(MODES) + "}",
        help="groups: every group with its index and kind (default); routable: the attention "
        "group, only blocks the whole model can reuse; legacy: the attention group, positional",
    )
    g.add_argument("--kv-events-topic", help="topic frame of every batch (default: empty)")
    g.add_argument(
        "--kv-events-buffer-steps",
        type=int,
        metavar="N",
        help=f"batches kept for replay (default {DEFAULT_BUFFER_STEPS:,})",
    )
    g.add_argument(
        "--kv-events-curve-secret-key",
        metavar="KEY|FILE",
        help="authenticate and encrypt both sockets with ZeroMQ CURVE: a 40-character Z85 "
        f"secret key or a zmq certificate file (default: ${SECRET_ENV} when set, else none)",
    )


_NEEDS_ENDPOINT = ("replay_endpoint", "mode", "topic", "buffer_steps", "curve_secret_key")


def option_error(args: argparse.Namespace) -> str | None:
    """The first bad `--kv-events-*` value as one line, or None."""
    endpoint = args.kv_events_endpoint
    if endpoint is None:
        for name in _NEEDS_ENDPOINT:
            if getattr(args, f"kv_events_{name}") is not None:
                flag = "--kv-events-" + name.replace("_", "-")
                return f"{flag} needs --kv-events-endpoint (where the events go)"
        return None
    replay = args.kv_events_replay_endpoint
    for flag, value in (
        ("--kv-events-endpoint", endpoint),
        ("--kv-events-replay-endpoint", replay),
    ):
        problem = None if value is None else endpoint_problem(value)
        if problem is not None:
            return f"{flag}: {problem}, got {value!r}"
    if replay is not None and replay == endpoint:
        return "--kv-events-replay-endpoint must differ from --kv-events-endpoint"
    mode = args.kv_events_mode
    if mode is not None and mode not in MODES:
        return f"--kv-events-mode must be one of {', '.join(MODES)}, got {mode!r}"
    steps = args.kv_events_buffer_steps
    if steps is not None and steps < 1:
        return f"--kv-events-buffer-steps must be at least 1, got {steps}"
    return None


def curve_secret(args: argparse.Namespace) -> str | None:
    """The CURVE secret key asked for (the flag, else the environment), or None; ValueError
    naming what is wrong with it."""
    given = args.kv_events_curve_secret_key or os.environ.get(SECRET_ENV) or None
    if given is None:
        return None
    from kvreuse.events.curve import read_key

    try:
        return read_key(given)
    except ValueError as exc:
        raise ValueError(f"--kv-events-curve-secret-key: {exc}") from None


def open_publisher(args: argparse.Namespace, geometry: Geometry) -> Publisher | None:
    """The publisher the options ask for (None without `--kv-events-endpoint`); ValueError when
    an endpoint cannot be opened or the mode does not fit the geometry."""
    if args.kv_events_endpoint is None:
        return None
    try:
        from kvreuse.events.publisher import Publisher
    except ModuleNotFoundError as exc:
        if exc.name not in ("zmq", "msgspec"):
            raise
        raise ValueError(f"KV events need {exc.name}: pip install -e '.[events]'") from None

    return Publisher(
        geometry,
        endpoint=args.kv_events_endpoint,
        replay_endpoint=args.kv_events_replay_endpoint,
        buffer_steps=args.kv_events_buffer_steps or DEFAULT_BUFFER_STEPS,
        topic=args.kv_events_topic or "",
        mode=args.kv_events_mode or "groups",
        curve_secret_key=curve_secret(args),
    )


def describe(publisher: Publisher) -> str:
    """One line for the operator: mode and the sockets actually opened."""
    line = f"KV events ({publisher.mode}) on {publisher.endpoint}"
    if publisher.replay_endpoint is not None:
        line += f", replay on {publisher.replay_endpoint}"
    if publisher.curve_public_key is not None:  # on a line of its own: routers copy it
        line += f"\nkvreuse serve: KV events CURVE public key {publisher.curve_public_key}"
    return line
