"""`kvreuse fleet` (N local `kvreuse serve` replicas, restarted when they exit, and the routing
front) and `kvreuse route` (the front over replicas started elsewhere). docs/fleet-serving.md
has the guide.

    kvreuse fleet --replicas 3 [--policy exact] [--geometry G] [--port 8000] [--fake] [-- SERVE…]
    kvreuse route --replica URL,EVENTS[,REPLAY[,KEY]] … [--geometry G] [--policy exact]

Exit codes, as `kvreuse serve`'s: on SIGTERM the front stops serving, stops its replicas (each
drains), then ends by SIGTERM itself, as uvicorn does after a graceful shutdown so that a
supervisor sees the signal (a shell reports 143); 130 for Ctrl-C (after the same shutdown, or
while the replicas start); 2 for a usage error or replicas that could not be started.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvreuse.fleet import DEFAULT_HEALTH_INTERVAL_S, POLICIES
from kvreuse.fleet.options import add_load_weight, add_replica_options
from kvreuse.fleet.serving.deadlines import Deadlines
from kvreuse.fleet.serving.serve_args import UsageError, replica_args, replica_spec
from kvreuse.fleet.serving.supervise import RestartPolicy
from kvreuse.serve import ops_options
from kvreuse.vocab import Help, int_range

MAX_REPLICAS = 64
DEADLINE_OPTIONS = (  # (flag, Deadlines field, help)
    ("--connect-timeout", "connect", "seconds to connect to a replica (then: another replica)"),
    (
        "--first-byte-timeout",
        "first_byte",
        "seconds a stream's replica may take to its first bytes (queue and prefill)",
    ),
    ("--stall-timeout", "stall", "longest silence, in seconds, inside a replica's stream"),
    (
        "--answer-timeout",
        "answer",
        "seconds a non-streamed answer may take in all (the whole generation)",
    ),
)


def add_parser(sub: Any) -> None:
    _add_fleet(sub)
    _add_route(sub)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", choices=POLICIES, default="exact", help="routing policy")
    p.add_argument("--host", default="127.0.0.1", help="where the front listens")
    p.add_argument("--port", type=int_range(0, 65535), default=8000, help="0: any free port")
    add_load_weight(
        p, "prefill tokens one token of a replica's load is worth (exact, attention-chain)"
    )
    p.add_argument(
        "--health-interval",
        type=float,
        default=DEFAULT_HEALTH_INTERVAL_S,
        help="seconds between health checks",
    )
    for flag, field, doc in DEADLINE_OPTIONS:
        p.add_argument(flag, type=float, default=getattr(Deadlines, field), help=doc)
    ops_options.add_arguments(p, "/fleet/replicas")


def _add_fleet(sub: Any) -> None:
    p = sub.add_parser(
        "fleet",
        help="N local `kvreuse serve` replicas behind a cache-aware router",
        description="Start N `kvreuse serve` replicas on 127.0.0.1 (free ports, KV events on "
        "127.0.0.1) and an OpenAI-compatible router in front of them. Options after `--` go "
        "to every replica (kvreuse serve --help).",
        formatter_class=Help,
    )
    p.add_argument("--replicas", type=int_range(1, MAX_REPLICAS), required=True, metavar="N")
    _common(p)
    add_replica_options(p)
    p.add_argument("--max-pending", type=int_range(1, 2**31), default=None, help="per replica")
    p.add_argument(
        "--start-timeout", type=float, default=180.0, help="seconds the replicas get to start"
    )
    p.add_argument("--quiet-replicas", action="store_true", help="drop the replicas' output")
    p.add_argument(
        "--restart-tries",
        type=int_range(0, 10**6),
        default=RestartPolicy.tries,
        help="restarts of a replica whose process exits, within --restart-window (0: none)",
    )
    p.add_argument(
        "--restart-window",
        type=float,
        default=RestartPolicy.window,
        help="seconds in which --restart-tries restarts may happen before a replica is given up",
    )
    p.add_argument("serve_args", nargs="*", metavar="SERVE_OPTION", help="after --: for serve")
    p.set_defaults(func=_cmd_fleet)


def _add_route(sub: Any) -> None:
    p = sub.add_parser(
        "route",
        help="a cache-aware router in front of running replicas",
        description="Route OpenAI requests over replicas started elsewhere: any server that "
        "publishes vLLM-format KV events and reports usage.prompt_tokens_details.cached_tokens.",
        formatter_class=Help,
    )
    p.add_argument(
        "--replica",
        action="append",
        required=True,
        metavar="URL,EVENTS[,REPLAY[,CURVE_KEY]]",
        help="a replica's base URL (http://host:port), its KV events endpoint and optionally "
        "its replay endpoint and its publisher's CURVE public key (Z85 or a zmq certificate "
        "file); repeat per replica",
    )
    _common(p)
    p.add_argument(
        "--geometry", default=None, help="preset or TOML (default: the first replica's own)"
    )
    p.add_argument(
        "--tokenizer", default=None, help="the replicas' tokenizer.json (default: bytes)"
    )
    p.set_defaults(func=_cmd_route)


# ---------------------------------------------------------------------------- commands
def _cmd_fleet(args: argparse.Namespace) -> int:
    from kvreuse.fleet.serving.preflight import check_model, check_replicas
    from kvreuse.fleet.serving.replicas import LocalFleet, ReplicaError, ReplicaProcess
    from kvreuse.fleet.serving.store import follow_replicas, replica_tiers
    from kvreuse.fleet.serving.supervise import Supervisor

    try:
        _check_common(args)
        policy = RestartPolicy(args.restart_tries, args.restart_window)
        if (problem := policy.problem()) is not None:
            raise UsageError(problem)
        serve_args = replica_args(args)
        dep = _fleet_deployment(args)
        config = dep.cache
        tokenizer = _tokenizer(args.model, None)
        check_model(args.model, args.fake, dep, tokenizer)  # before any replica starts
        media, store_url = replica_tiers(serve_args)
        dispatcher, sock = _open(args, config, media, store_url is not None)
    except (UsageError, ValueError, OSError) as exc:
        return _usage("fleet", exc, args)
    from kvreuse.events.common import SECRET_ENV
    from kvreuse.events.curve import generate

    names = [f"replica-{i}" for i in range(args.replicas)]
    keys = [generate() for _ in names]  # CURVE: no one but replica i reaches its sockets here
    members = [
        dispatcher.add(n, "", "tcp://127.0.0.1:0", bind=True, curve_public_key=k.public)
        for n, k in zip(names, keys, strict=True)
    ]  # bound before the replicas start: their publishers connect here
    procs = [
        ReplicaProcess(
            n, m.endpoint, serve_args, quiet=args.quiet_replicas, env={SECRET_ENV: k.secret}
        )
        for n, m, k in zip(names, members, keys, strict=True)
    ]
    fleet = LocalFleet(procs)
    supervisor = Supervisor(procs, dispatcher, members, policy, start_timeout=args.start_timeout)
    stop = functools.partial(_stop_fleet, supervisor, fleet)
    try:
        fleet.start(args.start_timeout)
        for member, proc in zip(members, procs, strict=True):
            assert proc.url is not None and proc.replay_endpoint is not None
            member.url = proc.url
            dispatcher.set_replay(member, proc.replay_endpoint)
        models = check_replicas(dispatcher, config, required=True)
        if store_url is not None:
            try:
                follow_replicas(dispatcher, [m.url for m in members], store_url)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        supervisor.start()
        # the replicas stop while the front shuts down: after a SIGTERM, which uvicorn re-raises
        # once the server is down, there is no later moment
        return _serve("fleet", args, dispatcher, tokenizer, models, sock, stop)
    except (ReplicaError, UsageError) as exc:
        sock.close()
        return _usage("fleet", exc)
    finally:
        stop()
        supervisor.close()  # after the replicas: their death signal follows its thread
        dispatcher.close()


def _stop_fleet(supervisor: Any, fleet: Any) -> None:
    """No restart from here on, then every replica stops (each drains)."""
    supervisor.halt()
    fleet.stop()


def _cmd_route(args: argparse.Namespace) -> int:
    from kvreuse.fleet.serving.preflight import check_replicas, route_deployment

    try:
        _check_common(args)
        replicas = [replica_spec(text) for text in args.replica]
        if len({spec[0] for spec in replicas}) < len(replicas):
            raise UsageError("--replica: a URL is given twice")
        config = route_deployment(args.geometry, replicas[0][0]).cache
        tokenizer = _tokenizer(None, args.tokenizer)
        dispatcher, sock = _open(args, config)
    except (UsageError, ValueError, OSError) as exc:
        return _usage("route", exc, args)
    try:
        for i, (url, events, replay, key) in enumerate(replicas):
            dispatcher.add(
                f"replica-{i}", url, events, replay_endpoint=replay, curve_public_key=key
            )
        models = check_replicas(dispatcher, config, required=False)
        return _serve("route", args, dispatcher, tokenizer, models, sock)
    except (UsageError, ValueError) as exc:
        sock.close()
        return _usage("route", exc)
    finally:
        dispatcher.close()


def _usage(command: str, exc: BaseException, args: argparse.Namespace | None = None) -> int:
    where = f" ({exc.strerror})" if isinstance(exc, OSError) and exc.strerror else ""
    at = f" on {args.host}:{args.port}" if args is not None else ""
    text = f"cannot listen{at}{where}" if where else str(exc)
    print(f"kvreuse {command}: {text}", file=sys.stderr)
    return 2


def _open(
    args: argparse.Namespace, config: Any, media: Sequence[str] = (), shared: bool = False
) -> tuple[Any, Any]:
    """The dispatcher and the front's listening sockets (bound first: a busy port fails fast):
    the API's, then the metrics listener's when there is one. `media`: the replicas' tiers;
    `shared`: the last of them a store they share, which the dispatcher mirrors."""
    from kvreuse.events import StoreMirror
    from kvreuse.fleet.serving.dispatch import Dispatcher
    from kvreuse.serve.server import bind

    # sha256 and sha256_cbor have fixed default seeds (kvreuse's and vLLM's); the others do not
    if config.hash_algo not in ("sha256", "sha256_cbor") and config.hash_seed is None:
        raise UsageError(
            f"the replicas hash with {config.hash_algo} and a random per-process seed, so no "
            "router can compute their hashes: set hash_seed in the geometry"
        )
    socks = _Sockets([bind(args.host, args.port)])
    try:
        try:
            metrics = ops_options.bind_metrics(args)
        except OSError as exc:
            where = f"{args.metrics_host or args.host}:{args.metrics_port}"
            raise UsageError(f"cannot listen on {where} ({exc.strerror}) for metrics") from None
        if metrics is not None:
            socks.append(metrics)
        store = StoreMirror(config.geometry, media[-1]) if shared else None
        dispatcher = Dispatcher(
            config, args.policy, load_weight=args.load_weight, tiers=media, store=store
        )
        return dispatcher, socks
    except BaseException:
        socks.close()
        raise


class _Sockets(list[Any]):
    """The front's listening sockets; `close` closes them all."""

    def close(self) -> None:
        for sock in self:
            sock.close()


def _serve(
    command: str,
    args: argparse.Namespace,
    dispatcher: Any,
    tokenizer: Any,
    models: list[dict[str, Any]],
    socks: _Sockets,
    on_shutdown: Any = None,
) -> int:
    from kvreuse.fleet.serving.front import create_front
    from kvreuse.serve.server import run_server

    app = create_front(
        dispatcher,
        tokenizer,
        models=models,
        health_interval=args.health_interval,
        deadlines=_deadlines(args),
        admin_token=args.admin_token,
        metrics_port=socks[1].getsockname()[1] if len(socks) > 1 else None,
        on_shutdown=on_shutdown,
    )
    host, port = socks[0].getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    count = len(dispatcher.members)
    print(
        f"kvreuse {command}: {count} replica(s), policy {args.policy}, on http://{host}:{port}/v1",
        file=sys.stderr,
        flush=True,
    )
    if len(socks) > 1:
        line = f"kvreuse {command}: metrics on {ops_options.metrics_url(args, socks[1])}"
        print(line, file=sys.stderr, flush=True)
    return run_server(app, list(socks), drain_timeout=5.0)


def _deadlines(args: argparse.Namespace) -> Deadlines:
    fields = (field for _, field, _ in DEADLINE_OPTIONS)
    return Deadlines(**{field: getattr(args, field + "_timeout") for field in fields})


# ---------------------------------------------------------------------------- checks
def _check_common(args: argparse.Namespace) -> None:
    if not (math.isfinite(args.health_interval) and args.health_interval > 0):
        raise UsageError(f"--health-interval must be seconds > 0, got {args.health_interval}")
    timeout = getattr(args, "start_timeout", 1.0)
    if not (math.isfinite(timeout) and timeout > 0):
        raise UsageError(f"--start-timeout must be seconds > 0, got {timeout}")
    args.admin_token = ops_options.admin_token(args.admin_token)
    problem = _deadlines(args).problem() or ops_options.option_error(args)
    if problem is not None:
        raise UsageError(problem)


def _fleet_deployment(args: argparse.Namespace) -> Any:
    return replica_deployment(args.geometry, args.fake, args.num_blocks)


def replica_deployment(geometry: str | None, fake: bool, num_blocks: int | None) -> Any:
    """The deployment `kvreuse serve` replicas run with these options: the geometry given, else
    serve's default (the fake model's own, or the embedded model's)."""
    from kvreuse.deployment import load_geometry, resolve

    if geometry is not None:
        dep = resolve(geometry)
    elif fake:
        from kvreuse.serve.backend import FAKE_GEOMETRY, FAKE_NAME

        dep = load_geometry(FAKE_GEOMETRY, FAKE_NAME)
    else:
        dep = resolve(DEFAULT_ENGINE_GEOMETRY)
    if num_blocks is not None:
        dep = replace(dep, cache=replace(dep.cache, num_blocks=num_blocks))
    return dep


# `kvreuse.engine.LLM`'s default geometry; read from the replicas and compared at start, so a
# change there shows as one clear error instead of wrong hashes.
DEFAULT_ENGINE_GEOMETRY = "tiny-hybrid-dcp4"


def _tokenizer(model: str | None, path: str | None) -> Any:
    """The replicas' tokenizer, chosen as `kvreuse serve` chooses it: a tokenizer.json given or
    in the model directory, else bytes."""
    from kvreuse.tokenizer import ByteTokenizer, HFTokenizer

    if path is None and model is not None and (Path(model) / "tokenizer.json").is_file():
        path = str(Path(model) / "tokenizer.json")
    return HFTokenizer(path) if path is not None else ByteTokenizer()
