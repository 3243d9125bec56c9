"""What a router believes each replica has cached.

Two sources, in seed 000's order of accuracy and cost:

* :class:`ApproxTrees` — SGLang router's approach: a radix tree of the prompts the router *sent*
  to each replica. It never hears what the engine evicted, so it over-predicts; each replica's
  part is trimmed by LRU to ``max_tree_tokens`` every ``eviction_interval_s`` (SGLang: 120 s,
  2**26), and our variant may also cap it at the replica's cache size (``capacity_tokens``) so
  the guess forgets roughly as fast as the engine does.
* :class:`~kvreuse.routing.mirror.CacheMirror` — Dynamo-style: built only from the KV events
  replicas publish (:mod:`kvreuse.routing.events`), so it tracks real contents up to the event
  lag; matches rounded down to blocks.

Both keep one shared tree (on the kernel of :mod:`kvreuse.index.trie`) whose edges carry a bit
mask of the replicas holding them (as sgl-router's tree keeps per-tenant timestamps), so a
prediction is one walk for the whole fleet. Both honour
:class:`~kvreuse.routing.base.CacheEstimator`:
``predict(request, replica_ids, now) -> dict[replica, cached tokens]``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from mypy_extensions import mypyc_attr

from kvreuse.errors import ConfigError, require_at_least
from kvreuse.identity import CacheIdentity
from kvreuse.routing.base import ReplicaId, RequestView
from kvreuse.routing.events import KvEvent
from kvreuse.routing.fleet_masks import FleetNode, FleetTrie
from kvreuse.tokens import TOKEN_BYTES


# Picklable when compiled too; so only compiled code may construct it (kvreuse.index.trie).
@mypyc_attr(serializable=True)
class _Node(FleetNode["_Node"]):
    """An edge of the shared tree: tokens, the replicas holding them, each one's last use, and
    how many children each replica holds (a replica's leaf is a node with none). A node
    nobody holds any more is unlinked and loses its parent."""

    __slots__ = ("below", "node_id", "stamp")

    def __init__(self, key: bytes, parent: _Node | None, node_id: int) -> None:
        super().__init__(key, parent, 0)
        self.node_id = node_id
        self.stamp: dict[int, float] = {}  # replica bit -> last access
        self.below: dict[int, int] = {}  # replica bit -> children holding it


_Entry = tuple[float, int, _Node]


class ApproxTrees(FleetTrie[_Node]):
    """Per-replica trees of what the router sent (SGLang's approximate tree), stored as one.

    Semantics per replica are those of a separate LRU radix tree: :meth:`record` inserts the
    prompt and touches its path; :meth:`predict` returns the longest prefix each replica's tree
    holds and touches the matched part; eviction removes that replica's least recently used
    leaves, whole, until it is under its cap. A prompt longer than ``capacity_tokens`` is kept
    whole until newer prompts push it out. Costs: a prediction or a record is O(n) bytes
    compared plus O(depth × replicas) bit and stamp updates; an evicted leaf O(log h).
    """

    uses_kv_events = False

    def __init__(
        self,
        *,
        eviction_interval_s: float = 120.0,
        max_tree_tokens: int = 2**26,
        capacity_tokens: int | None = None,
    ) -> None:
        if eviction_interval_s <= 0:
            raise ConfigError(f"eviction_interval_s must be > 0, got {eviction_interval_s}")
        require_at_least("max_tree_tokens", max_tree_tokens, 0)
        if capacity_tokens is not None and capacity_tokens < 0:
            raise ConfigError(f"capacity_tokens must be >= 0 or None, got {capacity_tokens}")
        super().__init__()
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_tokens = max_tree_tokens
        self.capacity_tokens = capacity_tokens
        self._next_eviction: float | None = None
        self._heaps: dict[int, list[_Entry]] = {}
        self._next_id = 0
        self._singles: dict[int, tuple[int, ...]] = {}
        self._caps: dict[int, int] = {}  # replica bit -> its own cap (set_capacity)

    # ------------------------------------------------------------------ budgets

    def set_capacity(self, replica: ReplicaId, tokens: int) -> None:
        """Cap ``replica``'s tree at ``tokens`` (instead of ``capacity_tokens``), trimming its
        LRU leaves now if it is over. A gateway calls it with each upstream's budget."""
        if tokens < 0:
            raise ConfigError(f"capacity must be >= 0 tokens, got {tokens}")
        bit = self._bit(replica)
        self._caps[bit] = tokens
        if self._tokens[bit] > tokens:
            self._evict(bit, self._tokens[bit] - tokens, keep=None)

    def capacity_of(self, replica: ReplicaId) -> int | None:
        """The cap :meth:`record` trims ``replica`` to (CacheEstimator's bound). O(1)."""
        bit = self._bits.get(replica)
        cap = None if bit is None else self._caps.get(bit)
        return self.capacity_tokens if cap is None else cap

    def lru_stamp(self, replica: ReplicaId) -> float | None:
        """When ``replica``'s least recently used leaf was last used: what the next eviction
        from its tree would drop (None: it holds nothing). O(log h) amortised."""
        bit = self._bits.get(replica)
        entry = None if bit is None else self._lru_leaf(bit)
        return None if entry is None else entry[0]

    # ------------------------------------------------------------------ queries

    def cached_blocks(self, replica: ReplicaId) -> int:
        """:meth:`tree_tokens`: these trees predict in tokens (CacheEstimator's own unit)."""
        return self.tree_tokens(replica)

    def apply(self, event: KvEvent) -> None:
        """Routing alone teaches these trees: KV events do not."""
        return None

    def predict(
        self, request: RequestView, replicas: Iterable[ReplicaId], now: float
    ) -> dict[ReplicaId, int]:
        """Longest match of the prompt in each replica's tree, touching what matched. One walk:
        O(n) bytes compared plus O(depth × replicas)."""
        self._maybe_evict(now)
        return self._fleet_walk(request, replicas, now, 1)

    def _matched(self, edge: _Node, part: int, alive: int, now: float) -> None:
        """Touch the matched edge for the replicas holding it; a match ending inside the edge
        splits it first, so the touch is exact."""
        if part:
            edge = self._split(edge, part)
        stamp = edge.stamp
        for low in self._singles.get(alive) or self._split_mask(alive):
            stamp[low] = now

    # ------------------------------------------------------------------ updates

    def record(self, request: RequestView, replica: ReplicaId, now: float) -> None:
        """The router sent ``request`` to ``replica``: remember its prompt there, then evict
        that replica's LRU leaves past ``capacity_tokens``. O(n) plus O(log h) per eviction."""
        bit = self._bit(replica)
        root = self.root(request.identity)
        buf = request.tokens
        end = len(buf) - len(buf) % TOKEN_BYTES
        node, pos, diverging = self._descend(root, buf, 0, end)
        if diverging is not None:
            node = self._split(diverging, self._common(diverging, buf, pos))
            pos += len(node.key)
        if pos < end:
            node = self._link(node, _Node(buf[pos:end], node, self._new_id()))
        if node is root:
            return
        # Hold and touch the path, leaf to root.
        gained = 0
        edge = node
        while edge is not root:
            above = edge.parent
            assert above is not None
            if not edge.holders & bit:
                edge.holders |= bit
                gained += len(edge.key)
                above.below[bit] = above.below.get(bit, 0) + 1
            edge.stamp[bit] = now
            edge = above
        self._tokens[bit] += gained // TOKEN_BYTES
        if not node.below.get(bit):
            self._push(bit, node)
        cap = self._caps.get(bit, self.capacity_tokens) if self._caps else self.capacity_tokens
        if cap is not None and self._tokens[bit] > cap:
            self._evict(bit, self._tokens[bit] - cap, keep=node)

    def _maybe_evict(self, now: float) -> None:
        if self._next_eviction is None:
            self._next_eviction = now + self.eviction_interval_s
        if now < self._next_eviction:
            return
        for bit, tokens in self._tokens.items():
            if tokens > self.max_tree_tokens:
                self._evict(bit, tokens - self.max_tree_tokens, keep=None)
        self._next_eviction = now + self.eviction_interval_s

    def _evict(self, bit: int, wanted: int, keep: _Node | None) -> int:
        """Remove ``bit``'s least recently used leaves (never ``keep``) until ``wanted`` tokens
        are gone or none is left; returns tokens removed."""
        heap = self._heaps[bit]
        freed = 0
        parked: _Entry | None = None
        while freed < wanted:
            entry = self._lru_leaf(bit)
            if entry is None:
                break
            heapq.heappop(heap)
            if entry[2] is keep:
                parked = entry
                continue
            freed += self._drop(bit, entry[2])
        if parked is not None:
            heapq.heappush(heap, parked)
        return freed

    def _lru_leaf(self, bit: int) -> _Entry | None:
        """The heap entry of ``bit``'s least recently used leaf, left on top of its heap (None:
        it holds none). Stale entries on the way are dropped (removed, no longer held, no longer
        a leaf of this replica) or re-filed at the leaf's current stamp: O(log h) amortised."""
        heap = self._heaps[bit]
        while heap:
            stamp, node_id, node = heap[0]
            if node.parent is None or not node.holders & bit or node.below.get(bit):
                heapq.heappop(heap)
                continue
            current = node.stamp[bit]
            if current != stamp:
                heapq.heapreplace(heap, (current, node_id, node))
                continue
            return heap[0]
        return None

    def _drop(self, bit: int, node: _Node) -> int:
        """``node`` stops being held by ``bit``; unlinked once nobody holds it."""
        parent = node.parent
        assert parent is not None, "evicting a root"
        node.holders &= ~bit
        del node.stamp[bit]
        tokens = len(node.key) // TOKEN_BYTES
        self._tokens[bit] -= tokens
        left = parent.below[bit] - 1
        if left:
            parent.below[bit] = left
        else:
            del parent.below[bit]
            if parent.parent is not None:
                self._push(bit, parent)  # the parent is now one of this replica's leaves
        if not node.holders and not node.children:
            self._unlink(node)
            node.parent = None
        return tokens

    # ------------------------------------------------------------------ structure

    def _new_root(self, identity: CacheIdentity) -> _Node:
        return _Node(b"", None, self._new_id())

    def _new_bit(self, bit: int) -> None:
        self._heaps[bit] = []

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _split_mask(self, mask: int) -> tuple[int, ...]:
        """The single bits of ``mask``, remembered: the walks loop over them on every edge."""
        bits = []
        rest = mask
        while rest:
            low = rest & -rest
            bits.append(low)
            rest ^= low
        if len(self._singles) > 4096:  # masks seen stay few; bound them anyway
            self._singles.clear()
        self._singles[mask] = singles = tuple(bits)
        return singles

    def _cut(self, child: _Node, key: bytes) -> _Node:
        upper = _Node(key, child.parent, self._new_id())
        upper.holders = child.holders
        upper.stamp = dict(child.stamp)
        upper.below = dict.fromkeys(child.stamp, 1)
        return upper

    def _push(self, bit: int, node: _Node) -> None:
        heap = self._heaps[bit]
        heapq.heappush(heap, (node.stamp[bit], node.node_id, node))
        if len(heap) > 4 * self._num_nodes + 64:
            # Drop stale entries so the lazy heap stays O(nodes).
            fresh = {
                n.node_id: (n.stamp[bit], n.node_id, n)
                for _, _, n in heap
                if n.parent is not None and n.holders & bit and not n.below.get(bit)
            }
            heap[:] = fresh.values()
            heapq.heapify(heap)

    def check_invariants(self) -> None:
        """O(tree + heaps) self-check: structure, per-replica counts, every leaf in its heap."""
        self._check_structure()
        tokens = dict.fromkeys(self._tokens, 0)
        queued = {bit: {n.node_id for _, _, n in heap} for bit, heap in self._heaps.items()}
        for root in self._roots.values():
            stack = [root]
            while stack:
                node = stack.pop()
                below: dict[int, int] = {}
                for child in node.children.values():
                    assert child.holders & ~node.holders == 0 or node.parent is None, (
                        "a replica holds an edge without its parent"
                    )
                    for bit in tokens:
                        if child.holders & bit:
                            below[bit] = below.get(bit, 0) + 1
                    stack.append(child)
                assert below == node.below, f"child counts {node.below} != {below}"
                if node.parent is None:
                    continue
                assert node.holders, "an edge nobody holds was kept"
                for bit in tokens:
                    if node.holders & bit:
                        tokens[bit] += len(node.key) // TOKEN_BYTES
                        assert bit in node.stamp, "held edge without a stamp"
                        if not below.get(bit):
                            assert node.node_id in queued[bit], "a leaf missing from its heap"
        assert tokens == self._tokens, f"tokens {self._tokens} != {tokens}"

