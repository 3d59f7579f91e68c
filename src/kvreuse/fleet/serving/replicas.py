"""Local `kvreuse serve` replicas as child processes (`kvreuse fleet`).

Each replica is `python -m kvreuse serve --host 127.0.0.1 --port 0 …` with KV events on
127.0.0.1: its publisher connects to the events endpoint the front has bound (vLLM's rule: a
specific address connects), and its replay socket binds a free port. The replica prints what it
opened; `ReplicaProcess` reads its HTTP URL and replay endpoint from those lines, so no port is
guessed and none can be taken by someone else in between.

Lifetime: a replica dies with the front. It is stopped with SIGTERM (its graceful drain), then
SIGKILL after `stop_timeout`; on Linux it also gets SIGTERM from the kernel when the front dies
without stopping it (PR_SET_PDEATHSIG), so even a killed front leaves no orphan. It runs in a
process group of its own, so a signal meant for the front's group (Ctrl-C) is the front's to
pass on, once it has stopped serving. A replica that exits by itself (or is killed) is reaped
as soon as its output ends, and says so in a line `[replica-i] exited (exit code N)`: no zombie
waits for the front to exit. Whoever `watch`es the replica is told of that exit
(kvreuse.fleet.serving.supervise restarts it: `start` again).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

import httpx

# What `kvreuse serve` prints once its sockets are open (kvreuse.cli, kvreuse.events.options).
_URL_LINE = re.compile(r"^kvreuse serve: .* on (http://\S+)/v1$")
_EVENTS_LINE = re.compile(r"^kvreuse serve: KV events \(\w+\) on (\S+), replay on (\S+)$")
# The front's health checks, as a replica's access log shows them: not echoed (one per replica
# every few seconds would drown the rest).
_HEALTH_LINE = re.compile(r'"GET /health HTTP/[\d.]+" 200')
_PR_SET_PDEATHSIG = 1


class ReplicaError(RuntimeError):
    """A replica did not start, or stopped; the message names it and says why."""


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Ask the kernel for SIGTERM when the process that started us dies (Linux only)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ReplicaProcess:
    """One `kvreuse serve` child: started by `start`, ready after `wait_ready`, ended by `stop`.

    `events_endpoint` is where its publisher connects (the front's subscriber binds it), or a
    wildcard it binds; `replay_endpoint` is where its replay socket binds (`:0`: a free port).
    `url`, `events_bound` and `replay_bound` are what it opened.
    Its output goes to `echo` (default: the front's stderr) prefixed with `[name]`, once the
    start-up lines have been read; the last lines are kept for error messages. `start` may be
    called again once the process has exited: a new process, the same sockets asked for."""

    def __init__(
        self,
        name: str,
        events_endpoint: str,
        serve_args: Sequence[str] = (),
        *,
        replay_endpoint: str = "tcp://127.0.0.1:0",
        echo: TextIO | None = None,
        quiet: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.env = dict(env or {})  # added to the front's environment (a key, never an argv)
        self.events_endpoint = events_endpoint
        self.replay_request = replay_endpoint
        self.serve_args = list(serve_args)
        self.echo = echo
        self.quiet = quiet
        self.url: str | None = None
        self.events_bound: str | None = None
        self.replay_endpoint: str | None = None
        self.proc: subprocess.Popen[str] | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self._opened = threading.Event()
        self._ended = False
        self._stopping = False
        self._reader: threading.Thread | None = None
        self._exit_lock = threading.Lock()  # an exit and `watch` see each other exactly once
        self._exit_code: int | None = None
        self._on_exit: Callable[[ReplicaProcess, int], None] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "kvreuse",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--kv-events-endpoint",
            self.events_endpoint,
            "--kv-events-replay-endpoint",
            self.replay_request,
            *self.serve_args,
        ]

    def start(self) -> None:
        """Start the process (from a thread that lives as long as the front: the death signal
        follows the thread that started the child)."""
        if self._reader is not None:
            self._reader.join(2.0)  # the last process's output is read to its end
        self.url = self.events_bound = self.replay_endpoint = None
        self._opened, self._ended, self._stopping = threading.Event(), False, False
        with self._exit_lock:
            self._exit_code = None
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=env,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            # its own process group: a signal to the front's group (Ctrl-C in a terminal,
            # `timeout`) reaches the front, which stops its replicas itself; one that reached
            # them too would look like exits to restart
            process_group=0,
        )
        reader = threading.Thread(
            target=self._read, args=(self.proc, self._opened), name=f"{self.name}-out", daemon=True
        )
        self._reader = reader
        reader.start()

    def _read(self, proc: subprocess.Popen[str], opened: threading.Event) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            self.tail.append(line)
            if not opened.is_set():
                if (m := _URL_LINE.match(line)) is not None:
                    self.url = m.group(1)
                elif (m := _EVENTS_LINE.match(line)) is not None:
                    self.events_bound, self.replay_endpoint = m.group(1), m.group(2)
                if self.url is not None and self.replay_endpoint is not None:
                    opened.set()
            if not _HEALTH_LINE.search(line):
                self._echo(line)
        self._ended = True
        opened.set()  # the process ended: whoever waits must look at it
        code = proc.wait()  # its output ends as it exits: reap it now, not at the front's end
        with contextlib.suppress(OSError):
            proc.stdout.close()  # a restart opens another pipe: this one is done
        with self._exit_lock:
            self._exit_code = code
            notify = None if self._stopping else self._on_exit
        if not self._stopping:
            self._echo(f"exited (exit code {code})")
        if notify is not None:
            notify(self, code)

    def watch(self, on_exit: Callable[[ReplicaProcess, int], None]) -> None:
        """Call `on_exit(self, exit code)` (from the output reader's thread) whenever a process
        of this replica exits unasked (not by `terminate` or `stop`), at once if the current
        one already has."""
        with self._exit_lock:
            self._on_exit = on_exit
            code = None if self._stopping else self._exit_code
        if code is not None:
            on_exit(self, code)

    def _echo(self, line: str) -> None:
        if not self.quiet:
            with contextlib.suppress(ValueError, OSError):  # the front's stream closed
                print(f"[{self.name}] {line}", file=self.echo or sys.stderr, flush=True)

    def wait_ready(self, deadline: float) -> None:
        """Wait until the replica has opened its sockets and `/health` answers 200 (before the
        monotonic `deadline`); ReplicaError naming the cause otherwise."""
        assert self.proc is not None
        self._opened.wait(max(0.0, deadline - time.monotonic()))
        if self.url is None or self.replay_endpoint is None:
            if self._ended:  # its output ended: it is exiting
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(5.0)
                self._fail("exited")
            self._fail("did not open its sockets in time")
        with httpx.Client(timeout=2.0) as client:
            while True:
                if self.proc.poll() is not None:
                    self._fail("exited")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    self._fail("did not become healthy in time")
                time.sleep(0.05)

    def _fail(self, what: str) -> None:
        assert self.proc is not None
        code = self.proc.poll()
        if code is not None and self._reader is not None:
            self._reader.join(1.0)  # its last words
        status = "" if code is None else f" (exit code {code})"
        last = next((line for line in reversed(self.tail) if line.strip()), "no output")
        raise ReplicaError(f"replica {self.name} {what}{status}: {last}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, if it runs (a process that never became ready); its exit is reported."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    def terminate(self) -> None:
        """SIGTERM, if it runs: the replica drains and exits."""
        self._stopping = True
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (the replica drains), then SIGKILL after `timeout` seconds."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            self.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._reader is not None:
            self._reader.join(2.0)
        if proc.stdout is not None and (self._reader is None or not self._reader.is_alive()):
            proc.stdout.close()


class LocalFleet:
    """N replica processes started together; `stop` ends every one of them."""

    def __init__(self, replicas: Sequence[ReplicaProcess]) -> None:
        self.replicas = list(replicas)

    def start(self, timeout: float = 120.0) -> None:
        """Start all (in parallel) and wait until every one is healthy; on any failure stop
        them all and raise ReplicaError."""
        deadline = time.monotonic() + timeout
        try:
            for replica in self.replicas:
                replica.start()
            for replica in self.replicas:
                replica.wait_ready(deadline)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 10.0) -> None:
        for replica in self.replicas:  # every one drains at once
            replica.terminate()
        for replica in self.replicas:
            replica.stop(timeout)
