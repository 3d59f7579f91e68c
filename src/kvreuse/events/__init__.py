"""`kvreuse.events`: the core's KV events on the wire, in vLLM's ZeroMQ format.

    wire         msgspec structs of vLLM 0.33.0's batches and events (map and legacy forms)
    convert      core events → wire events: every group, `block_size` = the hash unit
    routable     the attention group as an attention-only router should see it
    publisher    PUB stream, ROUTER replay, bounded buffer and queue, one background thread
    mirror       a replica's entries per group from its events; an `IndexView` for the core
    holders      which of several mirrors hold each full-attention key; the router's one walk
    stream       one replica's stream: what is applied, checks through replay, restarts
    subscriber   follows several replicas' streams (sockets, poll) and keeps their mirrors
    replay       the replay protocol, the publisher's bounded answers and its note
    options      `kvreuse serve`'s --kv-events-* flags and their checks
    common       mode names and the endpoint check they share (no pyzmq, no msgspec)

Needs pyzmq and msgspec (`pip install -e '.[events]'`), loaded on first use of a name that
needs them, so that `kvreuse.events.options` (and the command line) works without them. It
sits above the core and imports only names `kvreuse.core` exports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvreuse.events.common import MODES

if TYPE_CHECKING:
    from kvreuse.events.convert import Converter, attention_group
    from kvreuse.events.holders import Holders
    from kvreuse.events.mirror import HashChain, ReplicaMirror, StoreMirror, TruncatedIndex
    from kvreuse.events.publisher import Publisher, is_bind_endpoint
    from kvreuse.events.stream import ReplicaStream
    from kvreuse.events.subscriber import Subscriber
    from kvreuse.events.wire import EventBatch, decode_batch, encode_batch, hash64

_HOME = {
    "Converter": "convert",
    "attention_group": "convert",
    "Holders": "holders",
    "HashChain": "mirror",
    "ReplicaMirror": "mirror",
    "StoreMirror": "mirror",
    "TruncatedIndex": "mirror",
    "Publisher": "publisher",
    "is_bind_endpoint": "publisher",
    "ReplicaStream": "stream",
    "Subscriber": "subscriber",
    "EventBatch": "wire",
    "decode_batch": "wire",
    "encode_batch": "wire",
    "hash64": "wire",
}

__all__ = [
    "MODES",
    "Converter",
    "EventBatch",
    "HashChain",
    "Holders",
    "Publisher",
    "ReplicaMirror",
    "ReplicaStream",
    "StoreMirror",
    "Subscriber",
    "TruncatedIndex",
    "attention_group",
    "decode_batch",
    "encode_batch",
    "hash64",
    "is_bind_endpoint",
]


def __getattr__(name: str) -> object:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'kvreuse.events' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvreuse.events.{home}"), name)
