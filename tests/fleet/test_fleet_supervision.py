"""`kvreuse fleet` supervises its replicas: one killed (-9) under load is restarted and serves
again, out of rotation (and no mirror called exact) while it is down, with no request lost; one
that keeps dying is given up after the bounded tries, in one line. Also the restart policy
itself, restarts turned off, and the options' one-line errors."""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

for _name, _extra in (("fastapi", "server"), ("uvicorn", "server")):
    pytest.importorskip(_name, reason=f"fleet tests need {_name}: pip install -e '.[{_extra}]'")

from test_front_util import command, metric, wait_until  # noqa: E402

from kvreuse.cli import main  # noqa: E402
from kvreuse.deployment import resolve  # noqa: E402
from kvreuse.fleet.serving.dispatch import Dispatcher  # noqa: E402
from kvreuse.fleet.serving.supervise import (  # noqa: E402
    RestartPolicy,
    Supervisor,
    Tries,
    exit_status,
)

FLEET = ["fleet", "--fake", "--port", "0", "--quiet-replicas", "--health-interval", "0.2"]
CLIENTS = 4
REQUESTS = 240  # in all, over the clients
TEXT = "You are a terse assistant. Answer in one word and say nothing else at all. " * 2


def test_restarts_back_off_and_run_out_within_the_window() -> None:
    tries = Tries(RestartPolicy(tries=3, window=60.0))
    assert [tries.next(t) for t in (0.0, 1.0, 2.0)] == [(1, 0.5), (2, 1.0), (3, 2.0)]
    assert tries.next(3.0) is None  # a fourth exit within the window: given up
    assert tries.next(60.5) == (3, 2.0)  # the first try left the window
    capped = Tries(RestartPolicy(tries=10, window=60.0))
    assert [capped.next(0.0)[1] for _ in range(6)] == [0.5, 1, 2, 4, 8, 8]  # type: ignore[index]
    assert Tries(RestartPolicy(tries=0)).next(0.0) is None  # restarts off


def test_an_exit_is_named_by_its_code_or_signal() -> None:
    assert exit_status(3) == "exit code 3"
    assert exit_status(-signal.SIGKILL) == "signal 9, SIGKILL"


class _Exits:
    """A replica process as the supervisor watches it, which exits when told to."""

    pid = 4242

    def watch(self, on_exit: Callable[[object, int], None]) -> None:
        self.on_exit = on_exit


def test_with_restarts_off_an_exit_gives_the_replica_up_in_one_line(tmp_path: Path) -> None:
    dispatcher = Dispatcher(resolve("tiny-attention").cache, "exact")
    member = dispatcher.add("replica-0", "http://127.0.0.1:9", f"ipc://{tmp_path}/e0")
    said: list[str] = []
    replica = _Exits()
    supervisor = Supervisor(
        [replica],  # type: ignore[list-item]
        dispatcher,
        [member],
        RestartPolicy(tries=0),
        start_timeout=1.0,
        say=said.append,
    )
    try:
        supervisor.start()
        replica.on_exit(replica, 3)
        wait_until(lambda: member.state == "given-up", timeout=5)
    finally:
        supervisor.close()
        dispatcher.close()
    assert said == ["replica-0 exited (exit code 3); not restarted (--restart-tries 0)"]
    assert (member.up, member.pid, member.restarts) == (False, 4242, 0)


@pytest.mark.parametrize(
    ("option", "needle"),
    [
        (["--restart-window", "0"], "--restart-window must be seconds > 0, got 0.0"),
        (["--restart-window", "nan"], "--restart-window must be seconds > 0, got nan"),
    ],
)
def test_bad_restart_options_are_one_line(
    option: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*FLEET, "--replicas", "1", *option]) == 2
    err = capsys.readouterr().err
    assert err == f"kvreuse fleet: {needle}\n"


# ---------------------------------------------------------------------------- processes
def _replicas(url: str) -> list[dict]:
    rows: list[dict] = httpx.get(f"{url}/fleet/replicas", timeout=5).json()["replicas"]
    return rows


@dataclass
class Answer:
    status: int
    replica: str | None
    code: str | None = None
    message: str = ""


def _ask(client: httpx.Client, url: str, prompt: str) -> Answer:
    body = {"model": "kvreuse-fake", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    resp = client.post(f"{url}/v1/completions", json=body)
    answer = Answer(resp.status_code, resp.headers.get("x-kvreuse-replica"))
    if resp.status_code != 200:
        error = resp.json()["error"]
        answer.code, answer.message = error["code"], error["message"]
    return answer


def _load(url: str, answers: list[Answer]) -> None:
    """CLIENTS clients, each one request at a time over three sessions of its own."""

    def client(c: int) -> None:
        with httpx.Client(timeout=30) as http:
            for n in range(REQUESTS // CLIENTS):
                answers.append(_ask(http, url, f"client {c} session {n % 3}: {TEXT}"))

    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(client, range(CLIENTS)))


def test_a_replica_killed_under_load_is_restarted_and_serves_again() -> None:
    seen: list[str] = []
    with command([*FLEET, "--replicas", "2"], "kvreuse fleet:", timeout=120, seen=seen) as url:
        pid = _replicas(url)[0]["pid"]
        answers: list[Answer] = []
        down: list[dict] = []

        def kill_under_load() -> None:
            wait_until(lambda: len(answers) >= REQUESTS // 4, timeout=60)
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: _replicas(url)[0]["state"] == "restarting", timeout=10)
            down.append(_replicas(url)[0])

        killer = threading.Thread(target=kill_under_load)
        killer.start()
        _load(url, answers)
        killer.join()
        wait_until(lambda: _replicas(url)[0]["state"] == "up" and _replicas(url)[0]["mirror_exact"],
                   timeout=60)  # fmt: skip
        back = _replicas(url)[0]
        after = _serves_again(url)
        scrape = httpx.get(f"{url}/metrics").text
    # while it was down: out of rotation, its mirror not called exact
    row = down[0]
    assert (row["up"], row["mirror_exact"]) == (False, False)
    assert "SIGKILL" in row["why_down"]
    # back: a new process, followed from scratch
    assert back["restarts"] == 1 and back["pid"] != pid and back["event_restarts"] >= 1
    assert after.replica == "replica-0"
    assert metric(scrape, "kvreuse:fleet_replica_restarts_total", replica="replica-0") == 1
    assert metric(scrape, "kvreuse:fleet_replica_state", replica="replica-0", state="up") == 1
    # no request lost: every one answered, and only those on the killed process when it died
    # failed, as any request a replica breaks off does (502 replica_failed)
    assert len(answers) == REQUESTS
    failed = [a for a in answers if a.status != 200]
    assert len(failed) <= CLIENTS, failed
    assert all(a.status == 502 and a.code == "replica_failed" for a in failed), failed
    assert all("replica replica-0 failed to answer" in a.message for a in failed), failed
    lines = [line for line in seen if line.startswith("kvreuse fleet: replica-0")]
    assert lines[:3] == [
        "kvreuse fleet: replica-0 exited (signal 9, SIGKILL); restart try 1 of 5 in 0.5 s",
        "kvreuse fleet: replica-0 restart try 1 of 5 (after signal 9, SIGKILL): started, "
        f"pid {back['pid']}",
        f"kvreuse fleet: replica-0 is back (restart try 1 of 5): on {back['url']}",
    ]


@dataclass
class Served:
    replica: str
    predicted: int
    cached: int


def _serves_again(url: str) -> Served:
    """Cold prompts go round the replicas; the first that lands on replica-0 is sent again, and
    then the front predicts exactly what the new process caches."""
    with httpx.Client(timeout=30) as http:
        for n in range(6):
            prompt = f"after the restart {n}: {TEXT}"
            if _ask(http, url, prompt).replica != "replica-0":
                continue
            body = {"model": "kvreuse-fake", "prompt": prompt, "max_tokens": 2}
            resp = http.post(f"{url}/v1/completions", json=body)
            cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            predicted = int(resp.headers["x-kvreuse-predicted-cached-tokens"])
            assert resp.headers["x-kvreuse-mirror-exact"] == "true"
            assert predicted == cached > 0
            return Served(resp.headers["x-kvreuse-replica"], predicted, cached)
    raise AssertionError("no request went to the restarted replica")


def test_a_replica_that_keeps_dying_is_given_up() -> None:
    seen: list[str] = []
    args = [*FLEET, "--replicas", "1", "--restart-tries", "2", "--restart-window", "30"]
    started = re.compile(r"^kvreuse fleet: replica-0 restart try \d of 2 .*: started, pid (\d+)$")
    with command(args, "kvreuse fleet:", timeout=120, seen=seen) as url:
        os.kill(_replicas(url)[0]["pid"], signal.SIGKILL)
        killed: set[int] = set()

        def given_up() -> bool:
            for line in list(seen):  # every new process dies at once
                if (m := started.match(line)) and int(m.group(1)) not in killed:
                    killed.add(int(m.group(1)))
                    os.kill(int(m.group(1)), signal.SIGKILL)
            return _replicas(url)[0]["state"] == "given-up"

        wait_until(given_up, timeout=30)
        row = _replicas(url)[0]
        health = httpx.get(f"{url}/health")
    assert len(killed) == 2 and row["restarts"] == 2
    assert (row["state"], row["up"], row["mirror_exact"]) == ("given-up", False, False)
    assert health.status_code == 503
    give_up = [line for line in seen if "given up" in line]
    assert give_up == [
        "kvreuse fleet: replica-0 exited (signal 9, SIGKILL) after 2 restart tries within 30 s: "
        "given up"
    ]
