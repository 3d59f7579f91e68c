"""Eviction policies (spec §11.2, §11.4): the protocol, the batch order, and the default LRU.

Every policy is built the same way: `policy_factory(cfg.eviction_policy)` is a factory called
with the pool (its `PoolView`); the name "lru" names `LRUPolicy.for_pool`. A policy says what it
reads: `reads_release_seq = False` spares the pool its per-block batch numbers (the LRU's
choice; a policy that does not say is assumed to read them). The order in which a release
batch reaches every policy (`batch_order`) is defined here once; the pool's C kernel sorts by
the same key. The pool's kernels call the policy only once the counts of an operation are final,
so they run under every policy.

The LRU queue is a doubly linked list threaded through two flat integer arrays, so it allocates
no Python object per block and removes from the middle in O(1). Block 0 is the null block; it is
never queued, so it doubles as the list's sentinel:

    nxt[0] = head ─► a ─► b ─► c ─► 0        (pop takes the head: the coldest block)
    prv[0] = tail ◄─ ...                     (keyed blocks are appended at the tail)
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from kvreuse.core import native


@runtime_checkable
class PoolView(Protocol):
    """Read-only metadata a policy may consult at any time (spec §11.4)."""

    def ref_count(self, block_id: int) -> int: ...
    def group_id(self, block_id: int) -> int | None: ...
    def keys(self, block_id: int) -> list[tuple[int, str]]: ...
    def release_seq(self, block_id: int) -> int: ...


@runtime_checkable
class EvictionPolicy(Protocol):
    """Orders the blocks whose reference count is 0.

    Contract: deterministic; never returns a block that is in use; O(1) (at worst O(log n)) per
    call; must not call back into the manager.
    """

    def release(self, unkeyed: Sequence[int], keyed: Sequence[int]) -> None:
        """Queue one release batch, each list already in the order of spec §11.2."""

    def remove(self, block_id: int) -> None:
        """Take a queued block out (it was adopted by a hit)."""

    def pop(self) -> int:
        """The next block to hand out. Raises IndexError when empty."""

    def pop_many(self, count: int) -> list[int]:
        """The next `count` blocks, in the order `pop` would hand them out.

        Optional for a custom policy: the pool falls back to `pop` × count (see
        `pop_many_of`). A policy that can unlink a run at once defines it, because the pool
        takes every page of an admission in one call.
        """
        return [self.pop() for _ in range(count)]

    def __len__(self) -> int: ...
    def __contains__(self, block_id: object) -> bool: ...


def batch_order(keyed: list[int], b1: Sequence[int], group: Sequence[int], multi: bool) -> None:
    """Sort a release batch's keyed blocks into spec §11.2's tail order, in place: decreasing
    highest boundary (`b1`), then ascending group (when the pool has several), then ascending
    id; so within one chain the suffix is evicted before the prefix. Three stable C-level sorts,
    least significant first (reverse=True keeps ties stable)."""
    if len(keyed) > 1:
        keyed.sort()
        if multi:
            keyed.sort(key=group.__getitem__)
        keyed.sort(key=b1.__getitem__, reverse=True)


def policy_factory(spec: str | Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The factory(pool_view) that builds the policy `spec` names (config checked the name)."""
    return POLICIES[spec] if isinstance(spec, str) else spec


def pop_many_of(policy: Any) -> Callable[[int], list[int]]:
    """`policy.pop_many`, or `pop` × count for a policy that does not define it."""
    bound = getattr(policy, "pop_many", None)
    if callable(bound):
        return bound
    return _PopEach(policy)


class _PopEach:
    """`pop` × count, as an object holding its policy (not a closure): a deep copy or a pickle
    of the pool then pops from the copy's own policy."""

    __slots__ = ("policy",)

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    def __call__(self, count: int) -> list[int]:
        pop = self.policy.pop
        return [pop() for _ in range(count)]


class LRUPolicy:
    """The normative default: unkeyed blocks at the head (reused first), keyed at the tail.

    `release` and `pop_many` run as C kernels on the same arrays when the native path is
    active (`native.ext`, read once here); the Python loops below are the reference.
    """

    __slots__ = ("_inq", "_k_link", "_k_pop", "_len", "_nxt", "_prv")
    reads_release_seq = False  # the queue itself is the order: no batch numbers needed

    def __init__(self, num_blocks: int) -> None:
        self._nxt = array("i", bytes(4 * num_blocks))
        self._prv = array("i", bytes(4 * num_blocks))
        self._inq = bytearray(num_blocks)
        self._len = 0
        # the kernels themselves, not the module: a manager stays deep-copyable and picklable
        k = native.ext
        self._k_link = k.lru_link if k is not None else None
        self._k_pop = k.lru_pop_many if k is not None else None

    @classmethod
    def for_pool(cls, pool: PoolView) -> LRUPolicy:
        """The factory config's "lru" names: a queue sized to the pool."""
        return cls(pool.num_blocks)  # type: ignore[attr-defined]  # BlockPool's count

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block_id: object) -> bool:
        return (
            isinstance(block_id, int)
            and 0 < block_id < len(self._inq)
            and bool(self._inq[block_id])
        )

    def release(self, unkeyed: Sequence[int], keyed: Sequence[int]) -> None:
        if self._k_link is not None:
            self._k_link(self._nxt, self._prv, self._inq, unkeyed, keyed)
        else:
            self._link(unkeyed, keyed)
        self._len += len(unkeyed) + len(keyed)

    def _link(self, unkeyed: Sequence[int], keyed: Sequence[int]) -> None:
        nxt, prv, inq = self._nxt, self._prv, self._inq
        if unkeyed:
            # Splice the run [u0, u1, …] in front of the current head, preserving its order.
            old_head = nxt[0]
            prev = 0
            for b in unkeyed:
                nxt[prev] = b
                prv[b] = prev
                inq[b] = 1
                prev = b
            nxt[prev] = old_head
            prv[old_head] = prev
        if keyed:
            # Link the run [k0, k1, …] among itself, then splice it after the current tail.
            prev = prv[0]
            for b in keyed:
                nxt[prev] = b
                prv[b] = prev
                inq[b] = 1
                prev = b
            nxt[prev] = 0
            prv[0] = prev

    def remove(self, block_id: int) -> None:
        nxt, prv = self._nxt, self._prv
        a, b = prv[block_id], nxt[block_id]
        nxt[a] = b
        prv[b] = a
        self._inq[block_id] = 0
        self._len -= 1

    def pop(self) -> int:
        head = self._nxt[0]
        if head == 0:
            raise IndexError("pop from an empty free queue")
        self.remove(head)
        return head

    def pop_many(self, count: int) -> list[int]:
        """The next `count` blocks from the head, in order, unlinked as one run."""
        if count > self._len:
            raise IndexError(f"pop of {count} blocks from a free queue of {self._len}")
        if self._k_pop is not None:
            popped: list[int] = self._k_pop(self._nxt, self._prv, self._inq, count)
            self._len -= count
            return popped
        nxt, inq = self._nxt, self._inq
        out: list[int] = []
        b = nxt[0]
        for _ in range(count):
            out.append(b)
            inq[b] = 0
            b = nxt[b]
        nxt[0] = b
        self._prv[b] = 0
        self._len -= count
        return out

    def order(self) -> list[int]:
        """The queue from head to tail (tests and diagnostics)."""
        out: list[int] = []
        b = self._nxt[0]
        while b:
            out.append(b)
            b = self._nxt[b]
        return out


# The policies config accepts by name.
POLICIES: dict[str, Callable[[Any], Any]] = {"lru": LRUPolicy.for_pool}
