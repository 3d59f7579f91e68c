"""`kvreuse fleet` of 3 replica processes sharing one store in a Redis server on loopback
(`-- --store-capacity N --store-url URL --store-shared`): the front reads the store's journal as
the replicas do (kvreuse.fleet.serving.store), so `exact` sees a session's history in the store
from every replica, and each prediction, by medium, is what the replica delivered.

The pools (12 blocks of 64-token pages) are too small for the agent workload's histories, so
the histories leave the devices and live on in the store, which every block enters as it is
computed (write-through): a session then goes wherever the load says, and takes its history
from the store there."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from test_front_util import command, metric, run_agent

from store_server import redis_server

for _name in ("fastapi", "uvicorn", "openai", "redis"):
    pytest.importorskip(
        _name, reason=f"the fleet front needs {_name}: pip install -e '.[server,test]'"
    )

FLEET = ["fleet", "--replicas", "3", "--port", "0", "--quiet-replicas", "--fake"]
FLEET += ["--num-blocks", "12", "--policy", "exact"]


def test_sessions_move_between_replicas_and_take_their_history_from_the_store(
    tmp_path: Path,
) -> None:
    with redis_server(tmp_path) as url:
        store = ["--store-capacity", "200K", "--store-url", url, "--store-shared"]
        store += ["--store-admission", "write-through"]
        with command([*FLEET, "--", *store], "kvreuse fleet:") as front:
            turns = run_agent(front)
            replicas = httpx.get(f"{front}/fleet/replicas").json()["replicas"]
            from_store = sum(
                metric(httpx.get(f"{row['url']}/metrics").text, "kvreuse:kv_tier_hits_total",
                       medium="STORE", tier="store")
                for row in replicas
            )  # fmt: skip
    assert all(row["mirror_exact"] and row["up"] for row in replicas)
    # every prediction, by medium, is what the replica delivered
    assert all(t.predicted_by_medium is not None for t in turns)
    assert [t for t in turns if t.predicted_by_medium != t.cached_by_medium] == []
    assert [t for t in turns if t.predicted != t.cached] == []
    # one request at a time after the first turn: each was admitted on the view the front read
    assert all(t.exact for t in turns if t.turn > 0), [t for t in turns if not t.exact]
    # sessions moved, and the moved turns found their history in the store
    where = {(t.session, t.turn): t.replica for t in turns}
    moved = [t for t in turns if t.turn > 0 and where[(t.session, t.turn - 1)] != t.replica]
    assert moved, "no session moved: the test no longer shows a history reused elsewhere"
    assert all(t.cached_by_medium is not None for t in moved)
    assert sum(t.cached_by_medium["STORE"] for t in moved if t.cached_by_medium) > 0
    assert from_store == sum(t.cached_by_medium["STORE"] for t in turns if t.cached_by_medium)
