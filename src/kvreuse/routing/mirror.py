"""What every replica truly caches, as its KV events tell it: one shared radix tree.

The ``exact`` estimator (Dynamo-style routing on KV events). Every :class:`KvStored` /
:class:`KvRemoved` a replica publishes is folded into a single token-granular radix tree per
cache identity whose nodes carry a bit mask of the replicas holding that edge. A request is then
matched once for the whole fleet: walking its tokens down the tree, a replica drops out at the
first edge it does not hold, so one walk gives every replica's longest held prefix, which is
rounded down to whole blocks (``block_size``, default 16: vLLM's block) because an engine only
reuses whole blocks. No hashing happens on the request path.

Semantics, stated:

* ``KvStored(path)``: the replica holds every prefix of ``path`` (all its tokens).
* ``KvRemoved(path, keep)``: the replica no longer holds tokens ``keep..len(path)`` of ``path``
  (a leaf evicted from a radix tree, or one vLLM block: a *hole*, whose cached descendants
  become unreachable until it is stored again — the walk stops at the hole, as vLLM's hit rule
  does), except the first of those tokens that also open another path it holds and that leaves
  this one before ``keep + block_size``: two vLLM blocks at one position may share leading
  tokens, and evicting one leaves the other whole (a radix leaf never shares tokens past
  ``keep`` with its replica's other paths, so this never applies to one).
* ``KvCleared``: the replica holds nothing.
* The match of a replica is the longest prefix of the prompt whose every token it holds,
  rounded down to a multiple of ``block_size``. A block thus counts only if all its tokens are
  held, the same answer a per-block hash set gives (``tests/sim`` checks it against the true
  radix cache), and events arriving late (the simulator's ``kv_event_lag_s``) simply make the
  mirror an older copy of the cache.

The tree is the kernel of :mod:`kvreuse.index.trie`; this module adds the holder masks.

Costs: an event or a prediction is O(n) bytes compared plus O(depth) dict lookups for an n-token
path, independent of the number of replicas but for a bit operation per edge.
"""

from __future__ import annotations

from collections.abc import Iterable

from mypy_extensions import mypyc_attr

from kvreuse.errors import require_at_least
from kvreuse.identity import CacheIdentity
from kvreuse.routing.base import ReplicaId, RequestView
from kvreuse.routing.events import KvCleared, KvEvent, KvStored
from kvreuse.routing.fleet_masks import FleetNode, FleetTrie
from kvreuse.tokens import TOKEN_BYTES


# Picklable when compiled too; so only compiled code may construct it (kvreuse.index.trie).
@mypyc_attr(serializable=True)
class _Edge(FleetNode["_Edge"]):
    """A run of tokens and the replicas that hold all of them. Unlinked, it loses its parent."""

    __slots__ = ()


class CacheMirror(FleetTrie[_Edge]):
    """Per-replica cache contents from KV events only; see the module docstring."""

    uses_kv_events = True

    def __init__(self, block_size: int = 16) -> None:
        require_at_least("block_size", block_size, 1)
        super().__init__()
        self.block_size = block_size

    # ------------------------------------------------------------------ queries

    def cached_blocks(self, replica: ReplicaId) -> int:
        """Held tokens in whole blocks (the size SGLang's rule compares). O(1)."""
        return self.tree_tokens(replica) // self.block_size

    def capacity_of(self, replica: ReplicaId) -> int | None:
        """None: the mirror holds what the replica's events say it holds, no bound of its own
        (a gateway's budget trims it only when the events overflow it). O(1)."""
        return None

    def predict(
        self, request: RequestView, replicas: Iterable[ReplicaId], now: float
    ) -> dict[ReplicaId, int]:
        """Each replica's longest held prefix of the prompt, in whole blocks. One walk for all
        replicas: O(n) bytes compared plus O(depth) lookups."""
        return self._fleet_walk(request, replicas, now, self.block_size)

    def record(self, request: RequestView, replica: ReplicaId, now: float) -> None:
        """Routing alone teaches the mirror nothing: only events do."""
        return None

    # ------------------------------------------------------------------ events

    def apply(self, event: KvEvent) -> None:
        """Fold one event into the mirror. O(n) in the event's tokens (a clear: O(tree))."""
        bit = self._bits.get(event.replica) or self._bit(event.replica)
        if isinstance(event, KvCleared):
            self._clear(bit)
            return
        root = self.root(event.identity)
        if isinstance(event, KvStored):
            self._store(root, event.tokens, bit)
        else:
            self._remove(root, event.tokens, event.keep_tokens * TOKEN_BYTES, bit)

    def _store(self, root: _Edge, buf: bytes, bit: int) -> None:
        end = len(buf) - len(buf) % TOKEN_BYTES
        node, pos, diverging = self._descend(root, buf, 0, end)
        if diverging is not None:
            node = self._split(diverging, self._common(diverging, buf, pos))
            pos += len(node.key)
        gained = 0
        if pos < end:
            self._link(node, _Edge(buf[pos:end], node, bit))
            gained = end - pos
        while node is not root:  # hold the path, leaf to root
            if not node.holders & bit:
                node.holders |= bit
                gained += len(node.key)
            above = node.parent
            assert above is not None
            node = above
        self._tokens[bit] += gained // TOKEN_BYTES

    def _remove(self, root: _Edge, buf: bytes, keep: int, bit: int) -> None:
        node, pos, end = root, 0, len(buf) - len(buf) % TOKEN_BYTES
        cleared: list[tuple[_Edge, int]] = []  # edges whose bit went, and where they end
        while pos < end:
            child = node.children.get(buf[pos : pos + TOKEN_BYTES])
            if child is None:
                break
            if not buf.startswith(child.key, pos):
                common = self._common(child, buf, pos)
                if pos + common <= keep:
                    break  # the path leaves the tree before the removed range
                child = self._split(child, common)
            if pos < keep < pos + len(child.key):
                child = self._split(child, keep - pos)
            if pos >= keep and child.holders & bit:
                child.holders &= ~bit
                cleared.append((child, pos + len(child.key)))
            node = child
            pos += len(child.key)
        # A removed block's first tokens may open a sibling block the replica still holds (two
        # blocks at one position sharing a prefix); those edges stay held. A child held past
        # the block's end is a hole's descendant instead, and does not count.
        shared_end = keep + self.block_size * TOKEN_BYTES
        for index in range(len(cleared) - 1, -1, -1):
            edge, ends = cleared[index]
            if ends >= shared_end:
                continue
            if any(c.holders & bit for c in edge.children.values()):
                for kept, _ in cleared[: index + 1]:
                    kept.holders |= bit
                del cleared[: index + 1]
                break
        self._tokens[bit] -= sum(len(e.key) for e, _ in cleared) // TOKEN_BYTES
        self._prune(node)

    def _clear(self, bit: int) -> None:
        for root in self._roots.values():
            for node in self._subtree(root):
                node.holders &= ~bit
            for node in list(self._subtree(root)):
                if node.parent is not None and not node.children:
                    self._prune(node)
        self._tokens[bit] = 0

    # ------------------------------------------------------------------ structure

    def _new_root(self, identity: CacheIdentity) -> _Edge:
        return _Edge(b"", None, 0)

    def _cut(self, child: _Edge, key: bytes) -> _Edge:
        return _Edge(key, child.parent, child.holders)

    def _prune(self, node: _Edge) -> None:
        """Drop held-by-nobody leaves upward from ``node``, then rejoin edges cut in two whose
        halves are held alike, so the splits removals make do not pile up. O(depth)."""
        while node.parent is not None and not node.holders and not node.children:
            parent = self._unlink(node)
            node.parent = None
            node = parent
        if node.parent is None:
            return
        parent = node.parent
        if len(node.children) == 1:
            self._join(node)
        if len(parent.children) == 1:
            self._join(parent)

    def _join(self, upper: _Edge) -> None:
        """Merge ``upper`` with its only child when both are held by the same replicas."""
        if upper.parent is None or len(upper.children) != 1:
            return
        (lower,) = upper.children.values()
        if lower.holders != upper.holders or not upper.holders:
            return  # a hole (held by nobody) is left alone: pruning may still remove it
        self._absorb(upper)

    def check_invariants(self) -> None:
        """O(tree) self-check: structure, token counts per replica, no dead leaves."""
        self._check_structure()
        held = dict.fromkeys(self._tokens, 0)
        for _identity, node in self.nodes():
            assert node.holders or node.children, "a leaf nobody holds was kept"
            for bit in held:
                if node.holders & bit:
                    held[bit] += len(node.key) // TOKEN_BYTES
        assert held == self._tokens, f"held tokens {self._tokens} != {held}"

