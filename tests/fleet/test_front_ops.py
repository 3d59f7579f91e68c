"""Operating the front as `kvreuse serve` is operated: SIGTERM (the replicas stop before the
front ends, by SIGTERM as serve does), and a replica that dies while the front runs (reaped at
once, not a zombie until the front exits)."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

for _name, _extra in (("fastapi", "server"), ("uvicorn", "server")):
    pytest.importorskip(_name, reason=f"front tests need {_name}: pip install -e '.[{_extra}]'")

from test_front_util import wait_until  # noqa: E402

from kvreuse.fleet.replicas import ReplicaProcess  # noqa: E402

_STARTED = re.compile(r"^\[replica-\d+\] INFO:\s+Started server process \[(\d+)\]")


def _state(pid: int) -> str | None:
    """The process's state letter (Z: a zombie), or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_replica_that_dies_is_reaped_while_the_front_runs(tmp_path: Path) -> None:
    out = io.StringIO()
    proc = ReplicaProcess("replica-0", f"ipc://{tmp_path}/events", ["--fake"], echo=out)
    try:
        proc.start()
        proc.wait_ready(time.monotonic() + 60)
        assert proc.proc is not None
        pid = proc.proc.pid
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: _state(pid) is None, timeout=10)  # a zombie stays "Z" until reaped
        wait_until(lambda: "[replica-0] exited (exit code -9)" in out.getvalue(), timeout=5)
    finally:
        proc.stop()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_sigterm_stops_every_replica_before_the_fleet_ends_as_serve_does() -> None:
    """`kvreuse serve` ends by the SIGTERM it drained for (uvicorn re-raises it): so does the
    fleet, and by then its replicas have drained and exited, not merely been told to."""
    cmd = [sys.executable, "-m", "kvreuse", "fleet", "--replicas", "2", "--fake", "--port", "0"]
    cmd += ["--start-timeout", "60"]  # the loop below ends with its output at the latest
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    ) as front:
        try:
            assert front.stderr is not None
            pids: list[int] = []
            for line in front.stderr:
                if (m := _STARTED.match(line)) is not None:
                    pids.append(int(m.group(1)))
                if line.startswith("kvreuse fleet: 2 replica(s)"):
                    url = line.split(" on ", 1)[1].strip().removesuffix("/v1")
                    break
            assert len(pids) == 2, pids
            # the line comes before the front's server starts (and handles signals)
            wait_until(lambda: _answers(url))
            front.send_signal(signal.SIGTERM)
            front.communicate(timeout=60)  # reads the rest of its output while it stops
            assert front.returncode == -signal.SIGTERM
            assert [_state(pid) for pid in pids] == [None, None]
        finally:
            if front.poll() is None:
                front.kill()
