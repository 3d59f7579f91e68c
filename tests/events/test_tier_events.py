"""Tier events on the wire: a replica with tiers below its pool publishes what each tier holds
in vLLM's `medium` field, and a subscriber's mirror tracks every tier of it exactly."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest
from replica import GEOMETRIES, Replica, agent_turns, shared_prefix, sync

from kvreuse.core import Request, TierSpec, compute_lookup
from kvreuse.events import Subscriber, decode_batch, hash64
from kvreuse.events.mirror import HashChain
from kvreuse.events.wire import BlockRemoved, BlockStored

# a pool too small for the workload, so blocks go down to the host and on to the store
CFG = replace(GEOMETRIES["dcp4-hybrid"], num_blocks=14)
TIERS = (TierSpec("host", num_blocks=6, medium="CPU"), TierSpec("store", num_blocks=12))
PROMPTS = agent_turns(3, 8) + shared_prefix(4, 8) + agent_turns(5, 6)


def run_all(replica: Replica) -> None:
    for i, tokens in enumerate(PROMPTS):
        replica.run(f"q{i}", tokens, decode=3)


def test_a_mirror_tracks_every_tier_of_a_replica() -> None:
    replica = Replica(CFG, tiers=TIERS)
    try:
        with Subscriber() as sub:
            mirror = replica.follow(sub, "r0")
            run_all(replica)
            sync(sub, "r0", replica.pub)
            mgr = replica.mgr
            assert mgr.tiers.num_demoted > 0 and mgr.tiers.num_dropped > 0  # both tiers evict
            assert mirror.media == ["CPU", "STORE"]
            for gid in range(len(CFG.geometry.groups)):
                device = {hash64(k): b for g, b, k, _, _ in mgr.export_entries() if g == gid}
                assert mirror.entries(gid) == device
                for t in range(len(TIERS)):
                    held = {
                        hash64(k)
                        for tt, g, _, k, _ in mgr.tiers.export_entries()
                        if (tt, g) == (t, gid)
                    }
                    assert set(mirror.tier_entries(t, gid)) == held, (t, gid)
            # the replica's own lookup across its tiers and the mirror's agree on every prompt
            num_tier_hits = 0
            for i, tokens in enumerate(PROMPTS):
                rid = f"probe{i}"
                mgr.add_request(Request(rid, tokens))
                own = mgr.lookup(rid)
                chain = HashChain(mgr.hasher.hash_units(tokens))
                seen = compute_lookup(CFG.geometry, mirror.tiered, rid, chain, len(tokens))
                assert seen.hit == own.hit, i
                num_tier_hits += any(b < 0 for row in own.slots.values() for b in row)
                mgr.finish(rid)
            assert num_tier_hits > 0
    finally:
        replica.close()


@pytest.mark.parametrize(
    ("mode", "sends_tiers"), [("groups", True), ("legacy", False), ("routable", False)]
)
def test_only_the_groups_mode_publishes_tiers(mode: str, sends_tiers: bool) -> None:
    replica = Replica(CFG, tiers=TIERS, mode=mode, buffer_steps=100_000)
    try:
        run_all(replica)
        assert replica.pub.flush()
        events = [ev for _, p in replica.pub.buffer for ev in decode_batch(p).events]
    finally:
        replica.close()
    media = {ev.medium for ev in events if isinstance(ev, BlockStored | BlockRemoved)}
    assert media == ({"GPU", "CPU", "STORE"} if sends_tiers else {"GPU"})
    for ev in events:
        if isinstance(ev, BlockStored) and ev.medium != "GPU":
            # as vLLM's offloading connector sends them: hashes only
            assert ev.token_ids == [] and ev.parent_block_hash is None
            assert ev.block_size == CFG.geometry.hash_unit


def test_tier_events_decode_as_plain_msgpack_maps() -> None:
    replica = Replica(CFG, tiers=TIERS, buffer_steps=100_000)
    try:
        run_all(replica)
        assert replica.pub.flush()
        raw = [msgspec.msgpack.decode(p) for _, p in replica.pub.buffer]
    finally:
        replica.close()
    tier_maps = [e for b in raw for e in b[1] if e.get("medium") not in (None, "GPU")]
    assert {e["type"] for e in tier_maps} == {"BlockStored", "BlockRemoved"}
    assert all(isinstance(e["group_idx"], int) for e in tier_maps)
