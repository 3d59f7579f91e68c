"""kvreuse's fleet on Ray Serve (`kvreuse.fleet.ray_serve.app`): a local Ray cluster, two replicas
(`kvreuse serve --fake` processes in Ray replica actors) and the ingress, whose deployment
handle routes with `KvreuseRequestRouter` through Ray Serve's public request-router API.

Sessions that start cold take turns over the replicas; every session's second turn lands where
its first was, and every prediction equals the cached tokens the replica reports. Needs
`.venv-ray` (bash benchmarks/ray/setup_venv.sh), where Ray runs; skipped without it (failed
under CI)."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path

import pytest

for _name, _extra in (("fastapi", "server"), ("openai", "test")):
    pytest.importorskip(
        _name, reason=f"fleet front tests need {_name}: pip install -e '.[{_extra}]'"
    )

import openai  # noqa: E402
from test_front_util import command  # noqa: E402

RAY_PYTHON = Path(__file__).resolve().parents[2] / ".venv-ray" / "bin" / "python"
SETUP = "bash benchmarks/ray/setup_venv.sh"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.needs(RAY_PYTHON.exists(), "Ray Serve's venv (.venv-ray)", SETUP)
def test_ray_serve_sends_each_session_back_to_its_cache() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local cluster
    args = ["--replicas", "2", "--fake", "--num-cpus", "4", "--port", str(_free_port())]
    program = (str(RAY_PYTHON), "-m", "kvreuse.fleet.ray_serve.app")
    with command(args, "kvreuse ray:", timeout=300, program=program, env=env) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        seen: dict[tuple[int, int], tuple[str, int, int]] = {}
        for turn in range(2):
            for session in range(4):
                prompt = f"session {session}: a question that is long enough to span units."
                raw = client.completions.with_raw_response.create(
                    model=model, prompt=prompt + " more" * turn, max_tokens=2, temperature=0
                )
                cached = raw.parse().usage.prompt_tokens_details.cached_tokens
                predicted = int(raw.headers["x-kvreuse-predicted-cached-tokens"])
                seen[session, turn] = (raw.headers["x-kvreuse-replica"], predicted, cached)
        client.close()
    print("\n(session, turn): (replica, predicted, cached)", seen)
    assert all(predicted == cached for _, predicted, cached in seen.values())
    for session in range(4):
        assert seen[session, 1][0] == seen[session, 0][0]
        assert seen[session, 0][1] == 0 and seen[session, 1][1] > 0
    assert len({seen[s, 0][0] for s in range(4)}) == 2


@pytest.mark.skipif(
    importlib.util.find_spec("ray") is not None, reason="Ray is installed in this environment"
)
def test_without_ray_the_module_imports_and_the_command_names_the_setup(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvreuse.fleet.ray_serve import app as ray_app

    assert "ray" not in sys.modules
    assert ray_app.main(["--replicas", "2", "--fake"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and SETUP in err
