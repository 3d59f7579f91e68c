"""The routable mode: the attention group as a router that reads only that group should see it.

A router that indexes one attention group predicts, for a request, the longest run of leading
blocks it has seen published. On a hybrid that over-predicts whenever the attention KV is
resident but the rest of the model cannot resume there (no recurrent state at that boundary,
a sliding window not covered, a drafter's margin). This filter keeps its own exact copy of
every group's index, fed by the core's events, and asks the core's lookup, for each resident
attention entry at boundary k, whether a request sharing that prefix would reuse k tokens
(`routable`). It publishes an entry while the entry or one of its descendants is routable, so
the router's contiguous match can reach every routable boundary, and retracts it with
`BlockRemoved` as soon as neither holds any more (the state was evicted, for example).

What an unmodified router then predicts: for a request whose deepest routable boundary on its
path is r, and which matches published blocks up to m ≥ r, it predicts m. It is exact when m = r
(dense recurrent retention, pure attention, every boundary routable) and over-predicts by m − r
when the request diverges between two routable boundaries of a longer published chain. In drop
mode a drafter proves k only together with k + u, so k is judged for a request that continues
along a resident child; a request that diverges right after k is over-predicted by one unit.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvreuse.core import AllBlocksCleared as CoreCleared
from kvreuse.core import BlockRemoved as CoreRemoved
from kvreuse.core import BlockStored as CoreStored
from kvreuse.core import Event, Geometry, compute_lookup
from kvreuse.events.convert import attention_group
from kvreuse.events.mirror import HashChain
from kvreuse.events.wire import (
    MEDIUM_GPU,
    SPEC_KINDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WireEvent,
    hash64,
)

_FAR = 1 << 62  # "any distance": a change in a full-attention group reaches every descendant


@dataclass(slots=True)
class _Node:
    """An entry of the attention group in the tree of chains. A node that left the cache stays
    (not `resident`) while descendants still name it, so that their path stays known."""

    parent: bytes | None
    boundary: int
    tokens: tuple[int, ...]  # the unit's u tokens, for its BlockStored
    lookahead: tuple[int, ...]
    lora: str | None
    resident: bool = True
    routable: bool = False
    support: int = 0  # routable nodes in this subtree, itself included
    published: bool = False


class _FullIndex:
    """An exact `IndexView` over full digests (the filter sees the core's own keys)."""

    def __init__(self, num_groups: int) -> None:
        self.index: list[dict[bytes, int]] = [{} for _ in range(num_groups)]

    def in_ghost(self, group_id: int, key: bytes) -> bool:
        return False


class RoutableFilter:
    """Core events in, the routable attention group's wire events out."""

    def __init__(self, geo: Geometry) -> None:
        self.geo = geo
        self.gid = attention_group(geo).group_id
        self.full = _FullIndex(len(geo.groups))
        self.nodes: dict[bytes, _Node] = {}
        self.children: dict[bytes | None, set[bytes]] = {}
        # how far below a changed boundary the group's change can move `routable`
        self.reach: dict[int, int] = {}
        self.states = [g.group_id for g in geo.cacheable if g.kind == "recurrent"]
        for g in geo.cacheable:
            if g.kind == "recurrent":
                self.reach[g.group_id] = 0  # a hit at k needs the state exactly at k
            elif g.kind == "sliding":
                self.reach[g.group_id] = (g.window or 0) + 2 * g.page_size
            elif g.kind == "chunked":
                self.reach[g.group_id] = (g.chunk or 0) + 2 * g.page_size
            else:
                self.reach[g.group_id] = _FAR

    def convert(self, events: Iterable[Event]) -> list[WireEvent]:
        out: list[WireEvent] = []
        for ev in events:
            if isinstance(ev, CoreCleared):
                for idx in self.full.index:
                    idx.clear()
                self.nodes.clear()
                self.children.clear()
                out.append(AllBlocksCleared())
                continue
            if ev.group_id not in self.reach:
                continue
            if isinstance(ev, CoreStored):
                self._stored(ev, out)
            elif isinstance(ev, CoreRemoved):
                self._removed(ev, out)
        return out

    def _stored(self, ev: CoreStored, out: list[WireEvent]) -> None:
        idx = self.full.index[ev.group_id]
        u, start = ev.hash_unit, ev.token_start
        for k, e in enumerate(ev.entries):
            idx[e.hash] = e.boundary
            if ev.group_id != self.gid:
                continue
            prev = ev.entries[k - 1] if k else None
            if prev is not None and prev.boundary == e.boundary - u:
                parent: bytes | None = prev.hash
            else:
                parent = self._parent_of(ev, e.boundary)
            at = e.boundary - start
            old = self.nodes.get(e.hash)
            node = _Node(
                parent,
                e.boundary,
                ev.token_ids[at - u : at],
                ev.successor_token_ids[k],
                ev.lora[0] if ev.lora else None,
            )
            if old is not None:  # back in the cache: keep what its subtree added up
                node.routable, node.support, node.published = (
                    old.routable,
                    old.support,
                    old.published,
                )
            self.nodes[e.hash] = node
            self.children.setdefault(parent, set()).add(e.hash)
        reach = self.reach[ev.group_id]
        if reach == 0:  # a recurrent state moves only its own boundary
            for e in ev.entries:
                self._reevaluate(e.hash, 0, out)
        else:  # a run is one chain: one walk from its first entry covers every entry
            span = ev.entries[-1].boundary - ev.entries[0].boundary
            self._reevaluate(ev.entries[0].hash, min(_FAR, reach + span), out)

    @staticmethod
    def _parent_of(ev: CoreStored, boundary: int) -> bytes | None:
        """The hash at `boundary - u` (None at 0), from the chain the run carries."""
        u = ev.hash_unit
        if boundary == u:
            return None
        return ev.unit_hashes[(boundary - u - ev.token_start) // u]

    def _removed(self, ev: CoreRemoved, out: list[WireEvent]) -> None:
        self.full.index[ev.group_id].pop(ev.hash, None)
        node = self.nodes.get(ev.hash) if ev.group_id == self.gid else None
        if node is not None:
            node.resident = False
        self._reevaluate(ev.hash, self.reach[ev.group_id], out)
        if node is not None:
            self._forget(ev.hash)

    def _forget(self, h: bytes | None) -> None:
        """Drop non-resident nodes that no descendant names any more, walking up."""
        while h is not None and h in self.nodes:
            node = self.nodes[h]
            if node.resident or self.children.get(h):
                return
            del self.nodes[h]
            self.children.pop(h, None)
            siblings = self.children.get(node.parent)
            if siblings is not None:
                siblings.discard(h)
            h = node.parent

    def _chain(self, h: bytes) -> tuple[list[bytes], bool] | None:
        """[H[0], H[1], …, h] through known nodes, and whether all of them are resident; None if
        the path back to the first unit is not known. A path may pass through a node that left
        the index while its tokens are still held: a copied page keeps the content of units
        whose keys went with the page they were first published on, and the lookup finds
        the page by a later key."""
        path = [h]
        node = self.nodes[h]
        intact = node.resident
        while node.parent is not None:
            if node.parent not in self.nodes:
                return None
            path.append(node.parent)
            node = self.nodes[node.parent]
            intact = intact and node.resident
        if node.boundary != self.geo.hash_unit:
            return None
        path.append(b"")  # H[0] is never looked up
        path.reverse()
        return path, intact

    def _reevaluate(self, h: bytes, reach: int, out: list[WireEvent]) -> None:
        """Recompute `routable` for the node `h` and its descendants within `reach` tokens."""
        if h not in self.nodes:
            return
        limit = self.nodes[h].boundary + reach
        parent = self.nodes[h].parent
        if self.geo.spec_mode == "drop" and parent in self.nodes:
            h = parent  # (see `_is_routable`) the parent is judged through its children
        # each entry carries its chain (None: its path is not known) and whether every node on
        # it is resident, extended one unit per step down instead of walked up for every node
        stack: list[tuple[bytes, tuple[list[bytes], bool] | None]] = [(h, self._chain(h))]
        deltas: dict[bytes, int] = {}
        while stack:
            key, found = stack.pop()
            node = self.nodes[key]
            if node.boundary > limit:
                continue
            # a hit at k needs the key at k: a node out of the index is never routable itself
            now = found is not None and node.resident and self._is_routable(key, node, *found)
            if now != node.routable:
                node.routable = now
                deltas[key] = 1 if now else -1
            for child in self.children.get(key, ()):
                if found is None:
                    stack.append((child, None))
                else:
                    chain, intact = found
                    stack.append((child, ([*chain, child], intact and self.nodes[child].resident)))
        if deltas:
            self._propagate(deltas, out)

    def _is_routable(self, key: bytes, node: _Node, chain: list[bytes], intact: bool) -> bool:
        """Whether a request sharing the prefix up to `node` (its `chain`, `intact` when every
        unit key on it is resident) would reuse all of it."""
        drop = self.geo.spec_mode == "drop"
        if not drop and any(key not in self.full.index[gid] for gid in self.states):
            return False  # a hit at k needs a state exactly at k in every recurrent group
        if self.geo.only_full and intact:
            # Full attention alone: every unit entry of the path is resident, so its pages are
            # covered and the hit is the whole prefix; the lookup would say the same.
            return True
        if not drop:
            return self._hit(chain) == node.boundary
        # A drafter in drop mode proves x only together with x + u, so a chain that ends at
        # x never reuses x: judge x for a request continuing along a resident child.
        return any(
            self._hit([*chain, c]) >= node.boundary
            for c in self.children.get(key, ())
            if self.nodes[c].resident
        )

    def _hit(self, chain: Sequence[bytes]) -> int:
        """The hit of a request that shares exactly this chain and continues past it."""
        num_tokens = (len(chain) - 1) * self.geo.hash_unit + 1
        return compute_lookup(
            self.geo, self.full, "routable", HashChain(list(chain)), num_tokens
        ).hit

    def _propagate(self, deltas: dict[bytes, int], out: list[WireEvent]) -> None:
        """Add each node's change of `routable` to its support and its ancestors'; publish or
        retract the nodes whose support crosses zero. Deepest first, so every ancestor is
        visited once with the sum of what reaches it (not once per changed descendant)."""
        pending = dict(deltas)
        heap = [(-self.nodes[h].boundary, h) for h in pending]
        heapq.heapify(heap)
        newly: list[tuple[int, bytes]] = []
        while heap:
            _, h = heapq.heappop(heap)
            delta = pending.pop(h)
            node = self.nodes[h]
            node.support += delta
            if node.support > 0 and not node.published:
                node.published = True
                newly.append((node.boundary, h))
            elif node.support <= 0 and node.published:
                node.published = False
                self._emit_removed(h, out)
            up = node.parent
            if delta and up is not None and up in self.nodes:
                if up not in pending:
                    pending[up] = 0
                    heapq.heappush(heap, (-self.nodes[up].boundary, up))
                pending[up] += delta
        for _, h in sorted(newly):  # ancestors first, so every parent precedes its child
            self._emit_stored(h, out)

    def _emit_stored(self, h: bytes, out: list[WireEvent]) -> None:
        node = self.nodes[h]
        parent = hash64(node.parent) if node.parent is not None else None
        last = out[-1] if out else None
        if (
            isinstance(last, BlockStored)
            and last.block_hashes[-1] == parent
            and last.lora_name == node.lora
        ):
            last.block_hashes.append(hash64(h))
            last.token_ids.extend(node.tokens)
            if last.lookahead_token_ids is not None:
                last.lookahead_token_ids.append(list(node.lookahead))
            return
        out.append(
            BlockStored(
                block_hashes=[hash64(h)],
                parent_block_hash=parent,
                token_ids=list(node.tokens),
                block_size=self.geo.hash_unit,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=node.lora,
                group_idx=self.gid,
                kv_cache_spec_kind=SPEC_KINDS["full"],
                lookahead_token_ids=[list(node.lookahead)] if self.geo.lookahead else None,
            )
        )

    def _emit_removed(self, h: bytes, out: list[WireEvent]) -> None:
        last = out[-1] if out else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(hash64(h))
        else:
            out.append(BlockRemoved([hash64(h)], MEDIUM_GPU, group_idx=self.gid))
