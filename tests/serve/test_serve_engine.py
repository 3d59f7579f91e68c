"""The server over the real PyTorch engine (the default backend), via the official client."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine]'")

from openai import OpenAI

from kvreuse.serve import default_backend
from kvreuse.serve.app import create_app
from kvreuse.serve.server import ServerThread


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[OpenAI, str, int]]:
    backend = default_backend(num_blocks=256)
    u = backend.mgr.geo.hash_unit
    with (
        ServerThread(create_app(backend)) as url,
        OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client,
    ):
        yield client, backend.name, u


def test_default_model_cold_warm_identical_answers(served: tuple[OpenAI, str, int]) -> None:
    client, model, u = served
    prompt = "The prefix cache reuses what it can prove. " * 6
    p = len(prompt.encode())
    cold = client.completions.create(
        model=model, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    warm = client.completions.create(
        model=model, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert cold.usage.prompt_tokens == p
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens == (p - 1) // u * u
    assert warm.choices[0].text == cold.choices[0].text
    salted = client.completions.create(
        model=model, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "other-tenant"}
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_default_model_chat_stream(served: tuple[OpenAI, str, int]) -> None:
    client, model, _ = served
    msgs = [{"role": "user", "content": "Say something about caches. " * 4}]
    cached = []
    for _ in range(2):
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=msgs,
                max_tokens=4,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].usage is not None
        cached.append(chunks[-1].usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 < cached[1]


def test_an_out_of_range_seed_is_a_400_and_the_engine_loop_lives(
    served: tuple[OpenAI, str, int],
) -> None:
    client, model, _ = served
    url = str(client.base_url).removesuffix("/v1/")
    body = {"model": model, "prompt": "hello", "max_tokens": 2, "seed": 2**64}
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "seed": -(2**63) - 1}
    assert httpx.post(url + "/v1/chat/completions", json=chat).status_code == 400
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    for seed in (2**64 - 1, -(2**63)):  # the extremes torch accepts are served
        ok = client.completions.create(model=model, prompt="hello", max_tokens=2, seed=seed)
        assert ok.usage.completion_tokens == 2


def test_the_default_model_name_and_its_old_alias(served: tuple[OpenAI, str, int]) -> None:
    client, model, _ = served
    assert model == "kvreuse-tiny-hybrid-dcp4"
    assert [m.id for m in client.models.list().data] == [model]
    old = client.completions.create(model="kvreuse-tiny-tiny-hybrid-dcp4", prompt="x", max_tokens=1)
    assert old.model == model


def test_serve_warns_when_the_model_caps_max_model_len(tmp_path: Path) -> None:
    from kvreuse.deployment import resolve
    from kvreuse.engine import save_model
    from kvreuse.engine.llm import default_model_config
    from kvreuse.engine.model import TinyModel

    geo = tmp_path / "long.toml"
    geo.write_text(
        "[cache]\nnum_blocks = 64\nhash_unit = 8\nmax_model_len = 100000\n"
        '[[groups]]\nkind = "full"\nblock_size = 16\n'
    )
    short = replace(default_model_config(resolve(str(geo)).cache), max_position_embeddings=512)
    save_model(TinyModel.random(short, 0), tmp_path / "short-model")
    backend = default_backend(str(tmp_path / "short-model"), str(geo))
    assert backend.name == "short-model" and backend.max_model_len == 512
    assert len(backend.notes) == 1 and "100000" in backend.notes[0] and "512" in backend.notes[0]
    assert not default_backend(geometry=str(geo)).notes  # the embedded model fits it
    assert default_backend(geometry=str(geo)).name == "kvreuse-tiny-long"
