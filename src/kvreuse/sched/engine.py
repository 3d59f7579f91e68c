"""Scripted stand-ins for a model engine, for simulation and tests.

`ScriptedEngine` runs one step the way a GPU engine does (prefill chunks sample nothing, a
decode step samples one token after the drafts it accepts, recurrent states are written at the
end of the step) and takes the rest as parameters: where tokens come from, which saves it
reports, how drafts are accepted. Every run of the same workload generates the same tokens.

Token sources (`TokenSource`: the token at `position` of a sequence):

    PositionalTokens   a pure function of (request id, position): a fixed table read from
                       an offset per request (CRC-32 of the id)
    ContentTokens      a pure function of the tokens before the position (warm == cold)
    ReplayTokens       a recorded output, replayed token by token

`FakeEngine` is the simulator's and the scheduler tests' engine: positional tokens, drafts
accepted with a seeded rate, the save at T′ only.

An engine whose tokens depend on nothing but (request, position) also offers its script
(`decode_script()`): the same draws and tokens asked for directly, which is what lets the
scheduler's fast-forward (`kvreuse.sched.advance`) advance a request over many steps at once.
"""

from __future__ import annotations

import array
import functools
import hashlib
import random
import sys
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

from kvreuse.core import StepPlan
from kvreuse.sched.scheduler import Seq

SavePolicy = Literal["at_end", "up_to_end"]
SAVE_POLICIES: tuple[SavePolicy, ...] = ("at_end", "up_to_end")


class TokenSource(Protocol):
    def __call__(self, seq: Seq, position: int, new: Sequence[int]) -> int:
        """The token at `position` of `seq`; `new` holds the tokens this step already emitted
        before it (positions seq.num_tokens .. position − 1: non-empty after accepted drafts)."""
        ...


POSITIONAL_PERIOD = 1 << 14  # positions of a request before its positional tokens repeat


@functools.cache
def _positional_table(vocab: int) -> array.array[int]:
    """SHAKE-128 words mod `vocab`, one per position of a period, written twice so that a
    run of up to a period is one slice wherever it starts."""
    words = array.array(
        "I", hashlib.shake_128(b"kvreuse/positional-tokens/").digest(4 * POSITIONAL_PERIOD)
    )
    if sys.byteorder != "little":
        words.byteswap()  # the same tokens on every machine
    table = array.array("I", (w % vocab for w in words))  # (no list of 65,536 ints on the way)
    return table + table


def token_at(request_id: str, position: int, vocab: int = 32000) -> int:
    """A stable pseudo-random token: word (CRC-32 of the id + position) mod the period of a
    fixed table (Python's hash() is salted). A request's tokens are the table read from its
    own offset, so a run of them is a slice."""
    offset = (zlib.crc32(request_id.encode()) + position) % POSITIONAL_PERIOD
    return _positional_table(vocab)[offset]


class PositionalTokens:
    """`token_at(request id, position)`: independent of the content, so cheap and reproducible."""

    positional = True  # a pure function of (request id, position): `run` may be asked instead

    def __init__(self, vocab: int = 32000) -> None:
        self.vocab = vocab

    def __call__(self, seq: Seq, position: int, new: Sequence[int]) -> int:
        return token_at(seq.request_id, position, self.vocab)

    def run(self, request_id: str, start: int, stop: int) -> list[int]:
        """The tokens at positions [start, stop): `token_at` of each, as slices of the table."""
        table, period = _positional_table(self.vocab), POSITIONAL_PERIOD
        offset = (zlib.crc32(request_id.encode()) + start) % period
        out: list[int] = []
        while stop - start > period:  # (a run longer than the period: whole periods first)
            out += table[offset : offset + period].tolist()
            start += period
        out += table[offset : offset + stop - start].tolist() if stop > start else []
        return out


class ContentTokens:
    """A lowercase ASCII letter (never end-of-sequence) hashed from the number of tokens before
    the position and the last 64 of them: a warm request answers exactly like a cold one, as
    greedy decoding of a real model does, and the text stays readable."""

    def __call__(self, seq: Seq, position: int, new: Sequence[int]) -> int:
        prompt, output = seq.request.prompt_token_ids, seq.output
        # the last 64 tokens of prompt + output + new, without copying the whole sequence
        tail = [*prompt[-64:], *output[-64:], *new[-64:]][-64:]
        length = len(prompt) + len(output) + len(new)
        text = f"{length}/{','.join(map(str, tail))}"
        digest = hashlib.blake2b(text.encode(), digest_size=4).digest()
        return 97 + int.from_bytes(digest, "big") % 26


class ReplayTokens:
    """Replays `outputs[request id]`: the k-th generated token is the k-th recorded one."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[int]] = {}

    def __call__(self, seq: Seq, position: int, new: Sequence[int]) -> int:
        return self.outputs[seq.request_id][len(seq.output) + len(new)]


class ScriptedEngine:
    """A deterministic engine: `tokens` says what is sampled, `saves` which saves are reported.

    saves="at_end": only the save at T′, as an engine that writes recurrent states at the end of
    a step reports them (spec §9.7, E6); "up_to_end": every save at or below T′.
    Drafts a step verifies are accepted one by one with probability `accept_rate`, from a
    generator seeded by (seed, request, position); at 0 every draft is rejected.

    It replaces three engines that shared this loop and differed only here:

    * the simulator's `FakeEngine`: positional tokens (vocab 32000), drafts accepted at a seeded
      rate (DRAFT_ACCEPT_RATE by default), the save at T′ only;
    * the fake server backend's engine: content tokens (letters), every draft rejected, the save
      at T′ only;
    * qualify's shadow replay: the server's recorded tokens, every draft rejected, every save at
      or below T′ reported, and no count of forward tokens (all three count them now; nothing
      read the shadow's).
    """

    def __init__(
        self,
        tokens: TokenSource,
        saves: SavePolicy = "at_end",
        accept_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= accept_rate <= 1.0:
            raise ValueError(f"accept_rate must be in [0, 1], got {accept_rate}")
        if saves not in SAVE_POLICIES:
            raise ValueError(f"saves must be one of {', '.join(SAVE_POLICIES)}, got {saves!r}")
        self.tokens = tokens
        self.saves = saves
        self.accept_rate = accept_rate
        self.seed = seed
        self.num_forward_tokens = 0

    def __call__(self, step: StepPlan, seqs: Mapping[str, Seq]) -> list[tuple[Any, ...]]:
        """One outcome per plan, in the step's order (what `commit_batch` takes)."""
        out: list[tuple[Any, ...]] = []
        tokens, at_end = self.tokens, self.saves == "at_end"
        for plan in step.requests:
            rid = plan.request_id
            seq = seqs[rid]
            num = seq.num_tokens
            end = plan.start + plan.num_new_tokens
            self.num_forward_tokens += plan.num_new_tokens
            if end == num and not plan.saves:  # most plans: a decode step, one token sampled
                out.append((num, [tokens(seq, num, ())], []))
                continue
            new: list[int]
            if end < num:  # a prefill chunk: no token is sampled
                t_new, new = end, []
            elif end == num:
                t_new, new = num, [tokens(seq, num, ())]
            else:  # decode with drafts: accept a prefix of them, then sample one more
                t_new, new = num + self.accepted(rid, num, end - num), []
                for p in range(num, t_new + 1):
                    new.append(tokens(seq, p, new))
            if not plan.saves:
                saved = []
            elif at_end:
                saved = [s.position for s in plan.saves if s.position == t_new]
            else:
                saved = [s.position for s in plan.saves if s.position <= t_new]
            out.append((t_new, new, saved))
        return out

    def accepted(self, rid: str, num: int, drafts: int) -> int:
        """Drafts accepted by the step of request `rid` that starts with `num` known tokens and
        verifies `drafts`: its own generator, seeded by (seed, request, num), so the draw is
        the same whenever and in whatever order it is asked for."""
        if self.accept_rate == 0.0:
            return 0  # what the seeded draws would give, without drawing them
        rng = random.Random(f"{self.seed}/{rid}/{num}")
        accepted = 0
        while accepted < drafts and rng.random() < self.accept_rate:
            accepted += 1
        return accepted

    # ------------------------------------------------------------------ the decode script
    def decode_script(self) -> ScriptedEngine | None:
        """This engine as a `DecodeScript` when its tokens are a pure function of (request,
        position), so a request's tokens over many steps can be asked for at once; else None."""
        return self if getattr(self.tokens, "positional", False) else None

    def token_run(self, request_id: str, start: int, stop: int) -> list[int]:
        """The tokens this engine samples at positions [start, stop) of `request_id` (only
        with positional tokens: see `decode_script`)."""
        source: Any = self.tokens
        tokens: list[int] = source.run(request_id, start, stop)
        return tokens

    def record(
        self, num_forward_tokens: int, num_saved_states: int, num_prefill_chunks: int = 0
    ) -> None:
        """A step the fast-forward ran without calling the engine: count its forward tokens
        (saved states and chunks are the cost meter's, when one wraps this engine)."""
        self.num_forward_tokens += num_forward_tokens


class DecodeScript(Protocol):
    """What the fast-forward asks of an engine instead of running a step through it: the
    draws and tokens the engine would produce (`ScriptedEngine` with positional tokens)."""

    saves: SavePolicy

    def accepted(self, rid: str, num: int, drafts: int) -> int: ...

    def token_run(self, request_id: str, start: int, stop: int) -> list[int]: ...

    def record(
        self, num_forward_tokens: int, num_saved_states: int, num_prefill_chunks: int = 0
    ) -> None: ...


# The share of draft tokens the simulator's engine accepts unless told otherwise
# (`--draft-accept-rate`).
DRAFT_ACCEPT_RATE = 0.7


class FakeEngine(ScriptedEngine):
    """The simulator's engine: positional tokens, drafts accepted at `accept_rate` (seeded), the
    save at T′ only."""

    def __init__(
        self, accept_rate: float = DRAFT_ACCEPT_RATE, seed: int = 0, vocab: int = 32000
    ) -> None:
        super().__init__(PositionalTokens(vocab), "at_end", accept_rate, seed)
        self.vocab = vocab
