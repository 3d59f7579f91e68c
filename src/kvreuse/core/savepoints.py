"""Where recurrent states are saved: pure functions of (geometry, request).

A recurrent group can only resume at a position where a state was written, so the manager
decides in advance which positions are worth a state block:

    prompt of P tokens, u = 256, recurrent page M = 1024, common page S = 2048

    0        1024      2048      3072    ρ=3328  P=3400
    |---------|---------|---------|---------|--|
                                          replay: ρ(P), ⌊ρ/M⌋·M, ⌊ρ/S⌋·S (an identical resend)
              junction: where non-recurrent groups reach further than the states (and its
                        ⌊·/M⌋·M, ⌊·/S⌋·S), so the next request can close the gap
              dense:    every multiple of M (recurrent_retention = "dense")
              rolling:  the last unit boundaries of each step (κ + 1 of them), held privately
                        so that a finish can publish φ(T)

Allocation plans these positions (`planned_positions`, `step_saves`, `dense_positions`),
commit keeps the rolling ones in range (`rolling_range`), the facade reports what is still
wanted (`save_positions`), and the qualifier predicts hits with `replay_point`. Nothing here
changes state; the only input besides the geometry and the request is a group's key set, to skip
positions that already have a state.
"""

from __future__ import annotations

from collections.abc import Container, Mapping

from kvreuse.core.config import Geometry, GroupGeometry
from kvreuse.core.request import Phase, RequestState, SavePurpose

_RANK = {p: i for i, p in enumerate(SavePurpose)}


def replay_point(geo: Geometry, prompt_len: int) -> int:
    """ρ(P): the hit of an identical resend of a P-token prompt when every entry is resident.

    The last prompt token is never served from cache (its logits are needed), and lookahead
    mode needs L successor tokens; drop mode keeps one unit of margin for the drafter.
    """
    u = geo.hash_unit
    if geo.spec_mode == "drop":
        return max(0, prompt_len // u * u - u)
    return max(0, (prompt_len - max(geo.lookahead, 1)) // u * u)


def finish_point(geo: Geometry, num_units: int, committed: int) -> int:
    """φ(T): the state a request publishes when it finishes after T committed tokens (the end
    of its last full unit, one unit earlier in drop mode): the low end of `rolling_range`."""
    return rolling_range(geo, num_units, committed)[0]


def rolling_range(geo: Geometry, num_units: int, committed: int) -> tuple[int, int]:
    """[φ(T), ⌊T/u⌋·u]: the positions whose rolling states a request keeps after a commit."""
    u = geo.hash_unit
    top = committed // u
    # without a min() call: this runs on every decode commit of a hybrid
    phi = (top if top <= num_units else num_units) * u
    return (phi - u if geo.spec_mode == "drop" else phi), top * u


def planned_positions(
    geo: Geometry,
    req: RequestState,
    g: GroupGeometry,
    hit: int,
    junction: int | None,
    keys: Container[bytes],
) -> dict[int, SavePurpose]:
    """Positions recurrent group `g` plans at admission, each with its first purpose.

    `keys` is the group's index as the lookup saw it: a position that already has a state is
    not planned again.
    """
    u, M, S = geo.hash_unit, g.page_size, geo.common_page
    nu = req.chain.num_units * u
    rho = replay_point(geo, req.prompt_len)
    candidates = [(rho, SavePurpose.REPLAY), (rho // M * M, SavePurpose.REPLAY)]
    candidates.append((rho // S * S, SavePurpose.REPLAY))
    if junction is not None:
        for c in (junction, junction // M * M, junction // S * S):
            candidates.append((c, SavePurpose.JUNCTION))
    if geo.dense_retention:
        candidates += [(c, SavePurpose.DENSE) for c in range(hit // M * M + M, nu + 1, M)]
    out: dict[int, SavePurpose] = {}
    hashes = req.chain.hashes
    for c, why in candidates:
        valid = hit < c <= nu and c % u == 0 and hashes[c // u] not in keys
        if valid and (c not in out or _RANK[why] < _RANK[out[c]]):
            out[c] = why
    return out


def is_quiet_decode(geo: Geometry, req: RequestState, start: int, end: int) -> bool:
    """A decode step within one unit: no save is due.

    Planned, dense and rolling positions are all unit boundaries (pages are multiples of u;
    invariant I14 checks the planned ones), and (start, end] inside one unit holds none. Most
    decode steps take this exit, which is why it is checked before any per-group work.
    """
    u = geo.hash_unit
    return start > 0 and start >= len(req.tokens) - 1 and end // u == start // u


def dense_positions(
    geo: Geometry, req: RequestState, g: GroupGeometry, start: int, end: int, keys: Container[bytes]
) -> list[int]:
    """Dense retention: the multiples of M in (start, end] above the admission's hashed length
    that are neither planned nor already present (they are planned per step as tokens arrive)."""
    if not geo.dense_retention:
        return []
    M, u = g.page_size, geo.hash_unit
    planned = req.planned[g.group_id]
    hashes, nu = req.chain.hashes, req.chain.num_units * u
    lo = max(start, req.dense_from)
    return [
        c
        for c in range(lo // M * M + M, end + 1, M)
        if c not in planned and not (c <= nu and hashes[c // u] in keys)
    ]


def step_saves(
    geo: Geometry,
    req: RequestState,
    start: int,
    end: int,
    planned: Mapping[int, SavePurpose],
) -> list[tuple[int, SavePurpose, bool]]:
    """One group's saves of a step [start, end), in pop order: (position, purpose, planned).

    Rolling saves are the unit boundaries of the step's last κ + 1 units (every boundary of a
    decode step); planned positions inside the step are added. Pop order is by purpose, then
    position, so a pool that runs dry skips the least useful saves.
    """
    u = geo.hash_unit
    decode = start >= len(req.tokens) - 1 and start > 0
    if decode and end // u == start // u:
        return []  # most decode steps: no unit boundary, so nothing planned either (I14)
    floor = start + 1 if decode else max(start + 1, end // u * u - geo.kappa * u)
    chosen: dict[int, SavePurpose] = {
        c: SavePurpose.ROLLING for c in range(-(-floor // u) * u, end + 1, u) if c > start
    }
    # planned positions are unit boundaries (I14): look up the step's few boundaries rather
    # than walk every position a dense geometry has planned
    for c in range(start // u * u + u, end + 1, u):
        why = planned.get(c)
        if why is not None and c not in chosen:
            chosen[c] = why
    return sorted(
        ((c, why, c in planned) for c, why in chosen.items()), key=lambda t: (_RANK[t[1]], t[0])
    )


def save_positions(
    geo: Geometry, req: RequestState, planned: Mapping[int, Mapping[int, SavePurpose]], after: int
) -> list[int]:
    """Positions above `after` where the request still wants a state, ascending.

    A scheduler ends prefill chunks there, so that states land where they are planned: the
    planned positions, the dense multiples of M still ahead, and the last κ + 1 unit boundaries
    of the known tokens (the rolling states a finish publishes).
    """
    if not geo.caching_enabled or not geo.recurrent:
        return []
    u, num = geo.hash_unit, len(req.tokens)
    want: set[int] = set()
    for g in geo.recurrent:
        want.update(c for c in planned.get(g.group_id, {}) if c > after)
        if geo.dense_retention:
            M = g.page_size
            lo = max(after, req.dense_from if req.phase is Phase.RUNNING else num)
            want.update(range(lo // M * M + M, num + 1, M))
    top = num // u * u
    want.update(c for c in (top - geo.kappa * u, top) if c > 0 and c > after)
    return sorted(want)


def next_save_position(
    geo: Geometry, req: RequestState, planned: Mapping[int, Mapping[int, SavePurpose]], after: int
) -> int | None:
    """`save_positions(...)[0]` (None for none), without listing the rest: a scheduler asks
    for it at every prefill chunk, and a dense geometry plans hundreds of positions ahead."""
    if not geo.caching_enabled or not geo.recurrent:
        return None
    u, num = geo.hash_unit, len(req.tokens)
    top = num // u * u
    found = [c for c in (top - geo.kappa * u, top) if c > 0 and c > after]
    if geo.dense_retention:
        lo = max(after, req.dense_from if req.phase is Phase.RUNNING else num)
        for g in geo.recurrent:
            M = g.page_size
            if lo // M * M + M <= num:
                found.append(lo // M * M + M)
    bound = min(found) if found else None
    for g in geo.recurrent:
        mine = planned.get(g.group_id)
        if not mine:
            continue
        if bound is not None and (bound - after) // u < len(mine):
            # fewer unit boundaries below the bound than planned positions (I14: planned
            # positions are boundaries): look those up
            below = range(after // u * u + u, bound, u)
            first = next((c for c in below if c in mine), None)
        else:
            first = min(filter(after.__lt__, mine), default=None)
        if first is not None and (bound is None or first < bound):
            bound = first
    return bound
