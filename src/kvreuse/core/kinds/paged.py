"""The paged layout: attention kinds keep one block of KV per page of B tokens (spec §7.2–7.4).

A request's table holds one slot per page; a hit of h reuses the pages its next token still
attends to (`needed_from`), copies a partial page p(h) (copy-on-write) and pops the rest:

    pages     0 .. ⌊lo/B⌋−1   ⌊lo/B⌋ .. ⌊h/B⌋−1   p(h) (h mod B ≠ 0)   .. ⌈top/B⌉−1
    slot      NULL            shared hit           fresh + Copy         fresh

A paged kind says where the window of token x starts (`attend_from`) and whether a token
attends to nothing before it (`starts_fresh`); `WindowProbe` and `accepts_plain` derive its
acceptance from those two, so a new window kind usually writes only them.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from kvreuse.core.kinds.base import GroupGeometry, PlainAsk, Probe


@dataclass(frozen=True, slots=True, kw_only=True)
class PagedGroup(GroupGeometry):
    """A kind of the paged layout: pages of KV that grow with the tokens."""

    is_attention = True

    @property
    def entry_page(self) -> int:
        return self.page_size  # full when it ends its page, else partial

    @property
    def run_page(self) -> int:
        return 0

    def needed_from(self, hit: int) -> int:
        """The first page a request resuming at `hit` needs (spec §7.8); pages below it may be
        NULL in its table. A non-cacheable group needs every page, computed again."""
        B = self.page_size
        if not self.cacheable or self.starts_fresh(hit):
            return -(-hit // B)  # nothing before the hit is attended to (or reused)
        return self.attend_from(hit) // B

    def blocks_held(self, num_tokens: int, kappa: int) -> int:
        return -(-num_tokens // self.page_size)

    def admission_blocks(self, hit: int, top: int) -> int:
        """Pages above the hit, and a copy destination for a partial hit page still needed."""
        B = self.page_size
        total = -(-top // B)
        if not self.cacheable:
            return total - hit // B
        copy = 1 if hit % B and self.needed_from(hit) <= hit // B else 0
        return total - (-(-hit // B)) + copy

    def probe(self, keys: Container[bytes], hashes: list[bytes], u: int, nu: int) -> Probe:
        return WindowProbe(self, keys, hashes, u, nu)

    def accepts_plain(self, ask: PlainAsk, x: int) -> bool:
        return self.starts_fresh(x) or ask.covered(x, self.attend_from(x))


class WindowProbe(Probe):
    """A paged kind's acceptance: x's own page has an entry at some boundary ≥ x, and every
    page the window (or chunk) of token x still covers below it is complete."""

    __slots__ = ("flags", "full")

    def __init__(
        self, g: GroupGeometry, keys: Container[bytes], hashes: list[bytes], u: int, nu: int
    ) -> None:
        super().__init__(g, keys, hashes, u, nu)
        B = g.page_size
        # One membership flag per boundary, probed in C:
        #   flags[k - 1]  <=>  the boundary k·u has an entry
        #   full[j]       <=>  page j's last boundary (j + 1)·B has one (page j complete)
        self.flags = list(map(keys.__contains__, hashes[1 : nu // u + 1]))
        self.full = self.flags[B // u - 1 :: B // u]

    def ok(self, x: int) -> bool:
        g = self.g
        if g.starts_fresh(x):
            return True  # x = 0, or (chunked) a chunk starts at x: nothing before it is needed
        lo = g.attend_from(x)
        B, u = g.page_size, self.u
        p = (x - 1) // B
        if x > self.nu:
            return False
        # x's own page holds an entry at some boundary in [x, end of the page]
        if not any(self.flags[-(-x // u) - 1 : min((p + 1) * B, self.nu) // u]):
            return False
        need = p - lo // B  # complete pages below x's page that the window still covers
        return need == 0 or (p >= need and all(self.full[p - need : p]))
