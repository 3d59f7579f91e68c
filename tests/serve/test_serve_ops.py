"""Operating the server: graceful shutdown on SIGTERM, the admin token, a separate metrics
listener, and the `kvreuse serve` command line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvreuse.cli import main
from kvreuse.serve import fake_backend
from kvreuse.serve.app import create_app
from kvreuse.serve.backend import served_name
from kvreuse.serve.server import ServerThread, bind
from serve_util import wait_for

HERE = Path(__file__).parent
KVREUSE = Path(sys.executable).with_name("kvreuse")


def _stream_outcome(body: str) -> str:
    """'finished', 'stopped' (error event: drain timeout) or 'refused' (not started)."""
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", body[-200:]
    last = json.loads(events[-3].removeprefix("data: "))
    if "error" in last:
        assert last["error"]["code"] == "shutting_down" and last["error"]["type"]
        return "stopped" if "stopped after" in last["error"]["message"] else "refused"
    assert last["choices"][0]["finish_reason"] in ("length", "stop")
    return "finished"


async def _streams(url: str, n: int, started: asyncio.Event, counts: list[int]) -> list[str]:
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=n)) as http:

        async def one(i: int) -> str:
            body = {"prompt": f"client {i} " * 4, "max_tokens": 1500, "stream": True}
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                text = ""
                async for chunk in r.aiter_text():
                    if not text:
                        counts[0] += 1
                        if counts[0] == 64:
                            started.set()
                    text += chunk
                return text  # a truncated chunked body raises instead

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_sigterm_under_64_streams_ends_every_stream_cleanly() -> None:
    cmd = [sys.executable, str(HERE / "slow_server.py"), "1.0"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stderr is not None
            url = f"http://127.0.0.1:{proc.stdout.readline().strip()}"
            wait_for(lambda: _up(url), "the server to start")

            async def scenario() -> list[str]:
                started, counts = asyncio.Event(), [0]
                task = asyncio.ensure_future(_streams(url, 72, started, counts))
                await asyncio.wait_for(started.wait(), 60)  # 64 running, 8 waiting for a seat
                proc.send_signal(signal.SIGTERM)
                return await task

            bodies = asyncio.run(scenario())
            rc = proc.wait(60)
            log = proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
    outcomes = [_stream_outcome(b) for b in bodies]
    assert outcomes.count("stopped") >= 1 and outcomes.count("refused") >= 1, outcomes
    assert rc in (0, -signal.SIGTERM), log


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health").status_code == 200
    except httpx.TransportError:
        return False


def test_reset_needs_the_admin_token_when_one_is_set() -> None:
    with ServerThread(create_app(fake_backend(), admin_token="s3cret-token")) as url:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret-token"}):
            r = httpx.post(url + "/reset_prefix_cache", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"
        ok = httpx.post(
            url + "/reset_prefix_cache", headers={"authorization": "Bearer s3cret-token"}
        )
        assert ok.status_code == 200 and ok.json() == {"status": "reset"}


def test_metrics_on_a_separate_listener() -> None:
    msock = bind("127.0.0.1", 0)
    mport = msock.getsockname()[1]
    app = create_app(fake_backend(), metrics_port=mport)
    with ServerThread(app, extra=(msock,)) as url:
        murl = f"http://127.0.0.1:{mport}"
        assert httpx.get(url + "/metrics").status_code == 404
        m = httpx.get(murl + "/metrics")
        assert m.status_code == 200 and "kvreuse:prefix_cache_hits_total" in m.text
        assert httpx.get(murl + "/health").status_code == 200
        assert httpx.get(murl + "/v1/models").status_code == 404
        r = httpx.post(murl + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).is_success


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--port", "99999"], "--port must be a TCP port in [0, 65535], got 99999"),
        (["--port", "-1"], "--port must be a TCP port"),
        (["--metrics-port", "70000"], "--metrics-port must be a TCP port"),
        (["--max-body-bytes", "0"], "--max-body-bytes must be at least 1"),
        (["--drain-timeout", "0"], "--drain-timeout must be a number of seconds > 0"),
        (["--num-blocks", "1G", "--port", "0"], "the limit is 16,777,216 blocks"),
        (["--store-lease", "0", "--port", "0"], "--store-lease must be seconds in [0.05, 3600]"),
        (["--store-url", "http://u:secret@h", "--store-capacity", "1K"], "u:***@h"),
    ],
)
def test_bad_serve_options_are_one_line_and_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["serve", "--fake", *argv])
    except SystemExit as exc:  # refused as the option is read
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and needle in err and err.startswith("kvreuse serve: ")
    assert "secret" not in err  # a password in a URL is never printed


def test_a_busy_port_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    busy = bind("127.0.0.1", 0)
    try:
        assert main(["serve", "--fake", "--port", str(busy.getsockname()[1])]) == 2
    finally:
        busy.close()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot listen on 127.0.0.1:" in err


def test_serve_on_port_0_prints_the_real_ports_and_reads_the_token_from_the_env() -> None:
    env = {**os.environ, "KVREUSE_ADMIN_TOKEN": "from-env"}
    cmd = [str(KVREUSE), "serve", "--fake", "--port", "0", "--metrics-port", "0"]
    with subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            assert proc.stderr is not None
            api = proc.stderr.readline().strip()
            metrics = proc.stderr.readline().strip()
            assert api.startswith("kvreuse serve: kvreuse-fake on http://127.0.0.1:"), api
            url = api.split(" on ")[1].removesuffix("/v1")
            assert not url.endswith(":0") and metrics.endswith("/metrics"), metrics
            wait_for(lambda: _up(url), "the server to start")
            murl = metrics.split(" on ")[1]
            assert "kvreuse:prefix_cache_queries_total" in httpx.get(murl).text
            assert httpx.post(url + "/reset_prefix_cache").status_code == 401
            auth = {"authorization": "Bearer from-env"}
            assert httpx.post(url + "/reset_prefix_cache", headers=auth).status_code == 200
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) in (0, -signal.SIGTERM)
        finally:
            if proc.poll() is None:
                proc.kill()


def test_served_names_have_no_extension_and_no_doubled_tiny() -> None:
    assert served_name("kvreuse-tiny-tiny-hybrid-dcp4", None) == "kvreuse-tiny-hybrid-dcp4"
    assert served_name("kvreuse-tiny-hybrid-dcp4", None) == "kvreuse-tiny-hybrid-dcp4"
    assert served_name("kvreuse-tiny-conf/my-geo.toml", None) == "kvreuse-tiny-my-geo"
    assert served_name("whatever", "/models/my-model") == "my-model"
