"""Prometheus metrics of the server, one `CollectorRegistry` per app.

A custom collector reads a snapshot taken on the step-loop thread (the only thread that may call
the manager), so a scrape sees the core's counters exactly: for any window,
Σ usage.prompt_tokens_details.cached_tokens == Δ kvreuse:prefix_cache_hits_total.

| kvreuse name                                  | vLLM name                                   |
|-----------------------------------------------|---------------------------------------------|
| kvreuse:prefix_cache_queries_total            | vllm:prefix_cache_queries(_total)           |
| kvreuse:prefix_cache_hits_total               | vllm:prefix_cache_hits(_total)              |
| kvreuse:kv_cache_usage_perc                   | vllm:kv_cache_usage_perc (gpu_cache_usage_perc) |
| kvreuse:num_requests_running / _waiting       | vllm:num_requests_running / _waiting        |
| kvreuse:num_preemptions_total                 | vllm:num_preemptions(_total)                |
| kvreuse:prompt_tokens_by_source_total{source} | vllm:prompt_tokens_by_source(_total)        |
| kvreuse:external_prefix_cache_queries_total   | vllm:external_prefix_cache_queries(_total)  |
| kvreuse:external_prefix_cache_hits_total      | vllm:external_prefix_cache_hits(_total)     |
| kvreuse:kv_offload_total_bytes_total          | vllm:kv_offload_total_bytes(_total)         |
| kvreuse:kv_tier_usage_perc{tier}              | vllm:kv_offload_cpu_cache_usage_perc (host) |

Per tier below the cache (label `tier`, and its KV events' `medium`) also
kvreuse:kv_tier_hits_total (prompt tokens), kv_tier_loaded_blocks_total{group_kind},
kv_tier_stored_blocks_total, kv_tier_evicted_blocks_total, kv_tier_faulty_blocks_total
(slots whose bytes failed: each a miss) and kv_tier_blocks /
kv_tier_capacity_blocks (gauges); `external_*` and the tier families appear only with tiers,
and the bytes only where an engine moves them. Every prompt-token counter counts first
admissions, as prefix_cache_* do, so Σ prompt_tokens_by_source == prefix_cache_queries.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvreuse.serve.backend import Backend
from kvreuse.serve.loop import LoopStats

P = "kvreuse:"

# (snapshot key, metric name without _total, help)
COUNTERS = (
    ("prefix_cache_requests", "prefix_cache_requests", "Requests admitted for the first time."),
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up (first admissions)."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens served from the prefix cache."),
    ("prefix_cache_preempted_requests", "prefix_cache_preempted_requests", "Re-admissions."),
    ("prefix_cache_preempted_queries", "prefix_cache_preempted_queries", "Tokens re-looked up."),
    ("prefix_cache_preempted_hits", "prefix_cache_preempted_hits", "Tokens re-hit."),
    ("kv_blocks_evicted_total", "kv_blocks_evicted", "Cached blocks evicted for reuse."),
)
LABELLED = (
    ("prefix_cache_reason_total", "prefix_cache_reason", "reason", "First admissions by reason."),
    ("kv_entries_removed_total", "kv_entries_removed", "cause", "Index keys removed."),
    ("kv_entries_published_total", "kv_entries_published", "kind", "Index keys published."),
    ("kv_cow_copies_total", "kv_cow_copies", "group_kind", "Copy-on-write page copies."),
    ("kv_checkpoint_saves_total", "kv_checkpoint_saves", "outcome", "Recurrent state saves."),
)
BLOCK_GAUGES = (
    ("kv_blocks_in_use", "kv_blocks_in_use", "Blocks referenced by requests."),
    ("kv_blocks_cached", "kv_blocks_cached", "Unreferenced blocks that still carry keys."),
)
GAUGES = (  # (snapshot key, metric name, help)
    ("kv_usage", "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)."),
    ("kv_blocks_free", "kv_blocks_free", "Blocks with no reference and no key."),
    ("num_requests_running", "num_requests_running", "Requests in the running batch."),
    ("num_requests_waiting", "num_requests_waiting", "Requests waiting for admission."),
)
REASONS = (
    "below_unit",
    "cap_reached",
    "recurrent_limited",
    "window_limited",
    "spec_decode_rewind",
    "evicted",
    "no_entry",
    "disabled",
    "skip_read",
)


def take_snapshot(backend: Backend, stats: LoopStats) -> dict[str, Any]:
    """Runs on the step-loop thread."""
    snap = dict(backend.mgr.metrics())
    sched = backend.scheduler
    snap["num_requests_running"] = len(sched.running)
    snap["num_requests_waiting"] = len(sched.waiting)
    snap["num_preemptions"] = stats.preemptions
    snap["num_steps"] = stats.steps
    snap["request_finished"] = dict(stats.requests_finished)
    moved = backend.transfers
    if moved is not None and moved.media:
        snap["transfers"] = dict(moved.bytes)
    return snap


class SnapshotCollector(Collector):
    """Yields the metric families of the last snapshot; `set()` before each scrape."""

    def __init__(self) -> None:
        self.snap: Mapping[str, Any] = {}

    def set(self, snap: Mapping[str, Any]) -> None:
        self.snap = snap

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: families are built per scrape

    def collect(self) -> Iterator[Metric]:
        s = self.snap
        if not s:
            return
        for key, name, doc in COUNTERS:
            yield CounterMetricFamily(P + name, doc, value=float(s.get(key, 0)))
        yield CounterMetricFamily(
            P + "num_preemptions", "Preemptions by recompute.", value=float(s["num_preemptions"])
        )
        yield from self._labelled(s)
        for key, name, doc in GAUGES:
            yield GaugeMetricFamily(P + name, doc, value=float(s[key]))
        for key, name, doc in BLOCK_GAUGES:
            fam = GaugeMetricFamily(P + name, doc, labels=["group_kind"])
            for kind, v in sorted(s[key].items()):
                fam.add_metric([kind], float(v))
            yield fam
        finished = CounterMetricFamily(
            P + "request_finished", "Requests ended, by finish reason.", labels=["finished_reason"]
        )
        for reason, v in sorted(s["request_finished"].items()):
            finished.add_metric([reason], float(v))
        yield finished
        yield from _sources(s)
        if "tiers" in s:
            yield from _external(s)
            yield from _tiers(s["tiers"], s.get("transfers"))

    def _labelled(self, s: Mapping[str, Any]) -> Iterator[Metric]:
        for key, name, label, doc in LABELLED:
            fam = CounterMetricFamily(P + name, doc, labels=[label])
            values: dict[str, Any] = dict(s.get(key, {}))
            if key == "prefix_cache_reason_total":
                values = {r: values.get(r, 0) for r in REASONS} | values
            for lv, v in sorted(values.items()):
                fam.add_metric([lv], float(v))
            yield fam


def new_registry() -> tuple[CollectorRegistry, SnapshotCollector]:
    registry = CollectorRegistry(auto_describe=False)
    collector = SnapshotCollector()
    registry.register(collector)
    return registry, collector


def _sources(s: Mapping[str, Any]) -> Iterator[Metric]:
    """vLLM's split of prompt tokens: computed, hit on the device, loaded from a tier."""
    queries, hits = s["prefix_cache_queries"], s["prefix_cache_hits"]
    external = sum(t["hit_tokens"] for t in s.get("tiers", {}).values())
    fam = CounterMetricFamily(
        P + "prompt_tokens_by_source",
        "Prompt tokens of first admissions by where they came from.",
        labels=["source"],
    )
    for source, v in (
        ("local_compute", queries - hits),
        ("local_cache_hit", hits - external),
        ("external_kv_transfer", external),
    ):
        fam.add_metric([source], float(v))
    yield fam


def _external(s: Mapping[str, Any]) -> Iterator[Metric]:
    """vLLM's counters of a KV connector's lookups: here the tiers below the cache."""
    yield CounterMetricFamily(
        P + "external_prefix_cache_queries",
        "Prompt tokens looked up in the cache and its tiers (first admissions).",
        value=float(s["prefix_cache_queries"]),
    )
    yield CounterMetricFamily(
        P + "external_prefix_cache_hits",
        "Prompt tokens loaded from the tiers below the cache (first admissions).",
        value=float(sum(t["hit_tokens"] for t in s["tiers"].values())),
    )


def _tiers(tiers: Mapping[str, Any], transfers: Mapping[str, int] | None) -> Iterator[Metric]:
    """The families of the tiers below the cache (see the module's docstring)."""
    labels = ["tier", "medium"]
    per_tier = {
        "kv_tier_hits": ("Prompt tokens loaded from the tier (first admissions).", "hit_tokens"),
        "kv_tier_stored_blocks": ("Blocks copied into the tier.", "stored_blocks"),
        "kv_tier_evicted_blocks": ("Tier slots freed to make room.", "evicted_blocks"),
        "kv_tier_faulty_blocks": (
            "Tier slots whose bytes could not be read or written (absent, corrupt, another "
            "block's, the store unavailable): each a miss, recomputed.",
            "faulty_blocks",
        ),
    }
    for name, (doc, key) in per_tier.items():
        fam = CounterMetricFamily(P + name, doc, labels=labels)
        for tier, t in tiers.items():
            fam.add_metric([tier, t["medium"]], float(t[key]))
        yield fam
    loaded = CounterMetricFamily(
        P + "kv_tier_loaded_blocks", "Blocks loaded from the tier.", labels=[*labels, "group_kind"]
    )
    for tier, t in tiers.items():
        for kind, v in sorted(t["loaded_blocks"].items()):
            loaded.add_metric([tier, t["medium"], kind], float(v))
    yield loaded
    gauges = {
        "kv_tier_blocks": "Blocks the tier holds.",
        "kv_tier_capacity_blocks": "Blocks the tier has room for.",
        "kv_tier_usage_perc": "Fraction of the tier's blocks in use (0..1).",
    }
    for name, doc in gauges.items():
        gauge = GaugeMetricFamily(P + name, doc, labels=labels)
        for tier, t in tiers.items():
            held, room = t["held_blocks"], t["capacity_blocks"]
            value = {"kv_tier_blocks": held, "kv_tier_capacity_blocks": room}.get(name)
            gauge.add_metric([tier, t["medium"]], float(held / room if value is None else value))
        yield gauge
    if transfers is not None:
        fam = CounterMetricFamily(
            P + "kv_offload_total_bytes",
            "Bytes moved between the cache and its tiers.",
            labels=["transfer_type"],
        )
        for way, v in sorted(transfers.items()):
            fam.add_metric([way], float(v))
        yield fam
