"""What an index entry proves: the closed vocabulary shared by the pool, the events and the metrics.

`EntryKind` members are `str` subclasses: they compare, hash and format exactly like the plain
strings ("full", "partial", "state") that metrics, events and exports have always used.
This module imports nothing from the package, so any core module may depend on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum


class EntryKind(StrEnum):
    """What an index entry proves (spec §6): a whole page, part of one, or a recurrent state."""

    FULL = "full"
    PARTIAL = "partial"
    STATE = "state"


# Enum attribute access goes through the enum machinery (~45 ns); entry_kind runs per event entry.
_FULL, _PARTIAL, _STATE = EntryKind.FULL, EntryKind.PARTIAL, EntryKind.STATE


def entry_kind(page_size: int, boundary: int) -> EntryKind:
    """The kind of the entry at `boundary` in a group whose attention page is `page_size`.

    `page_size` 0 means the group keeps recurrent states: every entry is a state. An attention
    entry is full when it ends its page, else partial.
    """
    if not page_size:
        return _STATE
    return _PARTIAL if boundary % page_size else _FULL


def count_entry_kinds(counts: dict[str, int], page_size: int, boundaries: Sequence[int]) -> None:
    """Add the `entry_kind` of each of `boundaries` to `counts`, in one pass.

    Publication counts its entries on every commit; this is `entry_kind` in bulk, without a
    call per entry.
    """
    if not page_size:
        counts[_STATE] += len(boundaries)
        return
    partial = sum(1 for b in boundaries if b % page_size)
    counts[_PARTIAL] += partial
    counts[_FULL] += len(boundaries) - partial
