"""Twenty replay clients that never read cost a publisher a bounded, small amount of memory.

The publisher runs in its own process (`replay_hog.py`) with 10,000 buffered batches of 4 KiB,
the default bounds (4 answers at a time, 256 messages per client's pipe, 16 MiB and 5 s per
answer), and reports its resident memory. Copies of the buffer per client (what a replay used to
cost: about 40 MiB each here) would take it past a gigabyte; the documented bound is 32 MiB.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import zmq

HOG = Path(__file__).with_name("replay_hog.py")
BOUND_KIB = 32 * 1024


def test_twenty_replay_clients_that_never_read_stay_within_the_bound() -> None:
    proc = subprocess.Popen(
        [sys.executable, str(HOG), "10000", "4096"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    ctx = zmq.Context.instance()
    clients: list[zmq.Socket[bytes]] = []
    assert proc.stdin is not None and proc.stdout is not None
    try:
        _, endpoint, before = proc.stdout.readline().split()
        for _ in range(20):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.connect(endpoint)
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            clients.append(sock)
        growth = []
        for _ in range(3):  # before, at and after the answers' 5 s deadline
            time.sleep(2.0)
            proc.stdin.write("rss\n")
            proc.stdin.flush()
            growth.append(int(proc.stdout.readline().split()[1]) - int(before))
        assert max(growth) < BOUND_KIB, f"resident memory grew by {growth} KiB"
        # and the replay still answers a client that reads
        reader = ctx.socket(zmq.DEALER)
        clients.append(reader)
        reader.connect(endpoint)
        reader.send_multipart([b"", (9_999).to_bytes(8, "big")])
        assert reader.poll(5_000)
        assert int.from_bytes(reader.recv_multipart()[2], "big") == 9_999
        proc.stdin.close()
        assert proc.wait(10) == 0
    finally:
        for sock in clients:
            sock.close(linger=0)
        if not proc.stdin.closed:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
