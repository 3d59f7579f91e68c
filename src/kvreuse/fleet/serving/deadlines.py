"""The front's deadlines on its replicas (`Deadlines`); apart from `kvreuse.fleet.serving.forward`
so that the command line can offer them without the server's packages."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Deadlines:
    """How long the front waits on a replica, in seconds (docs/fleet-serving.md).

    `connect`: the TCP connection (failing it, nothing was sent: another replica takes the
    request). `first_byte`: a stream's response headers and first bytes, from the send: the
    queue and the prefill. `stall`: the longest silence between two chunks of a stream (decode
    steps are short). `answer`: a non-streamed answer, whole: its headers come only once it is
    generated, so this bounds a whole generation."""

    connect: float = 5.0
    first_byte: float = 60.0
    stall: float = 30.0
    answer: float = 600.0

    def problem(self) -> str | None:
        """The first deadline that is not a number of seconds > 0, as one line, or None."""
        for name in ("connect", "first_byte", "stall", "answer"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                flag = "--" + name.replace("_", "-") + "-timeout"
                return f"{flag} must be a number of seconds > 0, got {value}"
        return None
