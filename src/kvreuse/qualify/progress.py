"""Progress of `kvreuse qualify` on stderr, one scenario at a time: a live line (rich) on a
terminal, else one line when each scenario starts and ends (logs stay readable)."""

from __future__ import annotations

import sys
import time
from typing import Any


class ScenarioProgress:
    def __init__(self, enabled: bool, live: bool | None = None) -> None:
        """`enabled`: report at all; `live`: a rich line that updates (default: when stderr
        is a terminal)."""
        self.enabled = enabled
        self.live = sys.stderr.isatty() if live is None else live
        self._bar: Any = None
        self._task: Any = None
        self._sent = 0
        self._started = 0.0

    def start(self, name: str) -> None:
        if not self.enabled:
            return
        self._sent, self._started = 0, time.monotonic()
        if not self.live:
            print(f"kvreuse qualify: {name} …", file=sys.stderr, flush=True)
            return
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            TextColumn("{task.completed:,} requests"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
        )
        self._bar.start()
        self._task = self._bar.add_task(name, total=None)

    def sent(self) -> None:
        self._sent += 1
        if self._bar is not None:
            self._bar.advance(self._task)

    def done(self, name: str, status: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, description=f"{name}: {status}")
            self._bar.stop()
            self._bar = None
            return
        seconds = time.monotonic() - self._started
        print(
            f"kvreuse qualify: {name}: {status} ({self._sent:,} requests, {seconds:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
