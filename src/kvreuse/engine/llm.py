"""The offline API: `LLM(...).generate(prompts, params)`.

`LLM` wires a `KVCacheManager`, a `Scheduler` and a `ModelRunner` together for one geometry. A
server uses the same pieces directly: `llm.scheduler.add(Request(...), max_tokens,
sampling=SamplingParams)` and `llm.scheduler.step()`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from pathlib import Path

from kvreuse.core import CacheConfig, KVCacheManager, Request
from kvreuse.deployment import DeploymentSpec, resolve
from kvreuse.engine.checkpoint import load_model
from kvreuse.engine.config import LAYER_KINDS, ModelConfig
from kvreuse.engine.model import TinyModel
from kvreuse.engine.runner import ModelRunner
from kvreuse.engine.sampling import SamplingParams
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


def default_model_config(
    cache: CacheConfig, vocab_size: int = ByteTokenizer.vocab_size
) -> ModelConfig:
    """The seeded default model for a geometry: one layer per target group kind (twice when the
    geometry has at most two kinds), a draft head when there is a draft group."""
    groups = cache.geometry.groups
    kinds = list(
        dict.fromkeys(g.kind for g in groups if g.role == "target" and g.kind in LAYER_KINDS)
    )
    if not kinds:
        raise ValueError("the geometry has no full, sliding or recurrent target group")
    window = next((g.window for g in groups if g.kind == "sliding"), None)
    draft = any(g.kind == "full" and g.role == "draft" for g in groups)
    layers = kinds * 2 if len(kinds) <= 2 else kinds
    return ModelConfig(
        vocab_size=vocab_size, layer_types=tuple(layers), sliding_window=window, draft_head=draft
    )


class LLM:
    def __init__(
        self,
        model: str | None = None,
        geometry: DeploymentSpec = "tiny-hybrid-dcp4",
        *,
        num_blocks: int | None = None,
        enable_caching: bool = True,
        spec: str | None = None,
        num_spec_tokens: int = 0,
        seed: int = 0,
        tokenizer: str | None = None,
    ) -> None:
        """`geometry`: a preset name, a TOML geometry file or a `Deployment`
        (`kvreuse.deployment.resolve`); `num_blocks` overrides its cache size."""
        geo = resolve(geometry)
        changes: dict[str, object] = {"enable_prefix_caching": enable_caching}
        if num_blocks is not None:
            changes["num_blocks"] = num_blocks
        cache = replace(geo.cache, **changes)  # type: ignore[arg-type]
        self.tokenizer = self._load_tokenizer(model, tokenizer)
        if model is None:
            # the embedded model's vocabulary is exactly its tokenizer's, so every id it
            # generates decodes to text
            config = default_model_config(cache, self.tokenizer.vocab_size)
            self.model = TinyModel.random(config, seed)
            self.model_name = f"kvreuse-tiny-{geo.name}"
        else:
            self.model = load_model(model)
            self.model_name = Path(model).name
        if self.tokenizer.vocab_size > self.model.config.vocab_size:
            raise ValueError(
                f"tokenizer vocab_size {self.tokenizer.vocab_size} exceeds the model's "
                f"{self.model.config.vocab_size}"
            )
        if spec is None and num_spec_tokens:
            raise ValueError("num_spec_tokens > 0 needs spec='ngram' or spec='eagle'")
        if spec is not None and num_spec_tokens == 0:
            num_spec_tokens = 3
        self.mgr = KVCacheManager(cache)
        self.runner = ModelRunner(self.model, cache, spec=spec, seed=seed)
        self.scheduler = Scheduler(
            self.mgr, self.runner, replace(geo.sched, num_spec_tokens=num_spec_tokens)
        )
        limit = self.model.config.max_position_embeddings
        self.max_model_len = min(geo.max_model_len or limit, limit)
        self._ids = itertools.count()

    @staticmethod
    def _load_tokenizer(model: str | None, path: str | None) -> Tokenizer:
        if path is None and model is not None and (Path(model) / "tokenizer.json").is_file():
            path = str(Path(model) / "tokenizer.json")
        return HFTokenizer(path) if path is not None else ByteTokenizer()

    def generate(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run the prompts to completion (continuous batching) and return them in order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        rids = [self._add(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        while not all(self.scheduler.seqs[rid].finished for rid in rids):
            self.scheduler.step()
        too_large = [rid for rid in rids if self.scheduler.seqs[rid].finish_reason == "too_large"]
        if too_large:
            raise RuntimeError(
                f"{len(too_large)} prompt(s) cannot fit the cache even when it is empty "
                f"({self.mgr.config.num_blocks} blocks); raise num_blocks"
            )
        return [self._output(rid) for rid in rids]

    def _add(self, prompt: str | list[int], sp: SamplingParams) -> str:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("empty prompt: a request needs at least one token")
        if len(ids) + sp.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_tokens {sp.max_tokens} exceeds "
                f"max_model_len {self.max_model_len}"
            )
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
