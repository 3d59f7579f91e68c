"""Run an app with uvicorn: in a background thread (tests, in-process qualify) or in the
foreground (`kvreuse serve`), on sockets bound beforehand (so `--port 0` can report its port and
a busy port is one clear error).

`Server` adds two things to uvicorn's:

* a graceful drain (`kvreuse.serve.lifecycle`) before uvicorn's own shutdown: on SIGTERM it
  stops accepting, lets running requests finish up to `drain_timeout` seconds, then ends every
  open answer with an error (a stream: an error event and `data: [DONE]`);
* an exit code: when the step loop fails beyond recovery the server shuts down by itself and
  `exit_code` is 1, so a supervisor restarts it.
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import uvicorn
from fastapi import FastAPI

from kvreuse.serve import defaults
from kvreuse.serve.lifecycle import Lifecycle

DEFAULT_DRAIN_TIMEOUT = defaults.DRAIN_TIMEOUT_S


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (IPv4 or IPv6 by `host`); OSError when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


class Server(uvicorn.Server):
    """uvicorn's server with a drain before shutdown and an exit code."""

    def __init__(
        self,
        app: FastAPI,
        *,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        log_level: str = "warning",
        access_log: bool = False,
    ) -> None:
        config = uvicorn.Config(
            app,
            log_level=log_level,
            lifespan="on",
            access_log=access_log,
            timeout_graceful_shutdown=10,  # after the drain: answers still being written
        )
        super().__init__(config)
        self.drain_timeout = drain_timeout
        self.life: Lifecycle | None = getattr(app.state, "lifecycle", None)
        self.exit_code = 0
        engine = getattr(app.state, "engine", None)
        if engine is not None:
            engine.on_fatal = self._on_fatal

    def _on_fatal(self, why: str) -> None:
        self.exit_code = 1
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in getattr(self, "servers", []):
            server.close()  # stop accepting before the drain
        if self.life is not None:
            await self.life.drain(self.drain_timeout)
        await super().shutdown(sockets)


def run_server(app: FastAPI, sockets: list[socket.socket], drain_timeout: float) -> int:
    """Serve in the foreground until SIGINT/SIGTERM or a fatal step-loop failure; the exit
    code (0, or 1 after a failure)."""
    server = Server(app, drain_timeout=drain_timeout, log_level="info", access_log=True)
    server.run(sockets=sockets)
    return server.exit_code


class ServerThread:
    """`with ServerThread(app) as url:` serves on 127.0.0.1 on a free port, then shuts down.

    The socket is bound and listening before the thread starts, so the port is known and
    connections made before uvicorn accepts them wait in the backlog instead of failing.
    `extra` sockets (a separate metrics listener) are served too.
    """

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        extra: tuple[socket.socket, ...] = (),
        drain_timeout: float = 5.0,
    ) -> None:
        self.app = app
        self.sock = bind(host, port)
        self.sockets = [self.sock, *extra]
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = Server(app, drain_timeout=drain_timeout)
        self.thread = threading.Thread(target=self._serve, name="kvreuse-uvicorn", daemon=True)
        self.error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _serve(self) -> None:
        try:
            self.server.run(sockets=self.sockets)
        except BaseException as exc:  # reported by __enter__ / stop
            self.error = exc

    def start(self, timeout: float = 60.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:  # waits for the lifespan startup (the step loop)
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start: {self.error!r}")
            time.sleep(0.01)
        return self.url

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join()
        for sock in self.sockets:
            sock.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
