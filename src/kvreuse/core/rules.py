"""Rules of use of `allocate` (spec §3, §9.1, §9.6), checked before anything changes.

Growth of a running request computes [start, end) with start = the tokens already scheduled.
With N̂ = N + one per uncommitted step that ends at or beyond N (overlapped steps, 10.6):

    start < N̂ − 1   prefill (or re-prefill after a hit): end ≤ N̂
    start = N̂ − 1   decode: positions N̂ … end − 1 are draft tokens under verification
    start > N̂ − 1   refused: a step that verifies drafts must commit first
"""

from __future__ import annotations

from collections.abc import Sequence

from kvreuse.core.errors import StaleLookupError
from kvreuse.core.lookup import LookupResult
from kvreuse.core.request import Phase, RequestState


def check_allocate(
    st: RequestState,
    num_new_tokens: int,
    lookup: LookupResult | None,
    num_extra_slots: int,
    epoch: int,
    in_flight_ends: Sequence[int],
) -> None:
    """Raise ValueError / StaleLookupError naming the broken rule; return if the call is valid."""
    req_id = st.request_id
    for name, v in (("num_new_tokens", num_new_tokens), ("num_extra_slots", num_extra_slots)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"allocate: {name} must be an int, got {v!r}")
    if num_new_tokens < 1 or num_extra_slots < 0:
        raise ValueError(
            f"allocate: need num_new_tokens ≥ 1 and num_extra_slots ≥ 0 "
            f"(got {num_new_tokens}, {num_extra_slots})"
        )
    if st.open_plan is not None:
        raise ValueError(f"allocate: request {req_id!r} already has a plan in the open step")
    if st.phase is Phase.WAITING:
        if lookup is None:
            raise ValueError(f"allocate: admitting {req_id!r} needs its LookupResult")
        if lookup.request_id != req_id or lookup.epoch != epoch:
            raise StaleLookupError(
                f"allocate: the lookup of {lookup.request_id!r} is from epoch {lookup.epoch}, "
                f"the manager is at {epoch}; call lookup() again"
            )
        if lookup.hit + num_new_tokens > len(st.tokens):
            raise ValueError(
                f"allocate: hit {lookup.hit} + num_new_tokens {num_new_tokens} exceeds "
                f"the request's {len(st.tokens)} tokens"
            )
        return
    if lookup is not None:
        raise ValueError(f"allocate: {req_id!r} is running; growth takes no lookup")
    if st.deferred is not None:
        raise ValueError(f"allocate: {req_id!r} has a deferred {st.deferred}; it cannot grow")
    num = len(st.tokens)
    n_hat = num + sum(1 for end in in_flight_ends if end >= num)
    start, end = st.scheduled, st.scheduled + num_new_tokens
    if start < n_hat - 1 and end > n_hat:
        raise ValueError(
            f"allocate: {req_id!r} prefill from start={start} to end={end} passes "
            f"N={n_hat}; the limit is end ≤ {n_hat}"
        )
    if start > n_hat - 1:
        raise ValueError(
            f"allocate: {req_id!r} has start={start} > N−1={n_hat - 1}; a step that "
            "verifies drafts must commit before the request grows again"
        )


def plain_growth(st: RequestState, num_new_tokens: int) -> bool:
    """The common growth (a decode step, the next prefill chunk), valid by these facts alone:
    `allocate` runs its full checks only when this is false."""
    return (
        type(num_new_tokens) is int
        and st.phase is Phase.RUNNING
        and st.open_plan is None
        and st.deferred is None
        and not st.inflight
        and num_new_tokens > 0
        and (
            st.scheduled == len(st.tokens) - 1  # decode (plus drafts)
            or st.scheduled + num_new_tokens <= len(st.tokens)  # prefill within N
        )
    )
