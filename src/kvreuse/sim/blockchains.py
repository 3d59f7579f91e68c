"""The chain digests of a trace's `blocks` prompts, hashed once per distinct block path.

A block's tokens are a fixed function of its id (`kvreuse.sim.workload.block_tokens`), so the
digest of a unit that ends inside block j of a prompt (with lookahead: whose unit plus its L
successors ends there) depends only on the ids of blocks 0 … j, the block size and the
request's extra keys: on its block path. Prompts of a trace share long block paths (a system
prompt, a conversation's history), and hashing each request's prompt from its tokens hashed those
units again for every request.

`BlockChains` walks the workload once, before the run, and counts per block path the requests
that will read it. A request's prompt then takes the digests of its leading complete blocks from
the paths already hashed, and hashes only the paths no request hashed before it (through the
replica's own hasher, so the digests are the ones its tokens give). A path's digests are kept
while a request that will read it has not arrived, and dropped when its last reader has them:
what is held follows the requests not yet read, not the trace's length. The core takes the digests
as `Request.prefix_hashes` and hashes the units after them from the tokens (none, when the
prompt had a block to hash here: its chain is then hashed to the end in the same pass).

Only a prompt that starts with a `blocks` part takes part (`{"blocks": …}`, or a `concat` whose
first part is one); its cut last block and whatever follows the blocks are never filed (they are
the request's own).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvreuse.core.spi import Hasher
from kvreuse.sim.workload import WorkloadRequest


def leading_blocks(prompt: Any) -> Mapping[str, Any] | None:
    """The `blocks` value a prompt starts with, or None."""
    kind, value = next(iter(prompt.items()))
    if kind == "concat":
        kind, value = next(iter(value[0].items()))
    return value if kind == "blocks" else None


class BlockChains:
    """Digests of block paths for the requests of one workload (see the module docstring).

    A path is a node: `_nodes` maps (parent node, block id), packed in one int, to the node, and
    `_readers[node]` counts the requests still to read it. Roots are per block size and extra
    keys (LoRA, salt), since those change every digest."""

    def __init__(self, hasher: Hasher, workload: Sequence[WorkloadRequest]) -> None:
        self.hasher = hasher
        self._roots: dict[tuple[Any, ...], int] = {}
        self._nodes: dict[int, int] = {}
        self._readers: list[int] = []
        self._digests: dict[int, tuple[bytes, ...]] = {}  # node → its units, while read later
        self.num_hashed_blocks = 0  # paths hashed here, each once
        self.num_reused_blocks = 0  # complete blocks whose digests came from an earlier request
        readers = self._readers
        for w in workload:
            blocks = leading_blocks(w.prompt)
            if blocks is not None:
                for _, node in self._path(w, blocks, create=True):
                    readers[node] += 1

    def _path(
        self, w: WorkloadRequest, blocks: Mapping[str, Any], create: bool
    ) -> list[tuple[int, int]]:
        """(table key, node) of each of the prompt's complete leading blocks, in order."""
        size = blocks["block_tokens"]
        root_key = (size, w.lora, w.cache_salt)
        node = self._roots.get(root_key)
        if node is None:
            node = self._roots[root_key] = self._new_node()
        path, table = [], self._nodes
        for block_id in blocks["ids"][: blocks["len"] // size]:
            key = node << 32 | block_id
            child = table.get(key)
            if child is None:
                if not create:  # (every path was counted before the run)
                    raise KeyError(f"request {w.request_id!r} was not in the workload counted")
                child = table[key] = self._new_node()
            path.append((key, child))
            node = child
        return path

    def _new_node(self) -> int:
        self._readers.append(0)
        return len(self._readers) - 1

    def prefix(self, w: WorkloadRequest, tokens: Sequence[int]) -> list[bytes]:
        """H[1] … H[k] of request `w`'s prompt `tokens`: at least every unit that ends within
        its complete leading blocks (empty when its prompt has none), and the whole chain when
        some of those blocks had to be hashed (hashing on to the end costs no second pass).
        Each request asks once."""
        blocks = leading_blocks(w.prompt)
        if blocks is None:
            return []
        path = self._path(w, blocks, create=False)
        digests: list[bytes] = []
        held, known = self._digests, 0
        while known < len(path) and path[known][1] in held:
            digests += held[path[known][1]]
            known += 1
        self.num_reused_blocks += known
        if known < len(path):
            digests = self._hash(w, tokens, blocks["block_tokens"], path, known, digests)
        readers, table = self._readers, self._nodes
        for key, node in path:
            readers[node] -= 1
            if not readers[node]:  # its last reader: nobody asks for this path again
                held.pop(node, None)
                del table[key]
        return digests

    def _hash(
        self,
        w: WorkloadRequest,
        tokens: Sequence[int],
        size: int,
        path: list[tuple[int, int]],
        known: int,
        digests: list[bytes],
    ) -> list[bytes]:
        """The prompt's chain after the digests of blocks before `known`; keeps the units of
        each block from `known` on for the requests that read it later."""
        u, la = self.hasher.hash_unit, self.hasher.lookahead
        chain = self.hasher.chain(lora=w.lora, cache_salt=w.cache_salt)
        chain.adopt(digests)
        chain.extend(tokens)
        hashes, readers, held = chain.hashes, self._readers, self._digests
        for j in range(known, len(path)):
            node = path[j][1]
            if readers[node] > 1:  # a request after this one reads it
                lo = max(0, (j * size - la) // u)  # the units ending in block j: lo + 1 … hi
                hi = max(0, ((j + 1) * size - la) // u)
                held[node] = tuple(hashes[lo + 1 : hi + 1])
        self.num_hashed_blocks += len(path) - known
        del hashes[0]  # (the root: the chain is done with)
        return hashes

    @property
    def num_held(self) -> int:
        """Paths whose digests are held for a later reader."""
        return len(self._digests)

    @property
    def num_paths(self) -> int:
        """Paths that a request not yet run will read."""
        return len(self._nodes)
