"""The server over the real PyTorch engine (the default backend), via the official client."""

from __future__ import annotations

from collections.abc import Iterator

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
