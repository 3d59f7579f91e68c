"""Sliding-window attention (spec §7.3): the token at x attends to [x − W + 1, x].

    accepts x  ⇔  page p(x) has an entry at some b ≥ x, and every page of [x − W + 1, x) below
                  p(x) is complete

Pages that leave every later token's window are freed at commit (10.5); a hit needs no page
below ⌊(h − W + 1)/B⌋ (those slots are NULL).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from kvreuse.core.errors import ConfigError
from kvreuse.core.kinds.base import Probe, Stage
from kvreuse.core.kinds.paged import PagedGroup, WindowProbe


@dataclass(frozen=True, slots=True, kw_only=True)
class SlidingWindow(PagedGroup):
    kind = "sliding"
    params = ("window",)
    stage = Stage.WINDOW
    frees_pages = True
    wire_kind = "sliding_window"

    @classmethod
    def check_param(cls, name: str, value: Any, page: int, where: str) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 2:
            raise ConfigError(f"{where} needs window ≥ 2 (got {value!r}); set e.g. window=4096")

    def attend_from(self, x: int) -> int:
        """x − W + 1, not below 0."""
        return max(0, x - self.window + 1)  # type: ignore[operator]  # set by V3

    def reach(self) -> int:
        return self.window  # type: ignore[return-value]  # set by V3

    def free_marks(self) -> tuple[tuple[int, int], ...]:
        """Page p leaves every later window once x − W + 1 reaches (p + 1)·B: x ≡ W − 1 mod B."""
        return ((self.page_size, (self.window - 1) % self.page_size),)  # type: ignore[operator]

    def probe(self, keys: Container[bytes], hashes: list[bytes], u: int, nu: int) -> Probe:
        return SlidingProbe(self, keys, hashes, u, nu)


class SlidingProbe(WindowProbe):
    """`WindowProbe`, with m_g(c) found a page at a time instead of a unit at a time."""

    __slots__ = ()

    def largest(self, c: int, margin: bool) -> int:
        if margin or c % self.u:
            return super().largest(c, margin)
        return self._largest_window(c)

    def _largest_window(self, c: int) -> int:
        """Within x's page, ok(x) needs an entry at some boundary in [x, page end] and complete
        pages back to the window's start. The best x ≤ c of page p is min(c, top entry of p);
        if the window test fails there it fails for every lower x of that page too (a lower x
        reaches further back), so the search moves on to page p − 1.
        """
        B, u, flags = self.g.page_size, self.u, self.flags
        x = min(c, self.nu)
        while x > 0:
            p = (x - 1) // B
            first = p * B // u  # flags[first:] are the boundaries of page p
            seg = flags[first : min((p + 1) * B, self.nu) // u]
            if True in seg:
                top = (first + len(seg) - seg[::-1].index(True)) * u
                y = min(x, top)
                if self.ok(y):
                    return y
            x = p * B
        return 0
