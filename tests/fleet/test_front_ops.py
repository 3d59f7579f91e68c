"""Operating the front as `kvreuse serve` is operated: a separate metrics listener, the admin
token for /fleet/replicas (it lists the replicas' addresses), SIGTERM (the replicas stop before
the front ends, by SIGTERM as serve does), and a replica that dies while the front runs (reaped
at once, not a zombie until the front exits)."""

from __future__ import annotations

import io
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

for _name, _extra in (("fastapi", "server"), ("uvicorn", "server")):
    pytest.importorskip(_name, reason=f"front tests need {_name}: pip install -e '.[{_extra}]'")

from test_front_util import command, wait_until  # noqa: E402

from kvreuse.events import Publisher  # noqa: E402
from kvreuse.fleet.serving.dispatch import Dispatcher  # noqa: E402
from kvreuse.fleet.serving.front import create_front  # noqa: E402
from kvreuse.fleet.serving.replicas import ReplicaProcess  # noqa: E402
from kvreuse.serve import fake_backend  # noqa: E402
from kvreuse.serve.app import create_app  # noqa: E402
from kvreuse.serve.server import ServerThread, bind  # noqa: E402
from kvreuse.tokenizer import ByteTokenizer  # noqa: E402

TOKEN = {"authorization": "Bearer s3cret"}
_STARTED = re.compile(r"^\[replica-\d+\] INFO:\s+Started server process \[(\d+)\]")


def _pump(stream: io.TextIOBase, into: queue.Queue[str]) -> None:
    for line in stream:
        into.put(line)


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


def _check_operator_controls(url: str, metrics_url: str) -> None:
    assert httpx.get(f"{url}/metrics").status_code == 404
    scrape = httpx.get(metrics_url)
    assert scrape.status_code == 200 and "kvreuse:fleet_routed_requests_total" in scrape.text
    for headers in ({}, {"authorization": "Bearer wrong"}):
        r = httpx.get(f"{url}/fleet/replicas", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.get(f"{url}/fleet/replicas", headers=TOKEN)
    assert r.status_code == 200 and r.json()["replicas"][0]["name"] == "replica-0"
    base = metrics_url.removesuffix("/metrics")
    assert httpx.get(f"{base}/fleet/replicas", headers=TOKEN).status_code == 404
    assert httpx.get(f"{base}/health").status_code == 200
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_the_front_serves_metrics_apart_and_guards_its_replica_list(tmp_path: Path) -> None:
    replica = ServerThread(create_app(fake_backend()))
    dispatcher = Dispatcher(fake_backend().mgr.config, "exact")
    msock = bind("127.0.0.1", 0)
    mport = msock.getsockname()[1]
    try:
        dispatcher.add("replica-0", replica.start(), f"ipc://{tmp_path}/events")
        app = create_front(
            dispatcher,
            ByteTokenizer(),
            health_interval=3600,
            admin_token="s3cret",
            metrics_port=mport,
        )
        with ServerThread(app, extra=(msock,)) as url:
            _check_operator_controls(url, f"http://127.0.0.1:{mport}/metrics")
    finally:
        replica.stop()
        dispatcher.close()


def test_kvreuse_route_takes_the_operator_options_of_kvreuse_serve(tmp_path: Path) -> None:
    backend = fake_backend()
    pub = Publisher(backend.mgr.geo, endpoint=f"ipc://{tmp_path}/ev")
    replica = ServerThread(create_app(backend, kv_events=pub))
    env = {**os.environ, "KVREUSE_ADMIN_TOKEN": "s3cret"}
    args = ["route", "--port", "0", "--metrics-port", "0"]
    seen: list[str] = []
    try:
        args += ["--replica", f"{replica.start()},{pub.endpoint}"]
        with command(args, "kvreuse route:", timeout=60, env=env, seen=seen) as url:
            wait_until(lambda: any(" metrics on " in line for line in seen))
            line = next(line for line in seen if " metrics on " in line)
            assert line.startswith("kvreuse route: metrics on http://127.0.0.1:")
            _check_operator_controls(url, line.split(" on ", 1)[1])
    finally:
        replica.stop()


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
            # the replicas' lines are echoed by threads of their own, so one may come after
            # the fleet's ready line: read until both pids and the url are in (or 60 s)
            lines: queue.Queue[str] = queue.Queue()
            reader = threading.Thread(target=_pump, args=(front.stderr, lines), daemon=True)
            reader.start()
            pids: list[int] = []
            url, deadline = "", time.monotonic() + 60
            while len(pids) < 2 or not url:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
                if (m := _STARTED.match(line)) is not None:
                    pids.append(int(m.group(1)))
                if line.startswith("kvreuse fleet: 2 replica(s)"):
                    url = line.split(" on ", 1)[1].strip().removesuffix("/v1")
            assert len(pids) == 2, pids
            # the line comes before the front's server starts (and handles signals)
            wait_until(lambda: _answers(url))
            front.send_signal(signal.SIGTERM)
            front.wait(timeout=60)  # the reader drains the rest of its output meanwhile
            assert front.returncode == -signal.SIGTERM
            assert [_state(pid) for pid in pids] == [None, None]
        finally:
            if front.poll() is None:
                front.kill()
