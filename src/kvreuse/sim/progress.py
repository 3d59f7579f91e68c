"""Progress on stderr for the long phases of `kvreuse simulate` and `kvreuse sweep`: a bar
(tqdm, from the `sim` extra) when stderr is a terminal, else a plain line every `interval`
seconds once a phase has run that long, so a run whose stderr goes to a log or a pipe is not
silent for minutes and a short one prints nothing. `--quiet` turns both off."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.util import find_spec

OnProgress = Callable[[int, int], None]  # (done, total)
INTERVAL_S = 30.0  # between plain lines


class Progress:
    def __init__(
        self,
        enabled: bool,
        prog: str = "kvreuse",
        interval: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.enabled = enabled
        self.bars = enabled and sys.stderr.isatty() and find_spec("tqdm") is not None
        self.prog = prog
        self.interval = interval
        self.clock = clock

    @contextmanager
    def phase(self, desc: str, total: int, unit: str) -> Iterator[OnProgress | None]:
        """One phase: the callback that reports it (None when progress is off)."""
        if not self.enabled:
            yield None
        elif self.bars:
            with self._bar(desc, total, unit) as update:
                yield update
        else:
            yield self._lines(desc, unit)

    @contextmanager
    def _bar(self, desc: str, total: int, unit: str) -> Iterator[OnProgress]:
        from tqdm import tqdm

        bar = tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, unit_scale=False)

        def update_to(done: int, _total: int) -> None:
            bar.update(done - bar.n)

        try:
            yield update_to
        finally:
            bar.close()

    def _lines(self, desc: str, unit: str) -> OnProgress:
        start = self.clock()
        due = [start + self.interval]

        def report(done: int, total: int) -> None:
            now = self.clock()
            if now < due[0]:
                return
            due[0] = now + self.interval
            print(
                f"{self.prog}: {desc}: {done:,} of {total:,} {unit} ({now - start:,.0f} s)",
                file=sys.stderr,
                flush=True,
            )

        return report
