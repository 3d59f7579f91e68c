"""What a simulation keeps of its finished requests: totals, a row per request kind, the first
rows for the report, and two small arrays for the plot. A run does not hold its rows: they go to
a sink (requests.jsonl) as requests finish, so its memory follows what is in flight.
"""

from __future__ import annotations

import array
import re
from dataclasses import dataclass
from typing import Any

from kvreuse.vocab import percent, plural

MAX_KINDS = 20  # rows of the summary table; more kinds share an "(other)" row
REPORT_ROWS = 100  # per-request rows in report.md (requests.jsonl has every one)
NAMED_TOO_LARGE = 10  # ids named in the "exceed the cache" message
OTHER = "(other)"


def kind_of(request_id: str) -> str:
    """The request's kind for the summary table: its id with every number replaced by '*'
    (cold-2048 → cold-*, p17 → p*, s0-t3 → s*-t*)."""
    return re.sub(r"\d+", "*", request_id)


@dataclass(slots=True)
class KindTotals:
    """One row of the summary table: requests of one kind."""

    num_requests: int = 0
    prompt_tokens: int = 0  # of the admitted requests: the hit rate's denominator
    cached_tokens: int = 0
    num_refused: int = 0  # refused as too large: left out of the hit rate
    num_timed: int = 0  # requests that produced a first token (rejected ones did not)
    queue_s: float = 0.0  # sums over the timed requests
    ttft_s: float = 0.0

    def add(self, row: dict[str, Any], admitted: bool) -> None:
        self.num_requests += 1
        if admitted:
            self.prompt_tokens += row["prompt_tokens"]
        else:
            self.num_refused += 1
        self.cached_tokens += row["cached_tokens"]
        if row["ttft_estimate_s"] is not None:
            self.num_timed += 1
            self.queue_s += row["queue_s"]
            self.ttft_s += row["ttft_estimate_s"]


class Tally:
    """Totals over the rows a run has finished, in workload order."""

    def __init__(self) -> None:
        self.num_rows = 0
        self.num_admitted = 0  # rows whose request was admitted (the core counted it)
        self.admitted_prompt_tokens = 0
        self.refused_prompt_tokens = 0  # of the rows not admitted: left out of the hit rate
        self.cached_tokens = 0
        self.preemptions = 0
        self.too_large: list[str] = []  # the first NAMED_TOO_LARGE ids
        self.num_too_large = 0
        self.kinds: dict[str, KindTotals] = {}
        self.first_rows: list[dict[str, Any]] = []
        # per request, for the cached-vs-prompt plot: 16 bytes a request, not a dict
        self.prompt_per_request = array.array("q")
        self.cached_per_request = array.array("q")

    def add(self, row: dict[str, Any], admitted: bool) -> None:
        self.num_rows += 1
        if admitted:
            self.num_admitted += 1
            self.admitted_prompt_tokens += row["prompt_tokens"]
        else:
            self.refused_prompt_tokens += row["prompt_tokens"]
        self.cached_tokens += row["cached_tokens"]
        self.preemptions += row["preemptions"]
        if row["finish_reason"] == "too_large":
            self.num_too_large += 1
            if len(self.too_large) < NAMED_TOO_LARGE:
                self.too_large.append(row["id"])
        kind = kind_of(row["id"])
        if kind not in self.kinds and len(self.kinds) >= MAX_KINDS - 1:
            kind = OTHER
        self.kinds.setdefault(kind, KindTotals()).add(row, admitted)
        if len(self.first_rows) < REPORT_ROWS:
            self.first_rows.append(row)
        self.prompt_per_request.append(row["prompt_tokens"])
        self.cached_per_request.append(row["cached_tokens"])

    def hit_rate_line(self) -> str:
        """The one hit rate a report states, with its denominator and what it leaves out."""
        admitted = self.num_admitted
        line = (
            f"hit rate {percent(self.cached_tokens, self.admitted_prompt_tokens)}: "
            f"{self.cached_tokens:,} cached of {self.admitted_prompt_tokens:,} prompt tokens of "
            f"the {plural(admitted, 'admitted request')}"
        )
        left_out = self.num_rows - admitted
        if left_out:
            line += (
                f" (it leaves out {plural(left_out, 'request')} never admitted, "
                f"{self.refused_prompt_tokens:,} prompt tokens)"
            )
        return line

    def too_large_line(self, capacity: int | None) -> str | None:
        """'N requests exceed the cache (capacity X tokens): ids…', or None."""
        if not self.num_too_large:
            return None
        more = self.num_too_large - len(self.too_large)
        ids = ", ".join(self.too_large) + (f" and {more:,} more" if more else "")
        cap = (
            "unbounded" if capacity is None else f"{capacity:,} token{'' if capacity == 1 else 's'}"
        )
        verb = "request exceeds" if self.num_too_large == 1 else "requests exceed"
        return f"{self.num_too_large:,} {verb} the cache (capacity {cap}): {ids}"
