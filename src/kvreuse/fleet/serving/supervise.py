"""`kvreuse fleet` supervises its replica processes: one that exits is started again.

A replica whose process exits unasked (it crashed, was killed, its store failed) is out of
rotation at once (`Dispatcher.process_exited`: state `restarting`, which no health check
ends), and is started again after a backoff: 0.5 s, doubling with every try still inside the
window, up to 8 s. At most `tries` restarts within `window` seconds (`RestartPolicy`, the
options `--restart-tries` and `--restart-window`); an exit past that gives the replica up
(state `given-up`) and the fleet goes on without it. `tries` 0: no restarts.

A new process holds nothing and numbers its KV event batches from 0: once it answers its
health check, the front empties its mirror, follows it from its first batch through the new
replay socket, and routes to it again (`Dispatcher.restarted`). Its publisher connects to the
same event socket the front bound for the replica, with the same CURVE key.

Every exit, restart and give-up is one line on stderr, naming the replica, how it ended and the
try:

    kvreuse fleet: replica-1 exited (signal 9, SIGKILL); restart try 1 of 5 in 0.5 s
    kvreuse fleet: replica-1 restart try 1 of 5 (after signal 9, SIGKILL): started, pid 4242
    kvreuse fleet: replica-1 is back (restart try 1 of 5): on http://127.0.0.1:40411
    kvreuse fleet: replica-1 exited (exit code 1) after 5 restart tries within 60 s: given up

Threads: a replica's output reader reports its exit; the supervisor's own thread takes every
decision in order (an exit, a restart that is due, a new process that is ready) and starts the
new processes: it lives as long as the fleet, because on Linux a child's death signal
(PR_SET_PDEATHSIG) follows the thread that started it. A short-lived thread per restart waits
for the new process to be ready.

This module imports nothing but the standard library when loaded (the command line's parser
reads the policy's defaults, and must build without the fleet's extras).
"""

from __future__ import annotations

import collections
import functools
import math
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvreuse.fleet.serving.dispatch import Dispatcher
    from kvreuse.fleet.serving.members import Member
    from kvreuse.fleet.serving.replicas import ReplicaProcess

FIRST_DELAY_S = 0.5
MAX_DELAY_S = 8.0


@dataclass(frozen=True)
class RestartPolicy:
    """At most `tries` restarts of a replica within `window` seconds, the n-th of them
    `first_delay` · 2ⁿ⁻¹ seconds (at most `max_delay`) after the exit."""

    tries: int = 5
    window: float = 60.0
    first_delay: float = FIRST_DELAY_S
    max_delay: float = MAX_DELAY_S

    def problem(self) -> str | None:
        """What is wrong with the options, in one line; None when nothing is."""
        if self.tries < 0:
            return f"--restart-tries must be a count ≥ 0, got {self.tries}"
        if not (math.isfinite(self.window) and self.window > 0):
            return f"--restart-window must be seconds > 0, got {self.window}"
        return None


class Tries:
    """One replica's restart tries inside the policy's window."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._at: collections.deque[float] = collections.deque()

    def next(self, now: float) -> tuple[int, float] | None:
        """For an exit at `now`: the next try's number within the window and the wait before
        it (the try is counted); None when the window's tries are spent."""
        while self._at and now - self._at[0] >= self.policy.window:
            self._at.popleft()
        if len(self._at) >= self.policy.tries:
            return None
        delay = min(self.policy.max_delay, self.policy.first_delay * 2 ** len(self._at))
        self._at.append(now)
        return len(self._at), delay


def exit_status(code: int) -> str:
    """How a process ended, as a line says it: "exit code 1", "signal 9, SIGKILL"."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {-code}, {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def _say(line: str) -> None:
    # one write, newline included: other threads (the front's log) write to the same stream
    sys.stderr.write(f"kvreuse fleet: {line}\n")
    sys.stderr.flush()


@dataclass(frozen=True)
class _Due:
    """A restart waiting for its time."""

    at: float
    attempt: int
    after: str  # how the last process ended


@dataclass(frozen=True)
class _Exit:
    """A replica's process ended (`how`, as `exit_status` says it)."""

    replica: int
    how: str


@dataclass(frozen=True)
class _Ready:
    """A restarted process answered its health check."""

    replica: int
    attempt: int
    proc: subprocess.Popen[str]


class _Tick:
    """Nothing happened, but time passed: a restart may be due."""


class Supervisor:
    """Restarts the replicas' processes (`replicas[i]` is `members[i]` to `dispatcher`).

    `start` once the fleet is serving; at shutdown `halt` (no process is started after it
    returns), then stop the replicas, then `close` (the supervisor's thread ends last: the
    processes it started get their death signal when it does)."""

    def __init__(
        self,
        replicas: Sequence[ReplicaProcess],
        dispatcher: Dispatcher,
        members: Sequence[Member],
        policy: RestartPolicy,
        *,
        start_timeout: float,
        say: Callable[[str], None] = _say,
    ) -> None:
        self.replicas, self.members = list(replicas), list(members)
        self.dispatcher, self.policy, self.say = dispatcher, policy, say
        self.start_timeout = start_timeout
        self._tries = [Tries(policy) for _ in self.replicas]
        self._due: dict[int, _Due] = {}
        self._inbox: queue.Queue[_Exit | _Ready | None] = queue.Queue()  # None: end the thread
        self._halted = False
        self._starting = threading.Lock()  # `halt` waits for a start under way
        self._thread = threading.Thread(target=self._run, name="fleet-supervisor", daemon=True)

    def start(self) -> None:
        for i, (replica, member) in enumerate(zip(self.replicas, self.members, strict=True)):
            if replica.pid is not None:
                self.dispatcher.process_started(member, replica.pid, restart=False)
            replica.watch(functools.partial(self._exited, i))
        self._thread.start()

    def halt(self) -> None:
        with self._starting:
            self._halted = True

    def close(self) -> None:
        self.halt()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join()

    # ------------------------------------------------------------------ the thread
    def _exited(self, i: int, _: ReplicaProcess, code: int) -> None:
        self._inbox.put(_Exit(i, exit_status(code)))

    def _run(self) -> None:
        """Every decision, in order: exits, new processes ready, restarts that are due."""
        while True:
            first = min((due.at for due in self._due.values()), default=None)
            timeout = None if first is None else max(0.0, first - time.monotonic())
            item: _Exit | _Ready | _Tick | None
            try:
                item = self._inbox.get(timeout=timeout)
            except queue.Empty:
                item = _Tick()
            if item is None:
                return
            if self._halted:
                continue
            if isinstance(item, _Exit):
                self._on_exit(item.replica, item.how)
            elif isinstance(item, _Ready):
                self._on_ready(item)
            self._start_due()

    def _on_exit(self, i: int, how: str) -> None:
        name, member = self.members[i].name, self.members[i]
        step = self._tries[i].next(time.monotonic())
        if step is None:
            self.dispatcher.process_exited(member, f"exited ({how}); given up", given_up=True)
            if self.policy.tries == 0:
                self.say(f"{name} exited ({how}); not restarted (--restart-tries 0)")
            else:
                within = f"{self.policy.tries} restart tries within {self.policy.window:g} s"
                self.say(f"{name} exited ({how}) after {within}: given up")
            return
        attempt, delay = step
        try_text = f"restart try {attempt} of {self.policy.tries}"
        self.dispatcher.process_exited(member, f"exited ({how}); {try_text}", given_up=False)
        self.say(f"{name} exited ({how}); {try_text} in {delay:g} s")
        self._due[i] = _Due(time.monotonic() + delay, attempt, how)

    def _start_due(self) -> None:
        now = time.monotonic()
        for i, due in list(self._due.items()):
            if due.at <= now:
                del self._due[i]
                self._restart(i, due)

    def _restart(self, i: int, due: _Due) -> None:
        replica, member = self.replicas[i], self.members[i]
        try_text = f"restart try {due.attempt} of {self.policy.tries}"
        with self._starting:
            if self._halted:
                return
            try:
                replica.start()
            except OSError as exc:  # no process at all: a failed try like any other
                self.say(f"{member.name} {try_text} (after {due.after}): cannot start: {exc}")
                self._inbox.put(_Exit(i, f"not started: {exc.strerror or exc}"))
                return
        assert replica.proc is not None
        self.dispatcher.process_started(member, replica.proc.pid, restart=True)
        self.say(f"{member.name} {try_text} (after {due.after}): started, pid {replica.pid}")
        waiter = threading.Thread(
            target=self._await_ready,
            args=(i, due.attempt, replica.proc),
            name=f"{member.name}-restart",
            daemon=True,
        )
        waiter.start()

    def _await_ready(self, i: int, attempt: int, proc: subprocess.Popen[str]) -> None:
        """Wait (in a thread of its own) until the new process is ready, then hand it to the
        supervisor's thread; one that is not ready in time is killed: its exit is the failed
        try."""
        from kvreuse.fleet.serving.replicas import ReplicaError

        replica = self.replicas[i]
        try:
            replica.wait_ready(time.monotonic() + self.start_timeout)
        except ReplicaError as exc:
            if replica.proc is proc and replica.alive() and not self._halted:
                self.say(f"{self.members[i].name} restart try {attempt}: {exc}; killed")
                replica.kill()
            return
        self._inbox.put(_Ready(i, attempt, proc))

    def _on_ready(self, ready: _Ready) -> None:
        attempt = ready.attempt
        replica, member = self.replicas[ready.replica], self.members[ready.replica]
        if replica.proc is not ready.proc or not replica.alive():
            return  # it exited meanwhile: that exit is in the inbox
        assert replica.url is not None and replica.replay_endpoint is not None
        try:
            self.dispatcher.restarted(member, replica.url, replica.replay_endpoint)
        except ValueError as exc:  # a replay endpoint the front cannot dial
            self.say(f"{member.name} restart try {attempt}: {exc}; killed")
            replica.kill()
            return
        try_text = f"restart try {attempt} of {self.policy.tries}"
        self.say(f"{member.name} is back ({try_text}): on {replica.url}")
