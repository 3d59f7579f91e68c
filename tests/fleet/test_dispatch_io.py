"""The front never holds its routing lock across I/O: while a replica's replay socket, or the
journal of the store the replicas share, is slow to answer, the front's status endpoints answer
at once (and, for a slow replay, so do decisions); only the in-memory apply of what was read
runs under the lock."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import zmq

for _name, _extra in (("fastapi", "server"), ("uvicorn", "server")):
    pytest.importorskip(_name, reason=f"fleet tests need {_name}: pip install -e '.[{_extra}]'")

from kvreuse.deployment import resolve  # noqa: E402
from kvreuse.events import StoreMirror  # noqa: E402
from kvreuse.fleet.serving.dispatch import Dispatcher  # noqa: E402
from kvreuse.fleet.serving.front import create_front  # noqa: E402
from kvreuse.serve.server import ServerThread  # noqa: E402
from kvreuse.tokenizer import ByteTokenizer  # noqa: E402

CFG = resolve("tiny-attention").cache
SLOW_S = 3.0  # how long the replay (or the store) keeps the front waiting
PROMPT = list(range(1, 200))


def _silent_replay() -> tuple[zmq.Socket[bytes], str]:
    """A replay endpoint that takes every request and answers none."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}"


def _timed(call: object) -> float:
    start = time.monotonic()
    call()  # type: ignore[operator]
    return time.monotonic() - start


def test_status_and_decisions_do_not_wait_for_a_slow_replay(tmp_path: Path) -> None:
    dispatcher = Dispatcher(CFG, "exact", replay_timeout=SLOW_S)
    slow = dispatcher.add("r0", "http://127.0.0.1:9", f"ipc://{tmp_path}/e0")
    dispatcher.add("r1", "http://127.0.0.1:9", f"ipc://{tmp_path}/e1")
    replay, endpoint = _silent_replay()
    front = ServerThread(create_front(dispatcher, ByteTokenizer(), health_interval=3600))
    url = front.start()
    checking = threading.Thread(target=dispatcher.set_replay, args=(slow, endpoint))
    try:
        checking.start()
        assert replay.poll(5000)  # asked: the check now waits for an answer that never comes
        with httpx.Client(timeout=10) as client:
            for path in ("/fleet/replicas", "/metrics", "/health"):
                assert _timed(lambda p=path: client.get(url + p).raise_for_status()) < 1.0
        assert _timed(lambda: dispatcher.done(dispatcher.route(PROMPT))) < 1.0
        assert checking.is_alive()  # all of the above happened while the replay was asked
        checking.join()
        assert slow.subscriber.stream("r0").errors  # it did wait, and gave up
    finally:
        checking.join()
        front.stop()
        dispatcher.close()
        replay.close(linger=0)


class _SlowFollower:
    """A store follower whose read (`fetch`) waits until `release` is set, and that records
    whether each apply (`apply_fetched`) held the routing lock `lock`."""

    def __init__(self, mirror: StoreMirror, lock: threading.Lock) -> None:
        self.mirror, self.lock = mirror, lock
        self.reading, self.release = threading.Event(), threading.Event()
        self.applied: list[tuple[list[str], bool]] = []

    def fetch(self) -> list[str]:
        assert not self.lock.locked()
        self.reading.set()
        assert self.release.wait(10)
        return ["entry"]

    def apply_fetched(self, entries: list[str]) -> None:
        self.applied.append((entries, self.lock.locked()))


def test_status_does_not_wait_for_a_slow_store(tmp_path: Path) -> None:
    store = StoreMirror(CFG.geometry, "STORE")
    dispatcher = Dispatcher(CFG, "exact", tiers=["STORE"], store=store)
    dispatcher.add("r0", "http://127.0.0.1:9", f"ipc://{tmp_path}/e0")
    lock = dispatcher._lock  # the routing lock itself: the apply must hold it
    follower = _SlowFollower(store, lock)
    following = threading.Thread(target=dispatcher.follow_store, args=(follower,))
    try:
        following.start()
        assert follower.reading.wait(5)
        assert _timed(dispatcher.status) < 1.0
        assert not lock.locked()
        follower.release.set()
        following.join(5)
    finally:
        follower.release.set()
        dispatcher.close()
    assert follower.applied == [(["entry"], True)]
