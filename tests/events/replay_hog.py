"""A publisher with a full replay buffer, in its own process, reporting its resident memory.

    python replay_hog.py BATCHES BYTES   prints "ready ENDPOINT RSS_KIB", then "rss RSS_KIB" for
                                         every line read from stdin, until stdin closes

The buffer holds BATCHES payloads of BYTES bytes each.
"""

from __future__ import annotations

import sys

from kvreuse.core import CacheConfig, GroupSpec
from kvreuse.events import Publisher


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main() -> None:
    batches, size = int(sys.argv[1]), int(sys.argv[2])
    geo = CacheConfig(num_blocks=64, groups=[GroupSpec(kind="full", block_size=16)]).geometry
    pub = Publisher(
        geo,
        endpoint="tcp://127.0.0.1:0",
        replay_endpoint="tcp://127.0.0.1:0",
        buffer_steps=batches,
    )
    pad = b"x" * size
    # filled before any replay request comes, so the thread never reads it half-made; the
    # payloads' contents do not matter to the replay
    for _ in range(batches):
        pub.buffer.append((pub.next_seq, pad + pub.next_seq.to_bytes(8, "big")))
        pub._next_seq += 1
    print(f"ready {pub.replay_endpoint} {rss_kib()}", flush=True)
    for _ in sys.stdin:
        print(f"rss {rss_kib()}", flush=True)
    pub.close()


if __name__ == "__main__":
    main()
