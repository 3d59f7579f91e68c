"""A Ray Serve request router that scores replicas exactly: `KvreuseRequestRouter`.

Ray Serve's public request-router API (ray.serve.request_router, alpha in Ray 2.60): a
`RequestRouter` subclass chooses, per request, ranks of replicas of one deployment
(`choose_replicas`); Ray tries the first rank first (the replica with the shortest queue in it)
and falls back rank by rank. It runs wherever the deployment's handle lives: here, in the
fleet's ingress replica, whose calls pass `{"tokens": [...], "cache_salt": …, "rid": …}` as
their first argument.

This router keeps the fleet's `Dispatcher` (the `Router`, one KV event subscriber per replica):
each kvreuse replica announces its events and replay endpoints in its replica metadata
(`record_replica_metadata`, read once it is ready; `record_routing_stats` carries the same for
Ray versions without that hook), the router follows them, and scores every candidate with the
policy. Rank 0 holds the candidates of lowest cost, in turns when several tie (Ray takes the
shortest queue among them, the first among equals), then the rest by cost. Load is what this
router sent and Ray has not reported completed (`on_request_routed`, `on_request_completed`).

This module needs Ray; Ray imports it by its path (`deploy.ROUTER_CLASS`) when the app is
deployed. Ray pickles a router class with its module by value, so everything it shares with
the ingress (the predictions) lives in `kvreuse.fleet.ray_serve.shared`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from ray.serve.request_router import (  # type: ignore[import-not-found, unused-ignore]
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from kvreuse.deployment import load_geometry
from kvreuse.fleet import DEFAULT_LOAD_WEIGHT
from kvreuse.fleet.ray_serve import shared
from kvreuse.fleet.serving.dispatch import Dispatcher, NoReplica, Routed

log = logging.getLogger("ray.serve")


class KvreuseRequestRouter(RequestRouter):  # type: ignore[misc, unused-ignore]
    """Routes by the fleet's policy over the replicas' mirrors (docs/fleet-serving.md)."""

    def initialize_state(
        self,
        geometry: str = "",
        policy: str = "exact",
        load_weight: float = DEFAULT_LOAD_WEIGHT,
        **_: Any,
    ) -> None:
        """`geometry`: the replicas' geometry as a TOML file's text."""
        config = load_geometry(geometry, "the fleet's geometry").cache
        self.dispatcher = Dispatcher(config, policy, load_weight=load_weight)
        self.members: dict[str, Any] = {}  # replica unique id → Member
        self.sent: dict[str, Routed] = {}  # internal request id → where it went
        self.decided: dict[str, Routed] = {}  # internal request id → last decision

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        payload = _payload(pending_request)
        if payload is None or not candidate_replicas:
            return [candidate_replicas]
        await self._follow(candidate_replicas)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        usable = {m.index for uid, m in self.members.items() if uid in by_id}
        exclude = frozenset(m.index for m in self.members.values()) - usable
        try:
            routed = await asyncio.to_thread(
                self.dispatcher.route,
                payload["tokens"],
                request_id=str(payload.get("rid", "")),
                cache_salt=payload.get("cache_salt"),
                exclude=exclude,
                count=False,
            )
        except NoReplica:  # no candidate announced its events yet
            return [candidate_replicas]
        assert pending_request is not None
        self.decided[pending_request.metadata.internal_request_id] = routed
        predicted = None if routed.decision is None else routed.decision.predicted
        if predicted is not None:
            per_replica = {uid: predicted[m.index] for uid, m in self.members.items()}
            shared.remember_prediction(str(payload.get("rid", "")), per_replica)
        # the policy's own tie rule (routing.policy.Turn) already spread equal costs: the
        # chosen replica heads rank 0
        return list(_ranks(routed, candidate_replicas, self.members))

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: Any, result: Any
    ) -> None:
        rid = pending_request.metadata.internal_request_id
        routed = self.decided.pop(rid, None)
        member = self.members.get(replica_id.unique_id)
        if routed is None or member is None:
            return
        if routed.member is not member:  # Ray took a later rank
            routed = Routed(member, None, routed.num_tokens)
        self.dispatcher.begin(routed)
        self.sent[rid] = routed

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        routed = self.sent.pop(internal_request_id, None)
        if routed is not None:
            self.dispatcher.done(routed)

    async def _follow(self, replicas: list[RunningReplica]) -> None:
        """Subscribe to the events of every candidate that announced them."""
        for replica in replicas:
            uid = replica.replica_id.unique_id
            if uid in self.members:
                continue
            info = {**dict(replica.routing_stats or {}), **_metadata(replica)}
            events, replay = info.get(shared.EVENTS_KEY), info.get(shared.REPLAY_KEY)
            if not isinstance(events, str):
                continue
            try:
                member = await asyncio.to_thread(
                    self.dispatcher.add, uid, "", events, replay_endpoint=replay, bind=False
                )
            except ValueError as exc:
                log.warning("kvreuse router: cannot follow replica %s: %s", uid, exc)
                continue
            self.members[uid] = member


def _metadata(replica: RunningReplica) -> dict[str, Any]:
    """The replica's metadata hook (Ray ≥ 2.60), or nothing on a Ray without it."""
    try:
        return dict(replica.replica_metadata)
    except AttributeError:
        return {}


def _payload(pending: PendingRequest | None) -> dict[str, Any] | None:
    if pending is None or not pending.args:
        return None
    payload = pending.args[0]
    if not isinstance(payload, dict) or not isinstance(payload.get("tokens"), list):
        return None
    return payload


def _ranks(
    routed: Routed, candidates: list[RunningReplica], members: dict[str, Any]
) -> tuple[list[RunningReplica], list[RunningReplica]]:
    """Rank 0: the chosen replica and any candidate of equal cost; then the others by cost
    (candidates whose events are not followed yet last). Ray takes, within a rank, the
    replica with the shortest queue, the first one among equals."""
    index = {uid: m.index for uid, m in members.items()}
    costs = None if routed.decision is None else routed.decision.costs

    def cost(r: RunningReplica) -> float:
        i = index.get(r.replica_id.unique_id)
        if i is None:
            return float("inf")
        if i == routed.member.index:
            return float("-inf")
        return float("inf") if costs is None else costs[i]

    ranked = sorted(candidates, key=cost)
    best = -math.inf if costs is None else costs[routed.member.index]
    first = [r for r in ranked if cost(r) in (-math.inf, best)]
    return first, [r for r in ranked if r not in first]
