"""A Redis server for the tests that use a real shared store: started on a free loopback port
in a temporary folder, stopped by its PID. Where no `redis-server` is installed, tests that need
one skip, naming the install step (and fail under CI: tests/conftest.py)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from needs import missing

INSTALL = "apt-get install redis-server (what .ci/run does)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProcess:
    """A server that can be killed (-9) and started again on its port: empty, or from a dump
    (`dump.rdb` in `folder`, which SAVE writes). DEBUG is enabled (DEBUG SLEEP)."""

    def __init__(self, folder: Path) -> None:
        self.exe = shutil.which("redis-server")
        if self.exe is None:
            missing("redis-server (the shared store's tests)", INSTALL)
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, dump: Path | None = None) -> None:
        """Start it; with `dump`, from that file, else empty."""
        import redis

        rdb = self.folder / "dump.rdb"
        rdb.unlink(missing_ok=True)
        if dump is not None:
            shutil.copy(dump, rdb)
        self.proc = subprocess.Popen(
            [self.exe or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self.folder),
             "--dbfilename", "dump.rdb", "--enable-debug-command", "yes",
             "--logfile", str(self.folder / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                client.ping()
                return
            except redis.RedisError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server did not start; see {self.folder / 'redis.log'}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@contextmanager
def redis_server(folder: Path) -> Iterator[str]:
    """A running server's url; the server is stopped (SIGTERM, then SIGKILL) on exit."""
    for _ in range(5):  # a port taken between the probe and the bind: try another
        server = RedisProcess(folder)
        try:
            server.start()
        except RuntimeError:
            continue
        try:
            yield server.url
        finally:
            server.stop()
        return
    raise RuntimeError(f"redis-server did not start; see {folder / 'redis.log'}")
