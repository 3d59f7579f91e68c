"""On a hybrid geometry a router that reads only the attention group promises reuse the replica
cannot deliver, and routes on that promise; the exact router does not.

The workload (hybrid-dcp4, 3 replicas; unit 256, 8,192-token attention pages, a recurrent
state per 256 tokens, kept sparsely): per round, a 2,048-token document P starts three sessions
at once, which the load spreads over the three replicas: every replica holds P's attention KV,
none a recurrent state at 2,048. A fourth session (on the replica whose turn it is: every
replica ties) finds the junction at 2,048 and saves the state there, so only that replica can
resume at P's end. Then a long unrelated request arrives, and while it runs a fifth session over
P arrives: the attention view sees P on every idle replica and picks the next in turn, which
reuses nothing; the exact view sees the state only on the junction's replica and goes there.
"""

from __future__ import annotations

from typing import Any

from kvreuse.deployment import preset
from kvreuse.fleet.simulation.run import FleetOptions, simulate_fleet
from kvreuse.sim.workload import WorkloadRequest, parse_line

PREFIX, SUFFIX, ROUNDS = 2048, 512, 4


def rand(seed: int, n: int) -> dict[str, Any]:
    return {"random": {"seed": seed, "len": n}}


def session(k: int, name: str, at: float, seed: int) -> dict[str, Any]:
    prompt = {"concat": [rand(10_000 + k, PREFIX), rand(seed, SUFFIX)]}  # round k's document
    return {"id": f"k{k}-{name}", "prompt": prompt, "max_tokens": 4, "arrival": at}


def sessions_over_shared_documents() -> list[WorkloadRequest]:
    lines: list[dict[str, Any]] = []
    for k in range(ROUNDS):
        t0 = 1000.0 * k
        lines += [session(k, f"start{i}", t0, 100 * k + i) for i in range(3)]
        lines.append(session(k, "junction", t0 + 100, 100 * k + 50))
        busy = {"id": f"k{k}-busy", "prompt": rand(20_000 + k, 6000), "max_tokens": 200}
        lines.append({**busy, "arrival": t0 + 200})
        lines.append(session(k, "late", t0 + 200.5, 100 * k + 60))
    return [parse_line(line, i) for i, line in enumerate(lines, 1)]


def run(policy: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    summary, _ = simulate_fleet(
        preset("hybrid-dcp4"),
        sessions_over_shared_documents(),
        FleetOptions(3, policy),
        rows.append,
    )
    assert summary["reconciled"], summary["reconciliation"]
    return summary, {r["id"]: r for r in rows}


def test_attention_chain_over_predicts_and_exact_delivers_more() -> None:
    chain, chain_rows = run("attention-chain")
    exact, exact_rows = run("exact")
    # attention-chain: the junction and the late session are each promised the document and
    # get nothing (no recurrent state at 2,048 where they were sent); nothing was evicted
    p = chain["prediction"]
    assert p["over_predicted"] == p["over_predicted_without_eviction"] == 2 * ROUNDS
    assert p["over_predicted_tokens"] == 2 * ROUNDS * PREFIX
    assert p["max_over_prediction_tokens"] == PREFIX
    for k in range(ROUNDS):
        late, junction = chain_rows[f"k{k}-late"], chain_rows[f"k{k}-junction"]
        assert (late["predicted_tokens"], late["cached_tokens"]) == (PREFIX, 0)
        assert late["replica"] != junction["replica"] and late["evicted_before_admission"] is False
    # exact: every prediction is what the replica delivered, and the late sessions reuse P
    p = exact["prediction"]
    assert p["over_predicted"] == p["under_predicted"] == p["mismatched_without_eviction"] == 0
    for row in exact_rows.values():
        assert row["evicted_before_admission"] is False
        assert row["predicted_tokens"] == row["cached_tokens"]
    # (ties break by turn, so which replica holds a round's junction varies from round to round)
    for k in range(ROUNDS):
        late, junction = exact_rows[f"k{k}-late"], exact_rows[f"k{k}-junction"]
        assert (late["replica"], late["cached_tokens"]) == (junction["replica"], PREFIX)
    assert exact["cached_tokens"] == ROUNDS * PREFIX > chain["cached_tokens"] == 0
