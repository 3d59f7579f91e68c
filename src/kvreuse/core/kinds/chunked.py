"""Chunked local attention (spec §7.4): the token at x attends to its chunk, [⌊x/C⌋·C, x].

    accepts x  ⇔  a chunk starts at x (nothing before x is attended to), or
                  page p(x) has an entry at some b ≥ x and every page of [⌊x/C⌋·C, x) below
                  p(x) is complete

The chunk-start rule is stated here once (`starts_fresh`): acceptance, the pages a hit needs
and routable mode's judgement all ask it. C is a multiple of the page (V3), so every chunk
starts at a page start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvreuse.core.errors import ConfigError
from kvreuse.core.kinds.base import Stage
from kvreuse.core.kinds.paged import PagedGroup


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkedLocal(PagedGroup):
    kind = "chunked"
    params = ("chunk",)
    stage = Stage.WINDOW
    frees_pages = True
    fresh_starts = True
    wire_kind = "chunked_local_attention"

    @classmethod
    def check_param(cls, name: str, value: Any, page: int, where: str) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value % page:
            raise ConfigError(
                f"{where}: chunk must be a positive multiple of its page of {page} tokens "
                f"(got {value!r}), so that every chunk starts at a page start; "
                f"e.g. chunk={page * 4}"
            )

    def attend_from(self, x: int) -> int:
        """The chunk start ⌊x/C⌋·C."""
        return x // self.chunk * self.chunk  # type: ignore[operator]  # set by V3

    def starts_fresh(self, x: int) -> bool:
        """The chunk-start rule: a chunk starts at x, so the token at x attends to nothing
        before it and a hit of x needs no page of this group."""
        return x % self.chunk == 0  # type: ignore[operator]  # set by V3

    def reach(self) -> int:
        return self.chunk  # type: ignore[return-value]  # set by V3

    def free_marks(self) -> tuple[tuple[int, int], ...]:
        """A chunk's pages are freed once a new chunk starts: x ≡ 0 mod C (a page start)."""
        return ((self.chunk, 0),)  # type: ignore[return-value]  # set by V3
