"""Group kinds: one module per kind, found through one map.

    module       kind          layout   stage    what is its own
    full.py      "full"        paged    FULL     the covering rule (FullProbe), DCP sharding
    sliding.py   "sliding"     paged    WINDOW   window W, the page-at-a-time descent
    chunked.py   "chunked"     paged    WINDOW   chunk C, the chunk-start rule
    recurrent.py "recurrent"   state    STATE    scratch blocks, V5 and V6
    paged.py     the paged layout (PagedGroup, WindowProbe): attend_from decides the rest
    base.py      GroupGeometry, what every kind declares; Probe; Stage
    entries.py   EntryKind: what one index entry proves (full, partial, state)

`KINDS` maps a GroupSpec's `kind` to the class that resolves it: config validates and builds
groups through it, and the coordinator, the oracle, the events, the scheduler and the engine
ask the group (its class attributes and methods), never its name. A new kind is a subclass of
`PagedGroup` (or of `StateGroup`, kinds.recurrent) registered with `register_kind`; a module
of the package registers itself below, one defined elsewhere (a test's) calls it at run time
(docs/architecture.md, "Add a group kind").
"""

from __future__ import annotations

from kvreuse.core.kinds.base import GroupGeometry, PlainAsk, Probe, Stage
from kvreuse.core.kinds.chunked import ChunkedLocal
from kvreuse.core.kinds.entries import EntryKind, count_entry_kinds, entry_kind
from kvreuse.core.kinds.full import FullAttention
from kvreuse.core.kinds.paged import PagedGroup, WindowProbe
from kvreuse.core.kinds.recurrent import Recurrent, StateGroup
from kvreuse.core.kinds.sliding import SlidingWindow

KINDS: dict[str, type[GroupGeometry]] = {}


def register_kind(cls: type[GroupGeometry]) -> type[GroupGeometry]:
    """Make `cls` the kind named `cls.kind` (usable as a class decorator)."""
    name = getattr(cls, "kind", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__} must name its kind: set the class attribute `kind`")
    if not issubclass(cls, PagedGroup | StateGroup):
        raise TypeError(f"kind {name!r}: {cls.__name__} must subclass PagedGroup or StateGroup")
    if name in KINDS and KINDS[name] is not cls:
        raise ValueError(f"kind {name!r} is already registered ({KINDS[name].__name__})")
    KINDS[name] = cls
    return cls


def unregister_kind(name: str) -> None:
    """Forget a kind registered at run time (the built-in ones stay)."""
    if name in BUILT_IN:
        raise ValueError(f"kind {name!r} is built in; it cannot be unregistered")
    KINDS.pop(name, None)


for _cls in (FullAttention, SlidingWindow, ChunkedLocal, Recurrent):
    register_kind(_cls)
BUILT_IN: tuple[str, ...] = tuple(KINDS)  # in the order "allowed kinds" lists them

__all__ = [
    "BUILT_IN",
    "KINDS",
    "ChunkedLocal",
    "EntryKind",
    "FullAttention",
    "GroupGeometry",
    "PagedGroup",
    "PlainAsk",
    "Probe",
    "Recurrent",
    "SlidingWindow",
    "Stage",
    "StateGroup",
    "WindowProbe",
    "count_entry_kinds",
    "entry_kind",
    "register_kind",
    "unregister_kind",
]
