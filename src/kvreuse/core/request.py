"""Requests as the caller describes them, and the manager's per-request bookkeeping."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

from kvreuse.core.encoding import TOKEN_TYPECODE
from kvreuse.core.hashing.chain import Chain
from kvreuse.core.hashing.hasher import Hasher
from kvreuse.core.plan import RecurrentSlot, RequestPlan

MAX_TOKEN = 2**32


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """A multimodal placeholder: `identifier` must identify the item's content (e.g. a digest)."""

    identifier: str | bytes
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, str | bytes):
            raise TypeError(f"MultiModalItem.identifier must be str or bytes: {self.identifier!r}")
        for name in ("offset", "length"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"MultiModalItem.{name} must be an int ≥ 0, got {v!r}")


@dataclass(frozen=True, slots=True)
class Request:
    """What `add_request` registers (spec §3)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    lora: tuple[str, str] | None = None
    mm_items: Sequence[MultiModalItem] = ()
    cache_salt: str | None = None
    skip_read: bool = False
    # H[1] … H[k] of this prompt's chain, hashed before by a hasher of the same configuration
    # with the same extra keys (a simulator's shared trace blocks, a router's chain): trusted,
    # so the prompt is hashed only past them, unless the manager was built to check them
    # (`check_prefix_hashes`). k may not exceed the prompt's units.
    prefix_hashes: Sequence[bytes] = ()


# Unsigned array typecodes of at most 4 bytes: every element is an int in [0, 2^32) by type.
_TRUSTED_CODES = frozenset(c for c in "BHIL" if array(c).itemsize <= 4)


def check_tokens(token_ids: Sequence[int], what: str) -> list[int]:
    """Validate token ids (ints, not bools, in [0, 2^32)) and return them as a list.

    An ``array.array`` of unsigned elements of at most 4 bytes (typecode 'B', 'H' or 'I') is
    valid by its type and is converted without a per-element check (docs/decisions.md D14).
    """
    if type(token_ids) is array and token_ids.typecode in _TRUSTED_CODES:
        return token_ids.tolist()
    tokens = list(token_ids)
    if not tokens:
        return tokens
    # Fast path in C: every element exactly an int (bools excluded), and a 4-byte unsigned
    # array accepts them all (it raises on anything outside [0, 2^32)).
    if set(map(type, tokens)) == {int}:
        try:
            array(TOKEN_TYPECODE).fromlist(tokens)
            return tokens
        except OverflowError:
            pass  # the loop below names the offending token
    for i, t in enumerate(tokens):
        if type(t) is not int or not 0 <= t < MAX_TOKEN:
            raise ValueError(f"{what}: token {i} is {t!r}; token ids must be ints in [0, 2**32)")
    return tokens


def token_array(token_ids: Sequence[int], what: str) -> array[int]:
    """`check_tokens` into a fresh 4-byte unsigned array (the caller's sequence stays theirs).

    An unsigned array of at most 4-byte elements is copied in one C call, with no per-element
    check and no Python int per token (docs/decisions.md D14)."""
    if type(token_ids) is array and token_ids.typecode in _TRUSTED_CODES:
        return array(TOKEN_TYPECODE, token_ids)
    out = array(TOKEN_TYPECODE)
    out.fromlist(check_tokens(token_ids, what))
    return out


class Phase(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Deferral(StrEnum):
    """What waits for the request's oldest sealed step to settle (spec §10.6)."""

    FINISH = "finish"
    PREEMPT = "preempt"


class SavePurpose(StrEnum):
    """Why a recurrent state is saved (kvreuse.core.savepoints); a position planned for several
    purposes keeps the first listed."""

    ROLLING = "rolling"
    REPLAY = "replay"
    JUNCTION = "junction"
    DENSE = "dense"


class PlanParts(NamedTuple):
    """What every growth plan of a request repeats while no page changes: one shared copy, and
    `room`, the tokens its attention tables cover (a growth to `room` or below adds no page)."""

    tables: dict[int, list[int]]
    recurrent: dict[int, RecurrentSlot]
    new_blocks: dict[int, list[int]]
    room: int


@dataclass(eq=False, slots=True)
class RecurrentSlots:
    """A request's private state blocks in one recurrent group (spec §9.3)."""

    live: int = 0
    scratch: list[int] = field(default_factory=list)
    held: dict[int, int] = field(default_factory=dict)  # position -> block


@dataclass(eq=False, slots=True, kw_only=True)
class RequestState:
    """Everything the manager knows about one request.

    Its fields change only through the methods below (`tests/core/test_request_owner.py`
    checks that no module assigns them), so each change keeps what depends on it true: a
    change of `tables` drops the cached `plan_parts`, and the step fields move together."""

    request_id: str
    tokens: array[int]  # 4-byte unsigned: a tenth of a list's memory, hashed from its buffer
    prompt_len: int
    chain: Chain
    lora: tuple[str, str] | None
    mm_items: tuple[MultiModalItem, ...]
    skip_read: bool
    phase: Phase = Phase.WAITING
    committed: int = 0  # T
    scheduled: int = 0  # end of the last scheduled step
    hit: int = 0  # h of the current admission
    tables: dict[int, list[int]] = field(default_factory=dict)  # attention group -> pages
    window_lo: dict[int, int] = field(default_factory=dict)  # pages below are all NULL (10.5)
    # What growth plans share while no page changes; every change of `tables` drops it.
    plan_parts: PlanParts | None = None
    recurrent: dict[int, RecurrentSlots] = field(default_factory=dict)
    processed: dict[int, int] = field(default_factory=dict)  # d per attention group (10.3)
    planned: dict[int, dict[int, SavePurpose]] = field(default_factory=dict)  # gid -> {c: why}
    dense_from: int = 0  # dense positions above this are planned per step
    published_states: dict[int, list[int]] = field(default_factory=dict)  # I13
    # The step fields, moved by StepLedger: its open plan, its sealed unsettled steps (ids),
    # and a finish or preempt waiting for the oldest of them.
    open_plan: RequestPlan | None = None
    inflight: list[int] = field(default_factory=list)
    deferred: Deferral | None = None
    admissions: int = 0
    first_hit: int = 0
    first_reason: str = "not_admitted"
    first_tier_tokens: tuple[int, ...] = ()
    last_hit: int = 0
    last_reason: str = "not_admitted"

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    # ------------------------------------------------------------------ admission and release
    def admit(
        self,
        tables: dict[int, list[int]],
        recurrent: dict[int, RecurrentSlots],
        hit: int,
        processed: dict[int, int],
        planned: dict[int, dict[int, SavePurpose]],
        dense_from: int,
    ) -> None:
        """An admission with hit `hit` took these slots: the request runs, T = h (its plan,
        `open_step`, moves the scheduled end)."""
        self.tables, self.recurrent, self.plan_parts, self.window_lo = tables, recurrent, None, {}
        self.hit = self.committed = hit
        self.processed, self.planned, self.dense_from = processed, planned, dense_from
        self.published_states = {gid: [] for gid in recurrent} if recurrent else {}
        self.phase = Phase.RUNNING

    def note_admission(self, hit: int, reason: str, tier_tokens: tuple[int, ...] = ()) -> bool:
        """Record an admission's hit and reason; True for the first admission."""
        first = self.admissions == 0
        if first:
            self.first_hit, self.first_reason = hit, reason
            self.first_tier_tokens = tier_tokens
        self.admissions += 1
        self.last_hit, self.last_reason = hit, reason
        return first

    def unnote_admission(self) -> None:
        """The last admission delivered nothing (its tier loads failed): forget it."""
        self.admissions = max(0, self.admissions - 1)
        if self.admissions == 0:
            self.first_hit, self.first_reason, self.first_tier_tokens = 0, "not_admitted", ()

    def release(self, phase: Phase) -> None:
        """Every slot was given back (finish: FINISHED, preempt: WAITING with its tokens and
        hashes kept); the request is in no step."""
        self.tables, self.recurrent, self.planned = {}, {}, {}
        self.plan_parts = None
        self.processed, self.published_states = {}, {}
        self.committed = self.scheduled = self.hit = 0
        self.open_plan, self.inflight, self.deferred = None, [], None
        self.phase = phase

    # ------------------------------------------------------------------ growth and commit
    def add_pages(self, gid: int, blocks: list[int]) -> None:
        self.tables[gid].extend(blocks)
        self.plan_parts = None

    def keep_plan_parts(self, parts: PlanParts) -> None:
        self.plan_parts = parts

    def plan_dense(self, gid: int, positions: list[int]) -> None:
        planned = self.planned[gid]
        for c in positions:
            planned[c] = SavePurpose.DENSE

    def advance(self, t_new: int, tokens: list[int], lookahead: int, unit: int) -> None:
        """A commit: append its tokens (hashing the units they complete) and set T = T′; with
        nothing else in flight, the next step starts there."""
        if tokens:
            self.tokens.extend(tokens)
            if len(self.tokens) - lookahead >= (self.chain.num_units + 1) * unit:
                self.chain.extend(self.tokens)
        self.committed = t_new
        if not self.inflight:
            self.scheduled = t_new

    def mark_processed(self, gid: int, boundary: int) -> None:
        self.processed[gid] = boundary

    def free_window(self, gid: int, top: int) -> list[int]:
        """NULL the pages below `top` of group `gid`'s table (they left its window, 10.5);
        returns the blocks they held, highest page first."""
        row = self.tables[gid]
        top = min(top, len(row))
        lo = self.window_lo.get(gid, 0)
        # Every page below `lo` was freed (or never held) by an earlier commit: the scan covers
        # only what left the window since, not the whole table on every decode step.
        freed: list[int] = []
        for j in range(top - 1, lo - 1, -1):
            if row[j]:
                freed.append(row[j])
                row[j] = 0
        if top > lo:
            self.window_lo[gid] = top
            self.plan_parts = None  # the next plan's tables must show the freed pages
        return freed

    def hold(self, gid: int, position: int, block_id: int) -> None:
        """A valid rolling save: its pending reference becomes a held state."""
        self.recurrent[gid].held[position] = block_id

    def drop_held(self, gid: int, lo: int, hi: int) -> list[int]:
        """Forget the held states of group `gid` outside [lo, hi]; their blocks, newest first."""
        held = self.recurrent[gid].held
        return [held.pop(c) for c in sorted(held, reverse=True) if not lo <= c <= hi]

    def note_published_state(self, gid: int, position: int) -> None:
        self.published_states[gid].append(position)

    # ------------------------------------------------------------------ steps (StepLedger)
    def open_step(self, plan: RequestPlan, end: int) -> None:
        """`plan` joined the open step: the request is scheduled up to `end`."""
        self.open_plan = plan
        self.scheduled = end

    def withdraw_open(self) -> None:
        self.open_plan = None

    @staticmethod
    def enter_step(requests: Iterable[RequestState], step_id: int) -> None:
        """The open plans of `requests` were sealed into step `step_id` (one call a step)."""
        for req in requests:
            req.open_plan = None
            req.inflight.append(step_id)

    @staticmethod
    def leave_step(requests: Iterable[RequestState], step_id: int) -> None:
        """Step `step_id` of `requests` settled (one call a step)."""
        for req in requests:
            inflight = req.inflight
            if inflight and inflight[0] == step_id:  # steps settle oldest first: usually
                del inflight[0]
            elif step_id in inflight:
                inflight.remove(step_id)

    def defer(self, what: Deferral) -> None:
        self.deferred = what


def new_request_state(req: Request, hasher: Hasher, check_adopted: bool = False) -> RequestState:
    """Validate a `Request` and hash its prompt (the chain is then extended incrementally).
    `check_adopted`: hash the units `prefix_hashes` stands for as well, and refuse the request
    if they differ (a full pass over the prompt: what adopting them saves)."""
    rid = req.request_id
    if not isinstance(rid, str) or not rid:
        raise ValueError(f"request_id must be a non-empty str, got {rid!r}")
    tokens = token_array(req.prompt_token_ids, f"request {rid!r}: prompt_token_ids")
    if not tokens:
        raise ValueError(f"request {rid!r}: the prompt is empty; at least one token is needed")
    if req.cache_salt is not None and not isinstance(req.cache_salt, str):
        raise TypeError(f"request {rid!r}: cache_salt must be str or None, got {req.cache_salt!r}")
    lora = req.lora
    if lora is not None and (
        not isinstance(lora, tuple) or len(lora) != 2 or not all(isinstance(x, str) for x in lora)
    ):
        raise TypeError(f"request {rid!r}: lora must be (name: str, path: str), got {lora!r}")
    mm = tuple(req.mm_items)
    if not all(isinstance(m, MultiModalItem) for m in mm):
        raise TypeError(f"request {rid!r}: mm_items must be MultiModalItem instances")
    # Every extra key must encode (spec 5.3) before anything is registered: a lone surrogate
    # (valid in a Python str, not in UTF-8) would otherwise fail the commit that hashes unit 1.
    texts: list[tuple[str, object]] = [("cache_salt", req.cache_salt)]
    if lora is not None:
        texts += [("lora name", lora[0]), ("lora path", lora[1])]
    texts += [("multimodal identifier", m.identifier) for m in mm]
    for what, text in texts:
        if isinstance(text, str) and not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"request {rid!r}: {what} is not valid Unicode text: "
                    f"{text[exc.start : exc.end]!r} at index {exc.start} is a lone surrogate"
                ) from None
    try:  # types and ranges of the extra keys (kvreuse.core.hashing.keys)
        chain = hasher.chain(lora=lora, mm_items=mm, cache_salt=req.cache_salt)
    except (TypeError, ValueError) as exc:
        kind = TypeError if isinstance(exc, TypeError) else ValueError
        raise kind(f"request {rid!r}: {exc}") from None
    if req.prefix_hashes:
        _adopt(chain, req.prefix_hashes, len(tokens), rid)
    chain.extend(tokens)
    if req.prefix_hashes and check_adopted:
        fresh = hasher.chain(lora=lora, mm_items=mm, cache_salt=req.cache_salt)
        fresh.extend(tokens)
        _check_adopted(fresh, chain, rid)
    return RequestState(
        request_id=rid,
        tokens=tokens,
        prompt_len=len(tokens),
        chain=chain,
        lora=lora,
        mm_items=mm,
        skip_read=bool(req.skip_read),
    )


def _adopt(chain: Chain, hashes: Sequence[bytes], num_tokens: int, rid: str) -> None:
    """`Request.prefix_hashes` into a new chain. They are trusted (unless the manager checks
    them, `_check_adopted`): here only what costs no pass over them is checked (at most a digest
    per unit of the prompt; the first and the last are digests of the chain's size), since a
    pass would cost a good part of what they save."""
    t = chain.template
    most = max(0, (num_tokens - t.lookahead) // t.hash_unit)
    if len(hashes) > most:
        raise ValueError(
            f"request {rid!r}: prefix_hashes holds {len(hashes)} digests; the prompt has "
            f"{most} hash units"
        )
    size = len(t.root)
    if not all(type(h) is bytes and len(h) == size for h in (hashes[0], hashes[-1])):
        raise TypeError(
            f"request {rid!r}: prefix_hashes must be digests (bytes of {size}) of this "
            "manager's hasher"
        )
    chain.adopt(hashes)


def _check_adopted(fresh: Chain, chain: Chain, rid: str) -> None:
    """Refuse a chain whose adopted digests differ from `fresh`, the same prompt hashed from
    its tokens, naming the first that differs (H[k] is prefix_hashes[k − 1])."""
    for k, (mine, theirs) in enumerate(zip(chain.hashes, fresh.hashes, strict=True)):
        if mine != theirs:
            u = chain.template.hash_unit
            raise ValueError(
                f"request {rid!r}: prefix_hashes[{k - 1}] is not the digest of unit {k} (tokens "
                f"[{(k - 1) * u}, {k * u})) under this manager's hasher and the request's extra "
                "keys; hash the prefix with the same configuration and keys, or leave it out"
            )
