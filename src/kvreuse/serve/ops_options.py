"""The options of the operator controls that `kvreuse serve` and the fleet front (`kvreuse
fleet`, `kvreuse route`) share; `kvreuse.serve.ops` enforces them. Needs none of the server's
packages, so the command line offers the flags without them.

    --metrics-host H, --metrics-port P   /metrics (and /health) only on that listener; the API
                                         port then answers 404 for /metrics
    --admin-token T                      what admin endpoints require as `Authorization: Bearer
                                         T`; default: $KVREUSE_ADMIN_TOKEN (a command line is
                                         visible to every local user, the environment is not)
"""

from __future__ import annotations

import argparse
import os
import socket

ADMIN_TOKEN_ENV = "KVREUSE_ADMIN_TOKEN"


def add_arguments(p: argparse.ArgumentParser, admin_endpoints: str) -> None:
    """`--admin-token`, `--metrics-host`, `--metrics-port`; `admin_endpoints` names what the
    token guards, for the help."""
    p.add_argument(
        "--admin-token",
        default=None,
        help=f"token {admin_endpoints} requires (default: ${ADMIN_TOKEN_ENV})",
    )
    p.add_argument("--metrics-host", default=None, help="serve /metrics here (default: --host)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve /metrics on this port only (default: on the API port)",
    )


def admin_token(given: str | None) -> str | None:
    """The token given, else the environment's (unset or empty: none)."""
    return given if given is not None else os.environ.get(ADMIN_TOKEN_ENV) or None


def option_error(args: argparse.Namespace) -> str | None:
    """The first bad operator option (`args.port` is the API port) as one line, or None."""
    port = args.metrics_port
    if port is not None and not 0 <= port <= 65535:
        return f"--metrics-port must be a TCP port in [0, 65535], got {port}"
    if port is not None and port == args.port != 0:
        return "--metrics-port must differ from --port"
    if args.admin_token is not None and not args.admin_token.strip():
        return "--admin-token must not be empty"
    return None


def bind_metrics(args: argparse.Namespace) -> socket.socket | None:
    """The metrics listener when `--metrics-port` is given (OSError when it cannot be had)."""
    from kvreuse.serve.server import bind

    if args.metrics_port is None:
        return None
    return bind(args.metrics_host or args.host, args.metrics_port)


def metrics_url(args: argparse.Namespace, sock: socket.socket) -> str:
    host = args.metrics_host or args.host
    return f"http://{f'[{host}]' if ':' in host else host}:{sock.getsockname()[1]}/metrics"
