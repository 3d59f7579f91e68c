"""A manager driven request by request with its events published, and a subscriber's view of it.

Requests run the core's public operations directly (add_request, lookup, allocate, seal_step,
commit, finish), as tests/core/test_headline.py does; after each commit and finish the
manager's events go to a real `Publisher`, and `sync` waits until the subscriber has applied
every batch sent so far.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

from kvreuse.core import (
    CacheConfig,
    GroupSpec,
    KVCacheManager,
    LookupResult,
    Request,
    TierSpec,
)
from kvreuse.core import compute_lookup as core_lookup
from kvreuse.events import Publisher, Subscriber
from kvreuse.events.mirror import HashChain, ReplicaMirror

GEOMETRIES: dict[str, CacheConfig] = {
    "attention": CacheConfig(num_blocks=512, groups=[GroupSpec(kind="full", block_size=16)]),
    "dcp4-hybrid": CacheConfig(
        num_blocks=512,
        dcp_size=4,
        hash_unit=8,
        groups=[GroupSpec(kind="full", block_size=32), GroupSpec(kind="recurrent", block_size=8)],
    ),
    "sliding-hybrid": CacheConfig(
        num_blocks=1024,
        groups=[
            GroupSpec(kind="full", block_size=16),
            GroupSpec(kind="sliding", block_size=16, window=48),
            GroupSpec(kind="recurrent", block_size=16),
        ],
    ),
    "spec-drop": CacheConfig(
        num_blocks=1024,
        spec_mode="drop",
        groups=[
            GroupSpec(kind="full", block_size=16),
            GroupSpec(kind="recurrent", block_size=16),
            GroupSpec(kind="full", block_size=16, role="draft"),
        ],
    ),
    "spec-lookahead": CacheConfig(
        num_blocks=1024,
        spec_mode="lookahead",
        lookahead_tokens=2,
        groups=[
            GroupSpec(kind="full", block_size=16),
            GroupSpec(kind="recurrent", block_size=16),
            GroupSpec(kind="full", block_size=16, role="draft"),
        ],
    ),
}


def tcp(endpoint: str) -> str:
    """The address a client on this machine dials for a publisher bound to `tcp://*:port`."""
    return "tcp://127.0.0.1:" + endpoint.rsplit(":", 1)[1]


class Replica:
    """One manager and its publisher (PUB and replay bound to free ports on this machine)."""

    def __init__(
        self, cfg: CacheConfig, tiers: Sequence[TierSpec] = (), **publisher_options: object
    ) -> None:
        self.cfg = cfg
        self.mgr = KVCacheManager(cfg, tiers=tiers)
        options: dict[str, object] = {"endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}
        options.update(publisher_options)
        self.pub = Publisher(cfg.geometry, **options)  # type: ignore[arg-type]

    def follow(self, sub: Subscriber, name: str) -> ReplicaMirror:
        replay = self.pub.replay_endpoint
        return sub.add_replica(
            name,
            self.cfg.geometry,
            tcp(self.pub.endpoint),
            replay_endpoint=tcp(replay) if replay else None,
        )

    def predict(self, mirror: ReplicaMirror, rid: str, tokens: list[int]) -> LookupResult:
        """The core's lookup of `tokens` run on `mirror` (the request's chain, as a router
        would hash it)."""
        chain = HashChain(self.mgr.hasher.hash_units(tokens))
        return core_lookup(self.cfg.geometry, mirror, rid, chain, len(tokens))

    def run(self, rid: str, tokens: list[int], decode: int = 0) -> int:
        """One request from arrival to finish; returns its cached tokens."""
        mgr = self.mgr
        mgr.add_request(Request(rid, tokens))
        res = mgr.lookup(rid)
        assert mgr.allocate(rid, len(tokens) - res.hit, lookup=res) is not None
        step = mgr.seal_step()
        mgr.commit(step.step_id, {rid: (len(tokens), [5])})
        self.pub.publish(mgr.take_events())
        for i in range(decode):
            assert mgr.allocate(rid, 1) is not None
            step = mgr.seal_step()
            mgr.commit(step.step_id, {rid: (len(tokens) + 1 + i, [6 + i % 7])})
            self.pub.publish(mgr.take_events())
        stats = mgr.finish(rid)
        self.pub.publish(mgr.take_events())
        mgr.check_invariants()
        return stats.cached_tokens

    def close(self) -> None:
        self.pub.close()


def sync(sub: Subscriber, name: str, pub: Publisher, timeout: float = 10.0) -> None:
    """Wait until `sub` has applied every batch `pub` has sent (fails after `timeout`)."""
    assert pub.flush(timeout), "the publisher did not send its queue in time"
    deadline = time.monotonic() + timeout
    stream = sub.stream(name)
    while stream.next_seq < pub.next_seq:
        assert time.monotonic() < deadline, f"subscriber at {stream.next_seq} of {pub.next_seq}"
        if not sub.poll(50):
            # the last batches may have gone out before the subscription reached the
            # publisher, and PUB/SUB shows no gap until a later batch: ask the replay socket
            sub.catch_up(name)


def agent_turns(seed: int, num_turns: int = 12) -> list[list[int]]:
    """A conversation: each prompt is the previous prompt, its answer and a new message."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 30000) for _ in range(rng.randrange(40, 90))]
    turns = []
    for _ in range(num_turns):
        turns.append(prompt)
        answer = [6 + i % 7 for i in range(4)]
        prompt = (
            prompt + [5, *answer] + [rng.randrange(1, 30000) for _ in range(rng.randrange(3, 40))]
        )
    return turns


def shared_prefix(seed: int, num_requests: int = 12) -> list[list[int]]:
    """Requests that share a system prompt, some of them resent or extended."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 30000) for _ in range(rng.randrange(60, 140))]
    out: list[list[int]] = []
    for _ in range(num_requests):
        if out and rng.random() < 0.3:
            old = rng.choice(out)
            out.append(old + [rng.randrange(1, 30000) for _ in range(rng.randrange(0, 20))])
        else:
            cut = rng.randrange(len(system) // 2, len(system) + 1)
            tail = [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 60))]
            out.append(system[:cut] + tail)
    return out
