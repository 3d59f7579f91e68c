"""Progress bars on stderr for the long phases of `kvreuse simulate` (tqdm, from the `sim`
extra). Without tqdm, or when stderr is not a terminal, or with --quiet, there are none."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.util import find_spec

OnProgress = Callable[[int, int], None]  # (done, total)


class Progress:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and find_spec("tqdm") is not None

    @contextmanager
    def phase(self, desc: str, total: int, unit: str) -> Iterator[OnProgress | None]:
        """A bar for one phase: the callback that moves it (None when bars are off)."""
        if not self.enabled:
            yield None
            return
        from tqdm import tqdm

        bar = tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, unit_scale=False)

        def update_to(done: int, _total: int) -> None:
            bar.update(done - bar.n)

        try:
            yield update_to
        finally:
            bar.close()
