"""What every group kind provides: a resolved group geometry whose class is the kind.

A kind is a frozen subclass of `GroupGeometry` registered under its name (`kvreuse.core.kinds`).
The instance holds one group's numbers (its page size after DCP scaling, window, chunk, role);
the class holds the kind's rules, so code outside the kinds asks the group and never its name:

    question                                  asked as                    answered by
    which parameters does the kind take?      `params`, `check_param`     config validation
    which bound of spec §12.3 does it join?   `stage`                     lookup, the oracle
    does a hit of x tokens pass? (fast)       `probe(...)`                lookup
    does a hit of x tokens pass? (plain)      `accepts_plain(ask, x)`     the oracle
    which blocks does it hold?                `blocks_held`, `admission_blocks`, …
    how do its entries read in events?        `wire_kind`, `entry_page`,  events, the pool
                                              `run_page`

Every kind picks one of two storage layouts (`is_attention`): pages of KV that grow with the
tokens (`PagedGroup`, kinds.paged) or a fixed set of recurrent states (`StateGroup`,
kinds.recurrent). Allocation, commit and release are written once per layout.

This module imports nothing from the package but the errors, so every core module may use it.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar, Protocol

from kvreuse.core.errors import ConfigError


class Stage(IntEnum):
    """The bound of spec §12.3 whose fixed point first includes a kind's groups.

    FULL groups are downward-closed (they accept every x up to a limit of their own, `F`): A1
    is their minimum, A2 adds the drop margin. WINDOW groups join at A3, STATE groups at A4;
    the reason codes `window_limited` and `recurrent_limited` name the bound that fell."""

    FULL = 1
    WINDOW = 3
    STATE = 4


def check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be ≥ {minimum}, got {value}")


class PlainAsk(Protocol):
    """What a kind's plain rule (`accepts_plain`) reads: the oracle's predicates of spec 15.2
    for one group and one request."""

    u: int

    def has(self, b: int) -> bool:
        """An entry of the request's own chain at boundary b."""
        ...

    def covered(self, x: int, lo: int) -> bool:
        """Full keys on the pages of [lo, x) below p(x), and an entry at some b ≥ x in p(x)."""
        ...


class Probe:
    """Acceptance of one group for one request over one key set (the index, maybe plus the
    pending keys). Subclasses hold one kind's rule; this base adds the drop-mode margin and
    the generic descent."""

    __slots__ = ("g", "hashes", "keys", "nu", "u")
    F = 0  # a FULL-stage kind's covering limit (FullProbe sets it)

    def __init__(
        self, g: GroupGeometry, keys: Container[bytes], hashes: list[bytes], u: int, nu: int
    ) -> None:
        self.g, self.u, self.nu = g, u, nu
        self.keys, self.hashes = keys, hashes

    def ok(self, x: int) -> bool:
        """Whether the group accepts a hit of x tokens (x a multiple of u)."""
        raise NotImplementedError

    def accepts(self, x: int, margin: bool) -> bool:
        if margin and x > 0:
            # Drop-mode margin (7.6). For sliding/chunked drafters we also require x itself:
            # unlike full attention they are not downward-closed (docs/decisions.md, D2).
            return x + self.u <= self.nu and self.ok(x + self.u) and self.ok(x)
        return self.ok(x)

    def decisive(self) -> Sequence[bytes]:
        """The keys whose membership could change this probe's answers: a key set that adds
        none of them (the pending keys of other plans, say) answers exactly as `keys` does."""
        return self.hashes

    def largest(self, c: int, margin: bool) -> int:
        """m_g(c): the largest candidate ≤ c this group accepts (a descent of one unit a step;
        subclasses answer the common cases faster)."""
        x = c
        while x > 0 and not self.accepts(x, margin):
            x -= self.u
        return x


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupGeometry:
    """A group resolved against the configuration: `page_size` is B_g after DCP scaling.

    Subclasses are the kinds; the class attributes below are what each one declares."""

    group_id: int
    block_size: int
    page_size: int
    sharded: bool
    window: int | None
    chunk: int | None
    role: str
    cacheable: bool
    scratch: int

    kind: ClassVar[str]  # the name a GroupSpec gives (and metrics, events and exports show)
    params: ClassVar[tuple[str, ...]] = ()  # the GroupSpec parameters of this kind
    is_attention: ClassVar[bool]  # the layout: pages of KV (True) or recurrent states
    stage: ClassVar[Stage]
    shardable: ClassVar[bool] = False  # may be DCP-sharded (and is, unless told otherwise)
    frees_pages: ClassVar[bool] = False  # a commit frees pages no later token attends to
    fresh_starts: ClassVar[bool] = False  # `starts_fresh(x)` holds for some x > 0
    wire_kind: ClassVar[str]  # vLLM's KVCacheSpecKind for events

    # ------------------------------------------------------------------ configuration
    @classmethod
    def check_param(cls, name: str, value: Any, page: int, where: str) -> None:
        """Validate this kind's own GroupSpec parameter `name` (V3); raise ConfigError."""

    @classmethod
    def check_spec(cls, role: str, cacheable: bool, where: str) -> None:
        """The kind's rules on the role and prefix_cacheable flags (V5, V6)."""

    # ------------------------------------------------------------------ arithmetic
    @property
    def is_draft(self) -> bool:
        return self.role == "draft"

    def attend_from(self, x: int) -> int:
        """The first position the token at `x` attends to in this group."""
        return 0

    def starts_fresh(self, x: int) -> bool:
        """Whether the token at `x` attends to nothing before x, so a hit of x needs nothing
        of this group (only a FRESH_STARTS kind says yes for x > 0)."""
        return x == 0

    @property
    def entry_page(self) -> int:
        """The page `entry_kind` reads this group's entries by (0: every entry is a state)."""
        raise NotImplementedError

    @property
    def run_page(self) -> int:
        """The page that joins this group's published entries into BlockStored runs (0: runs
        of consecutive boundaries, as attention publishes them)."""
        raise NotImplementedError

    def needed_from(self, hit: int) -> int:
        """The first page a request resuming at `hit` needs (the paged layout's)."""
        raise NotImplementedError

    def reach(self) -> int:
        """Tokens the kind's attention reaches back (0: everything, or no attention)."""
        return 0

    def free_marks(self) -> tuple[tuple[int, int], ...]:
        """(modulus, residue) pairs: a commit up to a position T′ ≡ residue (mod modulus) may
        free a page of this group (`frees_pages` kinds; none otherwise). The scheduler's
        fast-forward treats such a step as one where something happens."""
        return ()

    def blocks_held(self, num_tokens: int, kappa: int) -> int:
        """An upper bound of the blocks a request of `num_tokens` slots holds in this group
        (save blocks excluded)."""
        raise NotImplementedError

    def admission_blocks(self, hit: int, top: int) -> int:
        """The fresh blocks an admission with hit `hit` pops to cover [0, top) (9.5)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ acceptance
    def probe(self, keys: Container[bytes], hashes: list[bytes], u: int, nu: int) -> Probe:
        """The fast acceptance test of this group for one request's chain over `keys`."""
        raise NotImplementedError

    def accepts_plain(self, ask: PlainAsk, x: int) -> bool:
        """The kind's rule as the spec writes it (x > 0, no drop margin): the oracle's."""
        raise NotImplementedError

    def describe(self) -> str:
        if self.sharded and self.page_size != self.block_size:
            size = f"{self.block_size} × dcp {self.page_size // self.block_size} = {self.page_size}"
        else:
            size = str(self.page_size)
        return f"group {self.group_id} ({self.kind}, {size} tokens)"
