"""The state layout and the recurrent kind (spec §7.5): a state saved at exactly x.

    accepts x  ⇔  a state of this group's chain at x is in the index

A recurrent group holds no pages: each running request keeps a `live` state block, its
`scratch` blocks and up to κ + 1 `held` rolling states; which positions get a saved state is
kvreuse.core.savepoints'. A recurrent state depends on every earlier position, so the group
must be a prefix-cacheable target (V5, V6).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Container
from dataclasses import dataclass
from itertools import compress
from typing import Any

from kvreuse.core.errors import ConfigError
from kvreuse.core.kinds.base import GroupGeometry, PlainAsk, Probe, Stage, check_int


@dataclass(frozen=True, slots=True, kw_only=True)
class StateGroup(GroupGeometry):
    """A kind of the state layout: fixed blocks per request, states saved at unit boundaries."""

    is_attention = False
    stage = Stage.STATE

    @property
    def entry_page(self) -> int:
        return 0  # every entry is a state

    @property
    def run_page(self) -> int:
        return self.page_size

    def blocks_held(self, num_tokens: int, kappa: int) -> int:
        return 2 + self.scratch + kappa  # live, scratch, held rolling states (κ + 1)

    def admission_blocks(self, hit: int, top: int) -> int:
        return 1 + self.scratch  # live and scratch

    def probe(self, keys: Container[bytes], hashes: list[bytes], u: int, nu: int) -> Probe:
        return StateProbe(self, keys, hashes, u, nu)

    def accepts_plain(self, ask: PlainAsk, x: int) -> bool:
        return ask.has(x)


@dataclass(frozen=True, slots=True, kw_only=True)
class Recurrent(StateGroup):
    kind = "recurrent"
    params = ("state_scratch_blocks",)
    wire_kind = "mamba"

    @classmethod
    def check_param(cls, name: str, value: Any, page: int, where: str) -> None:
        check_int(f"{where}: state_scratch_blocks", value, 0)

    @classmethod
    def check_spec(cls, role: str, cacheable: bool, where: str) -> None:
        if role == "draft":  # V5
            raise ConfigError(f"{where} has role 'draft'; a recurrent group must be a target")
        if not cacheable:  # V6
            raise ConfigError(
                f"{where} has prefix_cacheable=False: a recurrent state depends on every earlier "
                "position and cannot start at a hit; to turn caching off set "
                "enable_prefix_caching=False"
            )


class StateProbe(Probe):
    """A state saved at exactly x."""

    __slots__ = ("_present",)

    def __init__(
        self, g: GroupGeometry, keys: Container[bytes], hashes: list[bytes], u: int, nu: int
    ) -> None:
        super().__init__(g, keys, hashes, u, nu)
        self._present: list[int] | None = None  # units with a state, found on first use

    def ok(self, x: int) -> bool:
        return x == 0 or (x <= self.nu and self.hashes[x // self.u] in self.keys)

    def largest(self, c: int, margin: bool) -> int:
        if margin or c % self.u:
            return super().largest(c, margin)
        return self._largest_state(c)

    def _largest_state(self, c: int) -> int:
        """The largest x ≤ c with a state in `keys`, by bisection over the units that have one
        (found once per probe, in C), instead of a descent of one unit per step."""
        if self._present is None:
            n = self.nu // self.u
            flags = map(self.keys.__contains__, self.hashes[1 : n + 1])
            self._present = list(compress(range(1, n + 1), flags))
        i = bisect_right(self._present, c // self.u)
        return self._present[i - 1] * self.u if i else 0
