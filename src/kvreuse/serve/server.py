"""Run an app with uvicorn: in a background thread (tests, in-process qualify) or in the
foreground (`kvreuse serve`)."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import uvicorn
from fastapi import FastAPI


class ServerThread:
    """`with ServerThread(app) as url:` serves on 127.0.0.1 on a free port, then shuts down.

    The socket is bound and listening before the thread starts, so the port is known and
    connections made before uvicorn accepts them wait in the backlog instead of failing.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(2048)
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5, access_log=False
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._serve, name="kvreuse-uvicorn", daemon=True)
        self.error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _serve(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
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
        self.sock.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def serve_forever(app: FastAPI, host: str, port: int) -> None:
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
