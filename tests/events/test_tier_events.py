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


def test_a_block_moved_down_the_tiers_keeps_its_boundary() -> None:
    """A key that leaves the host for the store after the removal memo has forgotten it still
    knows where it ends, so a child stored once it is loaded back gets its boundary too."""
    from kvreuse.events.mirror import ReplicaMirror

    geo = GEOMETRIES["attention"].geometry
    u = geo.hash_unit
    mirror = ReplicaMirror(geo, removed_memo=1, tiers=["CPU", "STORE"])

    def stored(hashes: list[int], parent: int | None, medium: str = "GPU") -> BlockStored:
        tokens = [1] * (u * len(hashes)) if medium == "GPU" else []
        return BlockStored(hashes, parent, tokens, u, None, medium, None, group_idx=0)

    mirror.apply([stored([11], None), BlockRemoved([11], "GPU", group_idx=0)])
    mirror.apply([stored([11], None, "CPU")])
    # another block comes and goes: the memo (one entry) forgets 11
    mirror.apply([stored([21], None), BlockRemoved([21], "GPU", group_idx=0)])
    mirror.apply([BlockRemoved([11], "CPU", group_idx=0), stored([11], None, "STORE")])
    assert mirror.tier_entries(1, 0) == {11: u}
    mirror.apply([stored([11], None), stored([12], 11)])  # 11 loaded back, then a child
    assert mirror.entries(0) == {11: u, 12: 2 * u}


def test_a_slot_whose_page_lost_its_lower_keys_comes_back_with_them() -> None:
    """b copies a's partial page 0 and keys only its upper boundaries (a's block holds the
    lower ones); both go down to a one-slot host, a's is dropped, and c loads b's. The loaded
    block carries the page's lower keys too, so its event names no parent that is gone: the
    mirror keeps every boundary however little its removal memo remembers."""
    from kvreuse import CacheConfig, GroupSpec, KVCacheManager
    from kvreuse.events import Converter, ReplicaMirror
    from kvreuse.events.wire import EventBatch, encode_batch

    cfg = CacheConfig(
        num_blocks=4, groups=[GroupSpec(kind="full", block_size=4)], hash_unit=1,
        enable_events=True,
    )  # fmt: skip
    mgr = KVCacheManager(cfg, tiers=[TierSpec("host", num_blocks=1, medium="CPU")])
    converter = Converter(mgr.geo)
    mirror = ReplicaMirror(mgr.geo, removed_memo=1, tiers=["CPU"])

    def run(rid: str, tokens: list[int]) -> tuple[int, int]:
        mgr.add_request(Request(rid, tokens))
        hit = mgr.lookup(rid)
        mgr.allocate(rid, len(tokens) - hit.hit, lookup=hit)
        step = mgr.seal_step()
        mgr.commit(step.step_id, {rid: (len(tokens), [0])})
        mgr.finish(rid)
        batch = converter.convert(mgr.take_events())
        mirror.apply(decode_batch(encode_batch(EventBatch(0.0, batch))).events)
        return hit.hit, len(hit.loads)

    run("a", [1, 2, 9, 9, 9])
    assert run("b", [1, 2, 3, 4, 5]) == (2, 0)  # a partial page: copied, then keyed at 3, 4
    run("x", [7] * 13)  # every block evicted; the host keeps the last one demoted
    run("y", [8] * 9)
    assert run("c", [1, 2, 3, 4, 5]) == (4, 1)  # page 0 loaded back from b's slot
    device = {hash64(k): b for _, b, k, _, _ in mgr.export_entries()}
    assert mirror.entries(0) == device
    assert mirror.unknown_parents == 0
    mgr.check_invariants()
