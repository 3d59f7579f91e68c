"""`ModelRunner`: the engine callable the Scheduler drives (spec §9.7, E1–E6).

For each sealed step:

    1. run every Copy of the step (E1), before any write
    2. per request: tokens [start, min(end, N)) + proposed drafts for [N, end)
       forward through the paged context (E2: KV only at [start, end) of its own tables)
    3. prefill chunk (end < N): T' = end, no token
       otherwise sample at N-1, N, ... while the sample equals the draft there:
       T' = N + accepted (E4); the new tokens are the accepted drafts plus one
    4. recurrent layers: live <- state after T' tokens, saves at positions <= T' (E3, E6);
       states after rejected drafts exist only in memory and are dropped
    5. EAGLE: draft-head KV at [start, T') from (h_t, true token t+1) (E5); its prediction at
       T'-1 is the first draft of the next step

Nothing is published here: the core publishes at commit, from T' and the saved positions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvreuse.core import CacheConfig, RequestPlan, StepPlan, TierOp
from kvreuse.engine.model import Model
from kvreuse.engine.paged import PagedCache, PagedContext
from kvreuse.engine.sampling import GREEDY, SamplingParams, sample
from kvreuse.engine.tiers import TierBytes, Transfers, run_tier_ops

SPEC_METHODS = (None, "ngram", "eagle")


def ngram_propose(tokens: list[int], k: int, max_n: int = 3, search: int = 1024) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the longest suffix n-gram
    (n <= max_n) within the last `search` tokens and propose the k tokens that followed it."""
    lo = max(0, len(tokens) - search)
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, lo - 1, -1):
            if tokens[i : i + n] == suffix:
                cont = tokens[i + n : i + n + k]
                return (cont + [cont[-1]] * k)[:k]
    return [tokens[-1]] * k


@dataclass(slots=True)
class _DraftState:
    position: int  # T' of the step that produced it: the next step starts here
    hidden: Tensor  # the head's predicted hidden at `position`, [1, hidden]
    token: int  # its proposal for token position + 1


class ModelRunner:
    def __init__(
        self,
        model: Model,
        cache: CacheConfig,
        *,
        spec: str | None = None,
        seed: int = 0,
        num_threads: int | None = 1,
        tiers: Sequence[TierBytes] = (),
    ) -> None:
        if spec not in SPEC_METHODS:
            raise ValueError(f"spec must be one of {SPEC_METHODS}, got {spec!r}")
        if num_threads is not None:
            # tiny matrices: intra-op threads cost more than they save (ms per op on 2 cores)
            torch.set_num_threads(num_threads)
        self.model = model
        self.cache = PagedCache(cache, model.config, torch.float32)
        self.tiers = list(tiers)  # the bytes of the core's tiers, in the same order
        # where a tier op's misses go (`LLM` gives the core's `tier_faults`)
        self.on_tier_faults: Callable[..., list[str]] | None = None
        self.num_tier_misses = 0
        self.transfers = Transfers([""] * len(self.tiers))  # `LLM` names the media
        if spec == "eagle" and "draft" not in self.cache.layer_group:
            raise ValueError(
                "spec='eagle' needs a model with a draft head and a geometry with a full "
                "group of role 'draft' for its KV (e.g. preset tiny-spec-drop)"
            )
        self.spec = spec
        self.seed = seed
        self.record_logits = False  # tests: keep the logits row behind every emitted token
        self.logits_log: dict[str, list[Tensor]] = {}
        self.drafts_log: dict[str, list[list[int]]] = {}
        self.num_forward_tokens = 0
        self.num_drafted = 0
        self.num_accepted = 0
        self._gens: dict[str, torch.Generator] = {}
        self._drafts: dict[str, _DraftState] = {}

    def run_tier_ops(self, ops: Sequence[TierOp]) -> set[str]:
        """Tier ops, in order (a step's, or a commit's write-through copies between steps);
        what they could not do goes to `on_tier_faults` (the core's `tier_faults`), which
        returns the requests whose loads failed."""
        faults = run_tier_ops(ops, self.tiers, self.cache, self.transfers)
        if not faults:
            return set()
        self.num_tier_misses += sum(faults.reasons.values())
        if self.on_tier_faults is None:
            raise RuntimeError(f"tier ops failed ({dict(faults.reasons)}) with no core to tell")
        return set(self.on_tier_faults(faults.slots, faults.blocks))

    def __call__(self, step: StepPlan, seqs: Mapping[str, Any]) -> list[tuple[Any, ...] | None]:
        """Run the step; one outcome per plan, in the step's order (what `commit_batch` takes):
        None for a request whose loads failed (the core sent it back to wait; its forward
        would read blocks without their bytes, so it does not run)."""
        for rid in [r for r in self._gens if r not in seqs or seqs[r].finished]:
            self._gens.pop(rid, None)
            self._drafts.pop(rid, None)
        failed = self.run_tier_ops(step.tier_ops) if step.tier_ops else set()
        for c in step.copies:  # E1: all copies before any write of the step
            self.cache.copy(c)
        return [
            None if plan.request_id in failed else self._run(plan, seqs[plan.request_id])
            for plan in step.requests
        ]

    def _run(self, plan: RequestPlan, seq: Any) -> tuple[int, list[int], list[int]]:
        rid = plan.request_id
        tokens = [*seq.request.prompt_token_ids, *seq.output]
        num = len(tokens)
        k = max(0, plan.end - num)
        drafts = self._propose(plan, rid, tokens, k) if k else []
        if self.record_logits and drafts:
            self.drafts_log.setdefault(rid, []).append(drafts)
        ids = torch.tensor(tokens[plan.start : min(plan.end, num)] + drafts, dtype=torch.long)
        pos = torch.arange(plan.start, plan.end)
        want = {plan.end} | {s.position for s in plan.saves} | set(range(num, plan.end + 1))
        ctx = PagedContext(self.cache, plan, pos, want)
        hidden = self.model.forward(ids, pos, ctx)
        self.num_forward_tokens += plan.num_new_tokens
        if plan.end < num:  # a prefill chunk: nothing is sampled
            t_new, new = plan.end, []
        else:
            new = self._verify(seq, hidden[num - 1 - plan.start :], drafts)
            t_new = num + len(new) - 1
        saved = ctx.finish(t_new)
        if self.spec == "eagle":
            self._draft_after(plan, hidden, tokens + new, t_new)
        return t_new, new, saved

    def _verify(self, seq: Any, hidden: Tensor, drafts: list[int]) -> list[int]:
        """Sample position by position; stop after the first sample that differs from the
        draft there (or after the bonus token when every draft matched)."""
        rid = seq.request_id
        params: SamplingParams = seq.sampling if seq.sampling is not None else GREEDY
        gen = self._gens.get(rid)
        if gen is None:
            gen = self._gens[rid] = torch.Generator().manual_seed(self._seed_for(rid, params))
        rows = self.model.logits(hidden)
        new: list[int] = []
        for i in range(len(drafts) + 1):
            tok = sample(rows[i], params, gen)
            new.append(tok)
            if self.record_logits:
                self.logits_log.setdefault(rid, []).append(rows[i].clone())
            if i == len(drafts) or tok != drafts[i]:
                break
        self.num_drafted += len(drafts)
        self.num_accepted += len(new) - 1
        return new

    def _seed_for(self, rid: str, params: SamplingParams) -> int:
        if params.seed is not None:
            return params.seed
        digest = hashlib.blake2b(f"{self.seed}/{rid}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") >> 1

    # ------------------------------------------------------------------ drafts
    def _propose(self, plan: RequestPlan, rid: str, tokens: list[int], k: int) -> list[int]:
        st = self._drafts.get(rid)
        if self.spec != "eagle" or st is None or st.position != plan.start:
            return ngram_propose(tokens, k)
        out, hidden = [st.token], st.hidden
        for i in range(1, k):  # head at position start+i-1 with (predicted hidden, last draft)
            pos = torch.tensor([plan.start + i - 1])
            ctx = PagedContext(self.cache, plan, pos, set())
            nxt = torch.tensor([out[-1]], dtype=torch.long)
            hidden = self.model.draft_forward(hidden, nxt, pos, ctx)
            out.append(int(torch.argmax(self.model.logits(hidden)[0])))
        return out

    def _draft_after(
        self, plan: RequestPlan, hidden: Tensor, tokens: list[int], t_new: int
    ) -> None:
        """E5: build the head's KV at every newly committed position t from the true token t+1;
        its output at t_new - 1 proposes token t_new + 1 for the next step."""
        n = t_new - plan.start
        pos = torch.arange(plan.start, t_new)
        nxt = torch.tensor(tokens[plan.start + 1 : t_new + 1], dtype=torch.long)
        out = self.model.draft_forward(
            hidden[:n], nxt, pos, PagedContext(self.cache, plan, pos, set())
        )
        tok = int(torch.argmax(self.model.logits(out[-1])))
        self._drafts[plan.request_id] = _DraftState(t_new, out[-1:].clone(), tok)
