"""What the manager shows of itself: statistics, metrics, events, exports and descriptions.

A mixin of the facade (kvreuse.core.manager): reads only, except that taking events
empties the log and `set_event_log` switches it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

from kvreuse.core.config import Geometry
from kvreuse.core.errors import UnknownRequestError
from kvreuse.core.events import Event, EventLog
from kvreuse.core.metrics import RequestStats, snapshot, tier_snapshot
from kvreuse.core.pool import BlockPool
from kvreuse.core.request import Phase, RequestState
from kvreuse.core.savepoints import replay_point
from kvreuse.core.tiers import TierStack
from kvreuse.core.views import describe, export_entries, export_ghost


class Observed:
    geo: Geometry
    pool: BlockPool
    events: EventLog
    requests: dict[str, RequestState]
    counters: Counter[str]
    reasons: Counter[str]
    cow: Counter[str]
    _finished: OrderedDict[str, RequestStats]
    tiers: TierStack

    def _get(self, rid: str, op: str) -> RequestState:
        raise NotImplementedError

    def save_positions(self, req_id: str, lookup: Any = None) -> list[int]:
        raise NotImplementedError

    def _stats(self, st: RequestState) -> RequestStats:
        return RequestStats(
            st.request_id,
            st.first_hit,
            st.first_reason,
            st.admissions,
            st.last_hit,
            st.last_reason,
            st.first_tier_tokens,
        )

    def request_stats(self, req_id: str) -> RequestStats:
        st = self.requests.get(req_id)
        if st is not None:
            return self._stats(st)
        if req_id in self._finished:
            return self._finished[req_id]
        raise UnknownRequestError(f"request_stats: unknown or forgotten request {req_id!r}")

    def metrics(self) -> dict[str, Any]:
        """Spec §12.1's counters and gauges; with tiers below the pool, `tiers` holds each
        tier's (`kvreuse.core.metrics.tier_snapshot`)."""
        out = snapshot(
            self.geo, self.pool, self.counters, self.reasons, self.cow, self.events.dropped
        )
        if self.tiers:
            out["tiers"] = tier_snapshot(self.geo, self.tiers)
        return out

    def take_events(self) -> list[Event]:
        return self.events.take(self.geo)

    def set_event_log(self, enabled: bool) -> None:
        """Record events (spec §13) or not, whatever `enable_events` said: a server records only
        while something publishes them. Turning it off drops what is pending."""
        self.events.set_enabled(enabled)

    def describe(self, req_id: str | None = None) -> str:
        if req_id is None:
            return describe(self.geo, self.pool, self.metrics(), None, [])
        st = self._get(req_id, "describe")
        wanted = self.save_positions(req_id) if st.phase is Phase.RUNNING else []
        return describe(self.geo, self.pool, self.metrics(), st, wanted)

    def export_entries(self) -> list[tuple[int, int, bytes, str, int]]:
        return export_entries(self.pool)

    def export_ghost(self) -> list[tuple[int, int, bytes]]:
        return export_ghost(self.pool)

    def replay_point(self, prompt_len: int) -> int:
        """ρ(P) of this geometry (spec §8): the hit of an identical resend."""
        return replay_point(self.geo, prompt_len)
