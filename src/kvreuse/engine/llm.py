"""The offline API: `LLM(...).generate(prompts, params)`.

`LLM` wires a `KVCacheManager`, a `Scheduler` and a `ModelRunner` together for one geometry. A
server uses the same pieces directly: `llm.scheduler.add(Request(...), max_tokens,
sampling=SamplingParams)` and `llm.scheduler.step()`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvreuse.core import CacheConfig, KVCacheManager, Request, SharedTier, TierSpec
from kvreuse.core.spi import Stage
from kvreuse.deployment import DeploymentSpec, check_num_blocks, resolve
from kvreuse.engine.checkpoint import load_model
from kvreuse.engine.config import LAYER_KINDS, ModelConfig
from kvreuse.engine.hf import is_hf_model_dir, load_hf_model
from kvreuse.engine.model import Model, TinyModel
from kvreuse.engine.runner import ModelRunner
from kvreuse.engine.sampling import SamplingParams
from kvreuse.engine.store import bind_tiers, model_identity
from kvreuse.engine.tiers import TierBytes
from kvreuse.sched import Scheduler, Seq
from kvreuse.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    cached_tokens: int
    reason: str  # the core's reason code for the hit (spec §12.3)
    finish_reason: str  # "length" | "stop"


DEFAULT_CONTEXT = 8192  # the embedded model's positions, at least
DEFAULT_GEOMETRY = "tiny-hybrid-dcp4"


def default_model_config(
    cache: CacheConfig,
    vocab_size: int = ByteTokenizer.vocab_size,
    max_model_len: int | None = None,
) -> ModelConfig:
    """The seeded default model for a geometry: one layer per target group kind (twice when the
    geometry has at most two kinds), a draft head when there is a draft group, and positions
    for the geometry's `max_model_len`."""
    groups = cache.geometry.groups
    kinds = list(
        dict.fromkeys(g.kind for g in groups if g.role == "target" and g.kind in LAYER_KINDS)
    )
    if not kinds:
        raise ValueError("the geometry has no full, sliding or recurrent target group")
    window = next((g.window for g in groups if g.window is not None), None)
    draft = any(g.stage is Stage.FULL and g.is_draft for g in groups)
    layers = kinds * 2 if len(kinds) <= 2 else kinds
    return ModelConfig(
        vocab_size=vocab_size,
        layer_types=tuple(layers),
        sliding_window=window,
        draft_head=draft,
        max_position_embeddings=max(DEFAULT_CONTEXT, max_model_len or 0),
    )


def check_model_fits(model: ModelConfig | Any, cache: CacheConfig) -> None:
    """Every group of the geometry must be used by a layer of the model: a group no layer
    writes would be allocated, hashed and reported as reused while holding nothing."""
    have = set(model.layer_types)
    for g in cache.geometry.groups:
        if g.is_draft:
            if g.stage is Stage.FULL and not model.draft_head:
                raise ValueError(
                    f"the geometry's {g.describe()} holds a drafter's KV, but the model has no "
                    "draft head; use a geometry without a draft group, or a model with one"
                )
        elif g.kind not in have:
            raise ValueError(
                f"the geometry has {g.describe()}, but the model has no {g.kind!r} layer "
                f"(its layers: {sorted(have)}); use a geometry with only those kinds"
            )


class LLM:
    def __init__(
        self,
        model: str | None = None,
        geometry: DeploymentSpec | None = None,
        *,
        num_blocks: int | None = None,
        enable_caching: bool = True,
        spec: str | None = None,
        num_spec_tokens: int | None = None,
        seed: int = 0,
        tokenizer: str | None = None,
        tiers: Sequence[tuple[TierSpec | SharedTier, TierBytes]] = (),
    ) -> None:
        """`model`: a directory with config.json and safetensors weights, kvreuse's tiny model
        or a Hugging Face checkpoint of a supported family (`kvreuse.engine.hf`); None: the
        seeded tiny model. `geometry`: a preset name, a TOML geometry file, a model directory
        or a `Deployment` (`kvreuse.deployment.resolve`); None: the Hugging Face model's own
        geometry (`kvreuse geometry from-model`), else `DEFAULT_GEOMETRY`. `num_blocks`
        overrides its cache size.

        Speculation: `spec` ("ngram" or "eagle") proposes `num_spec_tokens` drafts per decode
        step (default: the geometry's `num_spec_tokens`, else 3). A geometry that sets
        `num_spec_tokens` (the tiny-spec-* presets) speculates by default, with the model's
        draft head when it has one ("eagle"), else "ngram"; `num_spec_tokens=0` turns it off.

        `tiers`: memory below the cache, in order, each the core's `TierSpec` (or a
        `SharedTier` other LLMs list too) and the bytes that hold it (`kvreuse.engine.tiers`:
        `HostTier()`, `BytesTier(store)`, `BytesTier(RedisBytes(url))`); each `BytesTier` is
        bound to a namespace of the model and layout (kvreuse.engine.store); docs/tiers.md."""
        hf = model is not None and is_hf_model_dir(model)
        if geometry is None:
            geometry = model if hf and model is not None else DEFAULT_GEOMETRY
        dep = resolve(geometry)
        self.deployment = dep
        changes: dict[str, object] = {"enable_prefix_caching": enable_caching}
        if num_blocks is not None:
            check_num_blocks(num_blocks, "LLM(num_blocks=...)")
            changes["num_blocks"] = num_blocks
        cache = replace(dep.cache, **changes)  # type: ignore[arg-type]
        self.tokenizer = self._load_tokenizer(model, tokenizer)
        self.model: Model
        if model is None:
            # the embedded model's vocabulary is exactly its tokenizer's, so every id it
            # generates decodes to text
            config = default_model_config(cache, self.tokenizer.vocab_size, dep.max_model_len)
            self.model = TinyModel.random(config, seed)
            self.model_name = f"kvreuse-tiny-{dep.name}"
        else:
            self.model = load_hf_model(model) if hf else load_model(model)
            self.model_name = Path(model).name
        if self.tokenizer.vocab_size > self.model.config.vocab_size:
            raise ValueError(
                f"tokenizer vocab_size {self.tokenizer.vocab_size} exceeds the model's "
                f"{self.model.config.vocab_size}"
            )
        check_model_fits(self.model.config, cache)
        spec, num_spec_tokens = self._speculation(spec, num_spec_tokens, dep.sched.num_spec_tokens)
        weights = self.model.w if isinstance(self.model, TinyModel) else self.model.family.w
        if tiers:
            read = Path(model) / "config.json" if model is not None else self.model.config
            bind_tiers(tiers, model_identity(read, weights, "float32"))
        self.mgr = KVCacheManager(cache, tiers=[spec_ for spec_, _ in tiers])
        self.runner = ModelRunner(
            self.model, cache, spec=spec, seed=seed, tiers=[held for _, held in tiers]
        )
        self.runner.transfers.media = [t.spec.medium for t in self.mgr.tiers.tiers]
        self.runner.on_tier_faults = self.mgr.tier_faults
        self.scheduler = Scheduler(
            self.mgr, self.runner, replace(dep.sched, num_spec_tokens=num_spec_tokens)
        )
        limit = self.model.config.max_position_embeddings
        self.max_model_len = min(dep.max_model_len or limit, limit)
        self._ids = itertools.count()

    def _speculation(
        self, spec: str | None, num: int | None, dep_num: int
    ) -> tuple[str | None, int]:
        """(spec method, drafts per step) from the arguments and the geometry's default."""
        if spec is None and num is None and dep_num:
            spec = "eagle" if self.model.config.draft_head else "ngram"
        if spec is None:
            if num:
                raise ValueError("num_spec_tokens > 0 needs spec='ngram' or spec='eagle'")
            return None, 0
        if num is None:
            num = dep_num or 3
        return spec, num

    @staticmethod
    def _load_tokenizer(model: str | None, path: str | None) -> Tokenizer:
        if path is None and model is not None and (Path(model) / "tokenizer.json").is_file():
            path = str(Path(model) / "tokenizer.json")
        return HFTokenizer(path) if path is not None else ByteTokenizer()

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run the prompts to completion (continuous batching) and return them in order.

        `prompts`: a list of prompts (strings or token-id lists), or one prompt: a string, or
        a list of token ids (as vLLM's `generate` takes them)."""
        one = isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and bool(prompts) and all(type(t) is int for t in prompts)
        )
        batch: list[Any] = [prompts] if one else list(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(batch)
        if len(plist) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(plist)} SamplingParams")
        # every prompt is checked before any is queued: a bad one leaves nothing behind
        encoded = [self._encode(p, sp) for p, sp in zip(batch, plist, strict=True)]
        rids = [self._add(ids, sp) for ids, sp in zip(encoded, plist, strict=True)]
        while not all(self.scheduler.seqs[rid].finished for rid in rids):
            self.scheduler.step()
        too_large = [rid for rid in rids if self.scheduler.seqs[rid].finish_reason == "too_large"]
        if too_large:
            raise RuntimeError(
                f"{len(too_large)} prompt(s) cannot fit the cache even when it is empty "
                f"({self.mgr.config.num_blocks} blocks); raise num_blocks"
            )
        return [self._output(rid) for rid in rids]

    def _encode(self, prompt: Any, sp: Any) -> list[int]:
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(sp).__name__}")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) and all(type(t) is int for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError(
                f"a prompt is a string or a list of token ids (ints), got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError("empty prompt: a request needs at least one token")
        vocab = self.model.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {vocab})")
        if len(ids) + sp.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_tokens {sp.max_tokens} exceeds "
                f"max_model_len {self.max_model_len}"
            )
        return ids

    def _add(self, ids: list[int], sp: SamplingParams) -> str:
        rid = f"llm-{next(self._ids)}"
        self.scheduler.add(
            Request(rid, ids), sp.max_tokens, sampling=sp, stop_token_ids=sp.stop_token_ids
        )
        return rid

    def _output(self, rid: str) -> RequestOutput:
        seq: Seq = self.scheduler.seqs[rid]
        stats = seq.stats
        tokens, finish_reason = list(seq.output), seq.finish_reason or "length"
        text_ids = tokens[:-1] if finish_reason == "stop" else tokens
        return RequestOutput(
            request_id=rid,
            prompt_token_ids=list(seq.request.prompt_token_ids),
            token_ids=tokens,
            text=self.tokenizer.decode(text_ids),
            cached_tokens=stats.cached_tokens if stats else (seq.cached_tokens or 0),
            reason=stats.reason if stats else "",
            finish_reason=finish_reason,
        )
