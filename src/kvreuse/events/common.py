"""Names and checks that the publisher and the command line share (no pyzmq, no msgspec)."""

from __future__ import annotations

from typing import Literal

Mode = Literal["groups", "routable", "legacy"]
MODES: tuple[str, ...] = ("groups", "routable", "legacy")
DEFAULT_BUFFER_STEPS = 10_000
# The response header (and /health field) by which a `kvreuse serve` replica names the
# incarnation of its KV event stream (`Publisher.instance_id`): a router that sees another one
# than it follows knows the replica restarted.
INSTANCE_HEADER = "x-kvreuse-kv-events-instance"
# The response header by which a replica sharing a store names the store's view the request was
# admitted on ("<epoch>:<seq>", or "detached"): a router predicted store hits exactly only when
# it predicted from that very view.
STORE_VIEW_HEADER = "x-kvreuse-store-view"
# `kvreuse fleet` hands each replica its CURVE secret through this variable (never on a command
# line, which every user of the machine can read); `kvreuse serve` reads it when no key is given
SECRET_ENV = "KVREUSE_KV_EVENTS_CURVE_SECRET"


def endpoint_problem(endpoint: str) -> str | None:
    """What is wrong with a ZeroMQ endpoint a publisher can open, or None: `tcp://HOST:PORT`
    (HOST `*` binds on every interface; PORT in [0, 65535], 0 a free one), `ipc://PATH` or
    `inproc://NAME`."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc"):
        return "expected tcp://HOST:PORT, ipc://PATH or inproc://NAME"
    if scheme != "tcp":
        return None if rest else f"{scheme}:// needs a name"
    host, colon, port = rest.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        return "expected tcp://HOST:PORT with PORT in [0, 65535] (HOST * binds every interface)"
    return None
