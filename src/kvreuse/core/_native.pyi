# Types of the optional C kernels (the sources are in _csrc/; the loader is native.py).
from array import array
from collections.abc import Iterable, Iterator, Sequence

SOURCE_SHA256: str
SHA256_BACKEND: str
SHA256_LIBRARY: str

def sha256(data: bytes, portable: bool = ..., /) -> bytes: ...
def sha256_units(
    parent: bytes,
    pre: bytes,
    mid: bytes,
    la_hdr: bytes,
    tail: bytes,
    tokens: Sequence[int],
    first: int,
    num_units: int,
    unit: int,
    lookahead: int,
    portable: bool = ...,
    /,
) -> list[bytes]: ...
def lru_pop_many(nxt: array[int], prv: array[int], inq: bytearray, count: int, /) -> list[int]: ...
def lru_link(
    nxt: array[int],
    prv: array[int],
    inq: bytearray,
    unkeyed: Sequence[int],
    keyed: Sequence[int],
    /,
) -> None: ...

class BlockTable:
    """The pool's per-block state, bound by name for the kernels (_csrc/table.c)."""

    def __init__(
        self,
        ref: array[int],
        group: array[int],
        b1: array[int],
        key1: list[bytes | None],
        more: dict[int, list[tuple[int, bytes]]],
        index: list[dict[bytes, int]],
    ) -> None: ...

def ref_adopt(table: BlockTable, blocks: Iterable[int], /) -> list[int]: ...
def release_refs(
    table: BlockTable, ordered: Iterable[int], /
) -> tuple[list[int], list[int]] | None: ...
def publish_keys(
    table: BlockTable,
    group_id: int,
    blocks: Sequence[int],
    keys: Sequence[bytes],
    boundaries: Sequence[int],
    /,
) -> tuple[list[int], list[bytes]]: ...
def evict_keys(
    table: BlockTable,
    blocks: Iterable[int],
    group_id: int,
    ref_count: int,
    ghost: Ghost,
    rows: bool,
    /,
) -> tuple[list[tuple[int, bytes, int]] | None, int, int]: ...

class Ghost:
    """ghost.GhostRecord's interface, in C (_csrc/ghost.c)."""

    def __init__(self, num_groups: int, capacity: int) -> None: ...
    @property
    def capacity(self) -> int: ...
    def __len__(self) -> int: ...
    def __contains__(self, item: object) -> bool: ...
    def __iter__(self) -> Iterator[tuple[int, bytes]]: ...
    def contains(self, group_id: int, key: bytes, /) -> bool: ...
    def add(self, group_id: int, key: bytes, boundary: int, /) -> None: ...
    def add_many(self, evicted: Iterable[tuple[int, bytes, int]], /) -> None: ...
    def discard(self, group_id: int, key: bytes, /) -> None: ...
    def discard_many(self, group_id: int, keys: Sequence[bytes], /) -> None: ...
    def clear(self) -> None: ...
    def entries(self) -> list[tuple[int, int, bytes]]: ...
