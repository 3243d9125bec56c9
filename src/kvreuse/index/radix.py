"""A token-granular radix tree with SGLang RadixAttention semantics.

Edges are runs of token ids stored as packed :data:`~kvreuse.tokens.TokenBuffer` bytes, so edge
comparison runs at memcmp speed. Children are keyed by their first token (their first page when
``page_size > 1``, and matches are rounded down to whole pages). A match or insert that diverges
inside an edge splits it. Running requests pin their path with :meth:`RadixIndex.lock`; eviction
removes unreferenced leaves in policy order, and a parent left childless joins the candidates, so
shared trunks outlive the private tails hanging off them.

Every cache identity (model, adapter, salt, extra keys) has its own root: different identities
never share a node. The tree itself (roots, walks, splits) is the kernel of
:mod:`kvreuse.index.trie`; this module adds locks, access history and eviction.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from kvreuse.errors import ConfigError, IndexStateError, require_at_least
from kvreuse.identity import CacheIdentity
from kvreuse.index.base import Clock
from kvreuse.index.eviction import EvictionKey, eviction_policy
from kvreuse.index.radix_node import Match, RadixNode
from kvreuse.index.trie import PrefixTrie
from kvreuse.tokens import TOKEN_BYTES, Tokens, as_buffer

__all__ = ["Match", "RadixIndex", "RadixNode"]


class RadixIndex(PrefixTrie[RadixNode]):
    """Radix-tree prefix cache. See the module docstring for semantics.

    ``capacity_tokens`` (optional) bounds the tokens held; an insert that would exceed it first
    evicts, and stores only what fits when locked KV leaves no room. ``eviction`` names a policy in
    :data:`~kvreuse.index.eviction.EVICTION_POLICIES`. Time comes from ``now`` arguments, else
    from the injected ``clock``, else from a logical counter that ticks once per operation.
    ``on_evict`` (optional) is called with each leaf just before eviction unlinks it, while
    ``node.path_key()`` still works: KV-event publishers and exact routers hang off it.
    """

    def __init__(
        self,
        *,
        page_size: int = 1,
        capacity_tokens: int | None = None,
        eviction: str = "lru",
        clock: Clock | None = None,
        on_evict: Callable[[RadixNode], None] | None = None,
    ) -> None:
        require_at_least("page_size", page_size, 1)
        if capacity_tokens is not None and capacity_tokens < 0:
            raise ConfigError(f"capacity_tokens must be >= 0 or None, got {capacity_tokens}")
        super().__init__(page_size)
        self.page_size = page_size
        self.capacity_tokens = capacity_tokens
        self.eviction = eviction
        self._key_of: EvictionKey = eviction_policy(eviction)
        self._clock = clock
        self._on_evict = on_evict
        self._tick = 0.0
        self._next_id = 0
        self._total = 0
        self._protected = 0
        self._evicted_total = 0
        # Lazy heap of (key, node_id, push_seq, node); kvreuse.index.eviction says why lazy is
        # exact. push_seq keeps duplicate entries of one node from ever comparing the nodes.
        self._heap: list[tuple[tuple[float, ...], int, int, RadixNode]] = []
        self._push_seq = 0

    # ------------------------------------------------------------------ queries

    @property
    def total_tokens(self) -> int:
        return self._total

    @property
    def protected_tokens(self) -> int:
        return self._protected

    @property
    def evictable_tokens(self) -> int:
        return self._total - self._protected

    @property
    def evicted_tokens_total(self) -> int:
        """Tokens evicted over the index's life."""
        return self._evicted_total

    @property
    def num_nodes(self) -> int:
        """Non-root nodes."""
        return self._num_nodes

    def _new_root(self, identity: CacheIdentity) -> RadixNode:
        root = RadixNode(b"", None, identity, self._new_id(), 0.0)
        root.lock_ref = 1  # the root is never evicted
        return root

    # ------------------------------------------------------------------ operations

    def match(
        self, tokens: Tokens, identity: CacheIdentity | None = None, now: float | None = None
    ) -> Match:
        """Longest cached prefix of ``tokens`` under ``identity``, rounded down to whole pages.

        Touches every node on the path (access time, hit count) and splits the edge where the
        match ends inside it, so the returned node ends exactly at the match. O(n) bytes compared
        plus O(depth) dict lookups, with n the prompt length.
        """
        node, pos, identity_of_root = self._match_walk(tokens, identity, now)
        return Match(pos // TOKEN_BYTES, node, identity_of_root)

    def match_length(
        self, tokens: Tokens, identity: CacheIdentity | None = None, now: float | None = None
    ) -> int:
        """:meth:`match`'s ``length`` alone, with the same touches and split; for callers that
        only estimate (a replica's queue) and would drop the result object. Same cost."""
        return self._match_walk(tokens, identity, now)[1] // TOKEN_BYTES

    def _match_walk(
        self, tokens: Tokens, identity: CacheIdentity | None, now: float | None
    ) -> tuple[RadixNode, int, CacheIdentity]:
        # Fast paths first (a packed buffer, an explicit time, the last identity): these run
        # several times per simulated request.
        buf = (tokens if type(tokens) is bytes and not len(tokens) % TOKEN_BYTES
               else as_buffer(tokens))
        when = now if now is not None else self._now(None)
        root = (self._last_root if identity is self._last_identity and self._last_root
                is not None else self.root(identity))
        root.last_access = when
        node, pos = self._walk(root, buf, when, True, 0, 0)
        return node, pos, root.identity

    def insert(
        self,
        tokens: Tokens,
        identity: CacheIdentity | None = None,
        now: float | None = None,
        *,
        priority: int = 0,
    ) -> int:
        """Store ``tokens`` (truncated to whole pages); returns tokens newly stored.

        With ``capacity_tokens`` set, evicts unreferenced leaves first (never the path being
        extended) and stores only the part that fits. O(n) plus O(log h) per evicted leaf.
        """
        buf: bytes = as_buffer(tokens)
        usable = len(buf) - len(buf) % self._page_bytes
        buf = buf[:usable] if usable != len(buf) else buf
        when = self._now(now)
        root = self.root(identity)
        root.last_access = when
        node, pos = self._walk(root, buf, when, False, priority, 0)
        leaf = self._attach(node, buf, pos, when, priority)
        return 0 if leaf is None else len(leaf.key) // TOKEN_BYTES

    def extend(
        self,
        node: RadixNode,
        tokens: Tokens,
        now: float | None = None,
        *,
        priority: int = 0,
    ) -> RadixNode:
        """:meth:`insert` ``tokens`` starting at ``node`` instead of the root; returns the
        deepest node of the stored path (it ends at the last whole page stored).

        ``node`` must end on the path of ``tokens``: a node :meth:`match` or :meth:`extend`
        returned for a prefix of the same tokens and kept locked since (a split keeps a node's
        end). The path above it is touched as :meth:`insert` touches it, so the cache ends up
        exactly as after ``insert(tokens)``. Callers that hold such a node (a running request
        growing its own prefix) skip re-comparing the prefix: O(depth) to touch the ancestors
        plus O(n - d) bytes compared for the d tokens the node already covers.
        """
        if node.removed:
            raise IndexStateError(f"cannot extend {node!r}: it was evicted; match again first")
        buf: bytes = (tokens if type(tokens) is bytes and not len(tokens) % TOKEN_BYTES
                      else as_buffer(tokens))
        usable = len(buf) - len(buf) % self._page_bytes
        buf = buf[:usable] if usable != len(buf) else buf
        when = now if now is not None else self._now(None)
        depth = 0
        above: RadixNode | None = node
        while above is not None:
            above.last_access = when
            if priority > above.priority:
                above.priority = priority
            depth += len(above.key)
            above = above.parent
        key = node.key
        if depth > len(buf) or not buf.startswith(key, depth - len(key)):
            raise IndexStateError(f"{node!r} does not end on the path of the tokens to store")
        end, pos = self._walk(node, buf, when, False, priority, depth)
        leaf = self._attach(end, buf, pos, when, priority)
        return end if leaf is None else leaf

    def lock(self, node: RadixNode) -> None:
        """Pin ``node`` and its ancestors so eviction skips them. O(depth)."""
        if node.removed:
            raise IndexStateError(f"cannot lock {node!r}: it was evicted; match again first")
        while node.parent is not None:
            if node.lock_ref == 0:
                self._protected += len(node.key) // TOKEN_BYTES
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Release one :meth:`lock` of ``node``; leaves whose count reaches 0 become evictable.
        O(depth)."""
        if node.removed or (node.parent is not None and node.lock_ref <= 0):
            raise IndexStateError(f"unlock of {node!r} without a matching lock")
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key) // TOKEN_BYTES
                if not node.children:
                    self._push(node)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Remove unreferenced leaves in policy order until ``num_tokens`` are freed or nothing
        evictable is left; returns tokens freed. Whole leaves go, so it may free more than asked.
        O(k log h) for k leaves removed and h heap entries."""
        freed = 0
        heap = self._heap
        key_of = self._key_of
        heappop = heapq.heappop
        while freed < num_tokens and heap:
            stored_key, node_id, _, node = heappop(heap)
            if node.removed or node.children or node.lock_ref:
                continue
            current = key_of(node)
            if current != stored_key:
                self._push_seq += 1
                heapq.heappush(heap, (current, node_id, self._push_seq, node))
                continue
            # Remove the leaf, then keep climbing while its parent is left a childless,
            # unlocked leaf that sorts before every heap entry: the heap would hand that parent
            # straight back (stored keys never exceed current ones), so skipping the push and
            # pop keeps the exact order and halves the heap work on long chains.
            while True:
                parent = self._detach_leaf(node)
                freed += len(node.key) // TOKEN_BYTES
                if parent.parent is None or parent.children or parent.lock_ref:
                    break
                if freed >= num_tokens or (
                    heap and (heap[0][0], heap[0][1]) <= (key_of(parent), parent.node_id)
                ):
                    self._push(parent)
                    break
                node = parent
        self._evicted_total += freed
        return freed

    def reset(self) -> None:
        """Drop everything, locks included (an engine restart, vLLM's AllBlocksCleared)."""
        for _identity, node in self.nodes():
            node.removed = True
        self._clear_roots()
        self._heap.clear()
        self._total = self._protected = 0

    # ------------------------------------------------------------------ inspection

    def check_invariants(self) -> None:
        """O(n + h) self-check of structure, counters, locks and the eviction heap."""
        heap_min: dict[int, tuple[float, ...]] = {}
        for key, node_id, _, _node in self._heap:
            if node_id not in heap_min or key < heap_min[node_id]:
                heap_min[node_id] = key
        self._check_structure()
        total = protected = 0
        for identity, root in self._roots.items():
            assert root.identity == identity, "root filed under the wrong identity"
            assert root.lock_ref >= 1, "root must be locked"
            for node in self._subtree(root):
                child_locks = 0
                for child in node.children.values():
                    assert not child.removed, f"{child!r} is removed but still linked"
                    assert child.identity == identity, f"{child!r} crossed identities"
                    child_locks += child.lock_ref
                if node is root:
                    continue
                assert node.lock_ref >= child_locks, f"{node!r} holds fewer locks than children"
                total += node.num_tokens
                if node.lock_ref:
                    protected += node.num_tokens
                elif not node.children:
                    heap_key = heap_min.get(node.node_id)
                    assert heap_key is not None, f"evictable leaf {node!r} missing from the heap"
                    assert heap_key <= self._key_of(node), f"heap key of {node!r} is ahead of it"
        assert total == self._total, f"total_tokens {self._total} != {total}"
        assert protected == self._protected, f"protected_tokens {self._protected} != {protected}"
        if self.capacity_tokens is not None:
            assert self._total <= max(self.capacity_tokens, self._protected), "over capacity"

    # ------------------------------------------------------------------ internals

    def _now(self, now: float | None) -> float:
        if now is not None:
            return now
        if self._clock is not None:
            return self._clock()
        self._tick += 1.0
        return self._tick

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _walk(
        self,
        node: RadixNode,
        buf: bytes,
        when: float,
        hit: bool,
        priority: int,
        start: int,
    ) -> tuple[RadixNode, int]:
        """Follow ``buf`` from byte ``start`` down from ``node`` (which ends at ``start``);
        returns the deepest node reached and the byte offset matched, splitting an edge the walk
        ends inside, and touches every node it passed. Called with positional arguments, which
        CPython 3.11 binds faster than keywords: it runs several times per simulated request."""
        page = self._page_bytes
        end, pos, diverging = self._descend(node, buf, start, len(buf) - len(buf) % page)
        if diverging is not None:
            # Filed under its first page, the diverging edge shares at least that page.
            common = self._common(diverging, buf, pos)
            end = self._split(diverging, common)
            pos += common
        reached = end
        while end is not node:
            end.last_access = when
            end.hit_count += hit
            if priority > end.priority:
                end.priority = priority
            parent = end.parent
            assert parent is not None
            end = parent
        return reached, pos

    def _attach(
        self, node: RadixNode, buf: bytes, pos: int, when: float, priority: int
    ) -> RadixNode | None:
        """Hang ``buf[pos:]`` (whole pages) below ``node``, where a walk stopped, evicting
        first under ``capacity_tokens``; returns the new leaf, or ``None`` if nothing was
        stored (nothing left, or no room)."""
        remaining = len(buf) - pos
        if remaining == 0:
            return None
        if self.capacity_tokens is not None:
            remaining = self._make_room(node, remaining)
            if remaining == 0:
                return None
        self._next_id += 1
        leaf = RadixNode(buf[pos : pos + remaining], node, node.identity, self._next_id, when)
        leaf.priority = priority
        self._link(node, leaf)
        self._total += remaining // TOKEN_BYTES
        self._push(leaf)
        return leaf

    def _cut(self, child: RadixNode, key: bytes) -> RadixNode:
        upper = RadixNode(key, child.parent, child.identity, self._new_id(), child.created)
        upper.last_access = child.last_access
        upper.hit_count = child.hit_count
        upper.priority = child.priority
        upper.lock_ref = child.lock_ref
        return upper

    def _make_room(self, node: RadixNode, wanted: int) -> int:
        """Evict so ``wanted`` bytes fit under capacity without evicting ``node``'s path;
        returns the bytes (whole pages) that fit."""
        assert self.capacity_tokens is not None
        capacity = self.capacity_tokens * TOKEN_BYTES
        overflow = self._total * TOKEN_BYTES + wanted - capacity
        if overflow > 0:
            # Pin the path being extended so eviction cannot pull it out from under the insert.
            self.lock(node)
            self.evict(-(-overflow // TOKEN_BYTES))
            self.unlock(node)
        room = capacity - self._total * TOKEN_BYTES
        fit = min(wanted, max(room, 0))
        return fit - fit % self._page_bytes

    def _detach_leaf(self, node: RadixNode) -> RadixNode:
        """Unlink an evictable leaf and update the counters; returns its parent, which the
        caller must push if that left it an evictable leaf. O(1)."""
        assert not node.children and not node.lock_ref, "bad eviction"
        if self._on_evict is not None:
            self._on_evict(node)
        parent = self._unlink(node)
        node.removed = True
        self._total -= len(node.key) // TOKEN_BYTES
        return parent

    def _push(self, node: RadixNode) -> None:
        self._push_seq += 1
        heapq.heappush(self._heap, (self._key_of(node), node.node_id, self._push_seq, node))
        if len(self._heap) > 4 * self._num_nodes + 64:
            self._compact_heap()

    def _compact_heap(self) -> None:
        """Drop stale entries so the lazy heap stays O(nodes). O(h)."""
        fresh: dict[int, tuple[tuple[float, ...], int, int, RadixNode]] = {}
        for entry in self._heap:
            node = entry[3]
            if node.removed or node.children or node.lock_ref:
                continue
            fresh[node.node_id] = (self._key_of(node), node.node_id, entry[2], node)
        # In place: evict() holds a reference to the list while it may trigger a compaction.
        self._heap[:] = fresh.values()
        heapq.heapify(self._heap)
