"""A fake-model server whose steps take 10 ms (a model's pace), for the shutdown tests:
`python slow_server.py DRAIN_TIMEOUT` prints its port, serves until SIGTERM, exits with the
server's code."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from kvreuse.serve import fake_backend
from kvreuse.serve.app import create_app
from kvreuse.serve.server import bind, run_server
from serve_util import SlowEngine


def main() -> int:
    backend = fake_backend(num_blocks=4096)
    backend.scheduler.engine = SlowEngine(backend.scheduler.engine, 0.01)
    sock = bind("127.0.0.1", 0)
    print(sock.getsockname()[1], flush=True)
    return run_server(create_app(backend), [sock], drain_timeout=float(sys.argv[1]))


if __name__ == "__main__":
    raise SystemExit(main())
