"""A replica as the front sees it (`Member`): where it is, its state, its load, and the KV
event subscriber that keeps its mirror.

States: `up`; `down` (it failed a health check or could not be reached; a health check brings
it back); and, for a replica process that `kvreuse fleet` supervises
(kvreuse.fleet.serving.supervise), `restarting` (its process exited: out of rotation until the
new one is ready, whatever a health check says) and `given-up`. Only the supervisor moves a
replica out of the last two.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvreuse.events import Subscriber

UP, DOWN, RESTARTING, GIVEN_UP = "up", "down", "restarting", "given-up"
STATES = (UP, DOWN, RESTARTING, GIVEN_UP)
SUPERVISED = (RESTARTING, GIVEN_UP)


@dataclass
class Member:
    """A replica as the front sees it."""

    index: int
    name: str
    url: str
    endpoint: str  # its KV events, as the subscriber opened them (a bound :0 port resolved)
    bind: bool | None
    replay_endpoint: str | None = None
    state: str = UP
    why_down: str = ""
    num_in_flight: int = 0
    tokens_in_flight: int = 0
    finished: int = 0  # requests answered (or failed) so far
    caught_up: int = 0  # `finished` when the last completed replay check began
    catch_up_paused_until: float = 0.0
    curve_public_key: str | None = None
    restarts: int = 0  # processes started again by the supervisor
    pid: int | None = None  # a local replica's process
    subscriber: Subscriber = field(default_factory=Subscriber, repr=False)
    # held while the stream is checked through the replay (a wait on the network)
    checking: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def up(self) -> bool:
        return self.state == UP
