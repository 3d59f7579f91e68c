"""What the server drives: a `Backend` (tokenizer + scheduler + manager + name + context length).

The default backend is `kvreuse.engine.LLM` (the embedded tiny PyTorch model). Tests that do not
need a real model use `fake_backend()`: a byte tokenizer and `ContentEngine`, a deterministic
stand-in whose next token is a pure function of the tokens before it, so a warm request answers
exactly like a cold one, as greedy decoding of a real model does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvreuse.core import KVCacheManager, StepPlan
from kvreuse.sched import Scheduler
from kvreuse.sim.geometry import SimGeometry, load_geometry, preset
from kvreuse.tokenizer import ByteTokenizer, Tokenizer

FAKE_GEOMETRY = """
[cache]
num_blocks = 512
dcp_size = 4
hash_unit = 16
max_model_len = 2048
max_num_seqs = 64
max_num_batched_tokens = 2048
[[groups]]
kind = "full"
block_size = 16
[[groups]]
kind = "recurrent"
block_size = 16
"""


class ContentEngine:
    """A fake engine whose token at position p depends only on the tokens [0, p).

    Tokens are lowercase ASCII letters (never end-of-sequence), so outputs are readable and
    deterministic across cold and warm runs. Saves are written at the end of a step only (E6).
    """

    def __init__(self) -> None:
        self.num_forward_tokens = 0

    @staticmethod
    def next_token(tokens: list[int]) -> int:
        tail = ",".join(map(str, tokens[-64:]))
        digest = hashlib.blake2b(f"{len(tokens)}/{tail}".encode(), digest_size=4).digest()
        return 97 + int.from_bytes(digest, "big") % 26

    def __call__(self, step: StepPlan, seqs: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
        out: dict[str, tuple[Any, ...]] = {}
        for plan in step.requests:
            seq = seqs[plan.request_id]
            num = seq.num_tokens
            self.num_forward_tokens += plan.num_new_tokens
            if plan.end < num:
                t_new, new = plan.end, []
            else:
                tokens = [*seq.request.prompt_token_ids, *seq.output]
                t_new, new = num, [self.next_token(tokens)]
            saved = [s.position for s in plan.saves if s.position == t_new]
            out[plan.request_id] = (t_new, new, saved)
        return out


def _fake_sampling(**kwargs: Any) -> dict[str, Any]:
    return dict(kwargs)


@dataclass
class Backend:
    """Everything the server needs; only its step-loop thread touches `scheduler` and `mgr`."""

    name: str
    tokenizer: Tokenizer
    scheduler: Scheduler
    max_model_len: int
    geometry: SimGeometry | None = None
    make_sampling: Callable[..., Any] = _fake_sampling
    vocab_size: int | None = None  # token ids a prompt may hold (default: the tokenizer's)

    @property
    def token_limit(self) -> int:
        return self.vocab_size or self.tokenizer.vocab_size

    @property
    def mgr(self) -> KVCacheManager:
        return self.scheduler.mgr


def resolve_geometry(spec: str | SimGeometry | None) -> SimGeometry:
    """A preset name, a TOML file path, or a geometry as is (None: the fake backend's)."""
    if isinstance(spec, SimGeometry):
        return spec
    if spec is None:
        return load_geometry(FAKE_GEOMETRY, "fake-hybrid-dcp4")
    if spec.endswith(".toml") or "/" in spec:
        with open(spec, encoding="utf-8") as fh:
            return load_geometry(fh.read(), spec)
    return preset(spec)


def fake_backend(
    geometry: str | SimGeometry | None = None,
    name: str = "kvreuse-fake",
    num_blocks: int | None = None,
) -> Backend:
    geo = resolve_geometry(geometry)
    if num_blocks is not None:
        geo = replace(geo, cache=replace(geo.cache, num_blocks=num_blocks))
    sched = Scheduler(KVCacheManager(geo.cache), ContentEngine(), geo.sched)
    return Backend(name, ByteTokenizer(), sched, geo.max_model_len or 2048, geo)


def default_backend(
    model: str | None = None, geometry: str | None = None, num_blocks: int | None = None
) -> Backend:
    """The embedded tiny model (`kvreuse.engine.LLM`); needs the `engine` extra (torch)."""
    try:
        from kvreuse.engine import LLM, SamplingParams
    except ImportError as exc:
        raise RuntimeError(
            f"kvreuse serve needs the PyTorch engine ({exc}); install it with "
            "pip install -e '.[engine,server]', or run with --fake for the test backend"
        ) from None
    kwargs: dict[str, Any] = {"num_blocks": num_blocks}
    if geometry is not None:
        kwargs["geometry"] = resolve_geometry(geometry)
    llm = LLM(model, **kwargs)
    geo = kwargs.get("geometry")
    model_cfg = getattr(getattr(llm, "model", None), "config", None)
    vocab = getattr(model_cfg, "vocab_size", None)
    return Backend(
        llm.model_name,
        llm.tokenizer,
        llm.scheduler,
        llm.max_model_len,
        geo,
        SamplingParams,
        vocab if isinstance(vocab, int) else None,
    )


def _toml_value(v: object) -> str | None:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return None  # None, bytes, callables: not representable, left at their defaults


def geometry_toml(backend: Backend) -> str:
    """The backend's cache and scheduler settings as a geometry file (`load_geometry` reads it)."""
    from dataclasses import fields

    from kvreuse.sim.geometry import CACHE_KEYS

    cfg, sched = backend.mgr.config, backend.scheduler.config
    lines = ["[cache]"]
    for f in fields(cfg):
        if f.name in CACHE_KEYS and (v := _toml_value(getattr(cfg, f.name))) is not None:
            lines.append(f"{f.name} = {v}")
    for f in fields(sched):
        if (v := _toml_value(getattr(sched, f.name))) is not None:
            lines.append(f"{f.name} = {v}")
    lines.append(f"max_model_len = {backend.max_model_len}")
    for g in cfg.groups:
        lines.append("[[groups]]")
        for f in fields(g):
            if (v := _toml_value(getattr(g, f.name))) is not None:
                lines.append(f"{f.name} = {v}")
    return "\n".join(lines) + "\n"
