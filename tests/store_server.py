"""A Redis server for the tests that use a real shared store: started on a free loopback port
in a temporary folder, stopped by its PID. Tests that need one skip, naming the install step,
where no `redis-server` is installed."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

INSTALL = "apt-get install redis-server (what .ci/run does)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def redis_server(folder: Path) -> Iterator[str]:
    """A running server's url; the server is stopped (SIGTERM, then SIGKILL) on exit."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip(f"no redis-server for the shared store tests: {INSTALL}")
    import redis

    for _ in range(5):  # a port taken between the probe and the bind: try another
        port = _free_port()
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(folder), "--logfile", str(folder / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis(port=port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                client.ping()
                break
            except redis.RedisError:
                time.sleep(0.05)
        else:
            proc.kill()
            proc.wait()
            continue
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return
    raise RuntimeError(f"redis-server did not start; see {folder / 'redis.log'}")
