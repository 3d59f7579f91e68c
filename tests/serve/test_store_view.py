"""The shared store's view in a real Redis server (kvreuse.serve.store_turns): copies of one
`SharedTier` in two "servers" follow each other through turns; the store emptied, a poisoned
entry, a turn whose lease ran out or a server that is down never raise, and leave every copy
either equal to the others or detached; the log stays bounded; the front's follower marks its
view exact only while it is complete and current."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvreuse import CacheConfig, GroupSpec, KVCacheManager, Request
from kvreuse.core import SharedTier, TierSpec
from kvreuse.deployment import resolve
from kvreuse.events import StoreMirror
from kvreuse.fleet.serving.store import StoreFollower
from kvreuse.serve.store_turns import LOG_FLOOR, Breaker, StoreTurns
from kvreuse.serve.store_view import redacted, redis_client
from store_server import redis_server

pytest.importorskip("redis", reason="the shared store needs redis: pip install -e '.[engine]'")

CFG = CacheConfig(num_blocks=6, groups=[GroupSpec(kind="full", block_size=4)])


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    with redis_server(tmp_path) as u:
        yield u


class Server:
    """A manager whose store tier is a copy shared through Redis, stepping in turns."""

    def __init__(self, url: str, lease_s: float = 10.0) -> None:
        self.tier = SharedTier(TierSpec("store", 16), CFG)
        self.mgr = KVCacheManager(CFG, tiers=[self.tier])
        self.turns = StoreTurns(self.tier, redis_client(url, 1.0), "t", lease_s=lease_s,
                                wait_s=1.0, breaker=Breaker(0.2, 0.4))  # fmt: skip
        self.n = 0

    def run(self, tokens: list[int]) -> int:
        self.n += 1
        rid = f"r{self.n}"
        with self.turns.turn():
            self.mgr.add_request(Request(rid, tokens))
            hit = self.mgr.lookup(rid)
            self.mgr.allocate(rid, len(tokens) - hit.hit, lookup=hit)
            self.mgr.commit(self.mgr.seal_step().step_id, {rid: (len(tokens), [0])})
            self.mgr.finish(rid)
        self.mgr.check_invariants()
        return hit.hit


def state(server: Server) -> object:
    return server.tier.export_state()


def test_copies_follow_each_other_and_a_joiner_reads_the_snapshot(url: str) -> None:
    a, b = Server(url), Server(url)
    a.run(list(range(17)))
    a.run(list(range(100, 118)))  # a's pages go down to the store
    assert b.run(list(range(20))) == 16  # b sees them: loaded from the store
    c = Server(url)
    c.run([7])
    a.run([8])
    assert state(a) == state(c) and len(a.tier) > 0


def test_an_emptied_store_starts_a_new_view_and_nothing_raises(url: str) -> None:
    a, b = Server(url), Server(url)
    a.run(list(range(17)))
    a.run(list(range(100, 118)))
    a.turns.client.flushall()
    assert b.run(list(range(20))) == 0  # the new view holds nothing: no stale hit
    a.run([1, 2, 3])
    assert state(a) == state(b)
    assert b.turns.num_resets + a.turns.num_resets >= 1


def test_a_poisoned_entry_is_survived_by_every_server(url: str) -> None:
    a, b = Server(url), Server(url)
    a.run(list(range(17)))
    keys, client = a.turns.keys, a.turns.client
    seq = client.incr(keys.seq)
    client.xadd(keys.log, {"e": b"not an entry"}, id=f"{seq}-0")
    b.run(list(range(9)))
    a.run(list(range(9)))
    late = Server(url)
    late.run([5])
    b.run([6])
    assert state(a) == state(b) == state(late)


def test_a_turn_whose_lease_ran_out_writes_nothing_and_rebuilds(url: str) -> None:
    import time

    a, b = Server(url, lease_s=0.2), Server(url)
    with a.turns.turn():
        time.sleep(0.4)  # paused past its lease: b takes the turn meanwhile
        b.run(list(range(17)))
        a.mgr.add_request(Request("x", list(range(40, 57))))
        hit = a.mgr.lookup("x")
        a.mgr.allocate("x", 17 - hit.hit, lookup=hit)
        a.mgr.commit(a.mgr.seal_step().step_id, {"x": (17, [0])})
        a.mgr.finish("x")
    assert a.tier.detached  # its push was refused: its copy is not the view
    a.run([1])
    b.run([2])
    assert state(a) == state(b)


def test_a_store_that_is_down_is_a_detached_turn_not_an_error(url: str) -> None:
    import contextlib

    a = Server(url)
    a.run(list(range(17)))
    a.run(list(range(100, 118)))
    with contextlib.suppress(Exception):
        a.turns.client.shutdown(nosave=True)
    assert a.run(list(range(17))) == 0  # no hit from a store it cannot read, and no error
    assert a.tier.detached and a.turns.breaker.num_trips >= 1 and a.turns.last_error
    assert a.run([9, 9, 9]) == 0 and a.turns.num_detached_turns >= 2  # the breaker is open


def test_the_log_stays_bounded(url: str) -> None:
    a, b = Server(url), Server(url)
    for i in range(800):
        (a if i % 2 else b).run([i % 50, (i * 7) % 50, 1, 2, 3, 4, 5, 6, 7])
    client, keys = a.turns.client, a.turns.keys
    snap = len(client.get(keys.snap))
    logged = sum(len(f[b"e"]) for _, f in client.xrange(keys.log))
    assert a.turns.num_snapshots + b.turns.num_snapshots > 0
    assert logged <= max(snap, LOG_FLOOR) + 4096  # one entry more at most
    a.run([0])
    late = Server(url)
    late.run([1])
    a.run([2])
    assert state(late) == state(a)


def test_the_log_stays_under_its_bound_over_20000_requests(url: str) -> None:
    """Three servers, ten requests a turn, 2,000 turns: after every turn the log's entries
    weigh at most max(snapshot, LOG_FLOOR) (the bound docs/tiers.md gives: a turn that would
    pass it writes a snapshot and trims), Redis' own memory for the log stays within twice
    that, and the snapshot stays within what the tier's capacity allows."""
    import random

    cfg = CacheConfig(num_blocks=64, groups=[GroupSpec(kind="full", block_size=4)])
    capacity = 256
    servers = []
    for _ in range(3):
        tier = SharedTier(TierSpec("store", capacity), cfg)
        turns = StoreTurns(tier, redis_client(url, 1.0), "t")
        servers.append((KVCacheManager(cfg, tiers=[tier]), turns))
    rng = random.Random(1)
    client, keys = servers[0][1].client, servers[0][1].keys
    num_requests = worst_log = worst_memory = worst_snap = 0
    for turn in range(2000):
        mgr, turns = servers[turn % 3]
        with turns.turn():
            prompts = {}
            for _ in range(10):
                num_requests += 1
                tokens = [rng.randrange(100) for _ in range(rng.randrange(1, 21))]
                prompts[rid := f"r{num_requests}"] = tokens
                mgr.add_request(Request(rid, tokens))
                hit = mgr.lookup(rid)
                mgr.allocate(rid, len(tokens) - hit.hit, lookup=hit)
            outcome = {rid: (len(tokens), [0]) for rid, tokens in prompts.items()}
            mgr.commit(mgr.seal_step().step_id, outcome)
            for rid in prompts:
                mgr.finish(rid)
        snap = len(client.get(keys.snap) or b"")
        logged = sum(len(f[b"e"]) for _, f in client.xrange(keys.log))
        worst_log = max(worst_log, logged - max(snap, LOG_FLOOR))
        worst_memory = max(worst_memory, client.memory_usage(keys.log) or 0)
        worst_snap = max(worst_snap, snap)
    assert num_requests == 20_000 and sum(t.num_snapshots for _, t in servers) > 10
    assert worst_log <= 0
    assert worst_memory <= 2 * max(worst_snap, LOG_FLOOR)
    assert worst_snap <= capacity * 128  # one key per slot here: its index entry and its key


def test_the_follower_is_exact_only_on_a_complete_current_view(url: str) -> None:
    a = Server(url)
    geo = resolve("tiny-hybrid-dcp4").cache.geometry
    follower = StoreFollower(redis_client(url, 1.0), a.turns.log_key, StoreMirror(geo, "STORE"))
    assert follower.sync() == 0 and not follower.exact  # no view yet
    a.run(list(range(17)))
    a.run(list(range(100, 118)))
    follower.sync()
    held = {k for _, _, keys in a.tier.export_state().slots for _, k, i in keys if i}
    assert follower.exact and {k for k in follower.index[0]} == held
    a.turns.client.flushall()
    follower.sync()
    assert not follower.exact and not follower.index[0]
    a.run([1, 2, 3, 4, 5])
    follower.sync()
    assert follower.exact
    client = a.turns.client
    seq = client.incr(a.turns.keys.seq)
    client.xadd(a.turns.keys.log, {"e": b'[["take", 99]]'}, id=f"{seq}-0")
    follower.sync()
    assert not follower.exact and not follower.index[0]  # no store hit rather than a wrong one


def test_a_password_is_never_shown() -> None:
    assert redacted("redis://u:s3cret@host:6379/0") == "redis://u:***@host:6379/0"
    assert "s3cret" not in redacted("redis://:s3cret@host:6379/0")
