"""Prometheus metrics of the fleet front, one registry per app, labelled by replica.

Counters (names in the style of `kvreuse.serve.metrics`):

    kvreuse:fleet_routed_requests_total{replica}           requests sent to the replica
    kvreuse:fleet_failed_requests_total{replica}           answered with an error (any status
                                                           ≥ 500, or the replica unreachable)
    kvreuse:fleet_prompt_tokens_total{replica}             prompt tokens routed (load balance)
    kvreuse:fleet_delivered_cached_tokens_total{replica}   usage.prompt_tokens_details.cached_tokens
                                                           of every answer that reported usage
    kvreuse:fleet_predicted_requests_total{replica}        answers with both a prediction (the
                                                           policy predicts) and a delivery
    kvreuse:fleet_predicted_cached_tokens_total{replica}   what the policy predicted for those
    kvreuse:fleet_prediction_delivered_tokens_total{replica}  what those delivered
    kvreuse:fleet_prediction_error_tokens_total{replica,direction}
                                                           over: Σ max(0, predicted − delivered);
                                                           under: Σ max(0, delivered − predicted)
    kvreuse:fleet_mispredicted_requests_total{replica}     predicted ≠ delivered

Gauges, read at scrape time: `kvreuse:fleet_replica_up`, `kvreuse:fleet_requests_in_flight`,
`kvreuse:fleet_tokens_in_flight`, `kvreuse:fleet_mirror_exact` (0 once the replica's event
stream lost batches that replay could not restore, and while the replica is not up),
`kvreuse:fleet_replica_state{replica,state}` (1 for the state it is in: up, down, restarting,
given-up). Read with them, `kvreuse:fleet_replica_restarts_total{replica}`: the processes
`kvreuse fleet` started again for the replica.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvreuse.fleet.serving.members import STATES

P = "kvreuse:fleet_"

Status = Callable[[], list[dict[str, object]]]

COUNTERS = (  # (key, metric name without _total, help)
    ("routed", "routed_requests", "Requests sent to the replica."),
    ("failed", "failed_requests", "Requests the fleet answered with an error."),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens routed to the replica."),
    ("delivered", "delivered_cached_tokens", "Cached prompt tokens the replica reported."),
    ("predicted_requests", "predicted_requests", "Answers with a prediction and a usage."),
    ("predicted", "predicted_cached_tokens", "Cached tokens the routing policy predicted."),
    (
        "prediction_delivered",
        "prediction_delivered_tokens",
        "Cached tokens delivered where a prediction was made.",
    ),
    ("mispredicted", "mispredicted_requests", "Answers whose cached tokens missed the prediction."),
)
ERROR_DOC = "Tokens predicted but not delivered (over), delivered but not predicted (under)."
GAUGES = (  # (status key, metric name, help)
    ("up", "replica_up", "1 while the front routes to the replica, 0 while it is down."),
    ("requests_in_flight", "requests_in_flight", "Requests routed and not yet answered."),
    ("tokens_in_flight", "tokens_in_flight", "Prompt tokens of the requests in flight."),
    ("mirror_exact", "mirror_exact", "1 while every KV event batch of the replica was applied."),
)
RESTARTS_DOC = "Processes of the replica the fleet started again after one exited."
STATE_DOC = "1 for the state the replica is in (up, down, restarting, given-up)."


class FrontMetrics(Collector):
    """The counters, updated by the front as requests are routed and answered; families are
    built per scrape (like `kvreuse.serve.metrics`), the gauges from the dispatcher's status."""

    def __init__(self, status: Status) -> None:
        self.status = status
        self.replicas: list[str] = []
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.errors: dict[tuple[str, str], int] = defaultdict(int)
        self.last: list[dict[str, object]] = []
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def add_replica(self, replica: str) -> None:
        """Show the replica's counters at 0 before its first request."""
        self.replicas.append(replica)

    def refresh(self) -> None:
        """Read the gauges' values (takes the dispatcher's lock: call it off the event loop)."""
        self.last = self.status()

    def _add(self, key: str, replica: str, value: int = 1) -> None:
        with self._lock:
            self.counts[key][replica] += value

    def on_routed(self, replica: str, num_tokens: int) -> None:
        self._add("routed", replica)
        self._add("prompt_tokens", replica, num_tokens)

    def on_failed(self, replica: str) -> None:
        self._add("failed", replica)

    def on_delivered(self, replica: str, predicted: int | None, delivered: int) -> None:
        self._add("delivered", replica, delivered)
        if predicted is None:
            return
        self._add("predicted_requests", replica)
        self._add("predicted", replica, predicted)
        self._add("prediction_delivered", replica, delivered)
        self._add("mispredicted", replica, int(predicted != delivered))
        with self._lock:
            self.errors[replica, "over"] += max(0, predicted - delivered)
            self.errors[replica, "under"] += max(0, delivered - predicted)

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: families are built per scrape

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts = {k: dict(v) for k, v in self.counts.items()}
            errors = dict(self.errors)
        for key, name, doc in COUNTERS:
            fam = CounterMetricFamily(P + name, doc, labels=["replica"])
            for r in self.replicas:
                fam.add_metric([r], float(counts.get(key, {}).get(r, 0)))
            yield fam
        fam = CounterMetricFamily(
            P + "prediction_error_tokens", ERROR_DOC, labels=["replica", "direction"]
        )
        for r in self.replicas:
            for direction in ("over", "under"):
                fam.add_metric([r, direction], float(errors.get((r, direction), 0)))
        yield fam
        for key, name, doc in GAUGES:
            gauge = GaugeMetricFamily(P + name, doc, labels=["replica"])
            for row in self.last:
                gauge.add_metric([str(row["name"])], float(row[key]))  # type: ignore[arg-type]
            yield gauge
        yield from self._supervision()

    def _supervision(self) -> Iterator[Metric]:
        """Restarts and states, from the last status read."""
        restarts = CounterMetricFamily(P + "replica_restarts", RESTARTS_DOC, labels=["replica"])
        state = GaugeMetricFamily(P + "replica_state", STATE_DOC, labels=["replica", "state"])
        for row in self.last:
            name = str(row["name"])
            restarts.add_metric([name], float(row["restarts"]))  # type: ignore[arg-type]
            for value in STATES:
                state.add_metric([name, value], float(row["state"] == value))
        yield restarts
        yield state
