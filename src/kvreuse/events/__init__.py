"""`kvreuse.events`: the core's KV events on the wire, in vLLM's ZeroMQ format.

    wire         msgspec structs of vLLM 0.33.0's batches and events (map and legacy forms)
    convert      core events → wire events: every group, `block_size` = the hash unit
    publisher    PUB stream, ROUTER replay, bounded buffer and queue, one background thread
    mirror       a replica's entries per group from its events; an `IndexView` for the core
    subscriber   follows several replicas, repairs gaps through replay, keeps their mirrors

Needs pyzmq and msgspec (`pip install -e '.[events]'`). It sits above the core and imports only
names `kvreuse.core` exports.
"""

from kvreuse.events.convert import MODES, Converter, attention_group
from kvreuse.events.mirror import HashChain, ReplicaMirror, TruncatedIndex
from kvreuse.events.publisher import Publisher, is_bind_endpoint
from kvreuse.events.subscriber import ReplicaStream, Subscriber
from kvreuse.events.wire import EventBatch, decode_batch, encode_batch, hash64

__all__ = [
    "MODES",
    "Converter",
    "EventBatch",
    "HashChain",
    "Publisher",
    "ReplicaMirror",
    "ReplicaStream",
    "Subscriber",
    "TruncatedIndex",
    "attention_group",
    "decode_batch",
    "encode_batch",
    "hash64",
    "is_bind_endpoint",
]
