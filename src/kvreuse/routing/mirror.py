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
  does).
* ``KvCleared``: the replica holds nothing.
* The match of a replica is the longest prefix of the prompt whose every token it holds,
  rounded down to a multiple of ``block_size``. A block thus counts only if all its tokens are
  held, the same answer a per-block hash set gives (``tests/sim`` checks it against the true
  radix cache), and events arriving late (the simulator's ``kv_event_lag_s``) simply make the
  mirror an older copy of the cache.

Costs: an event or a prediction is O(n) bytes compared plus O(depth) dict lookups for an n-token
path, independent of the number of replicas but for a bit operation per edge.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from mypy_extensions import mypyc_attr

from kvreuse.errors import ConfigError
from kvreuse.identity import CacheIdentity
from kvreuse.routing.base import ReplicaId, RequestView
from kvreuse.routing.events import KvCleared, KvEvent, KvStored
from kvreuse.routing.fleet_masks import FleetPlan, fleet_plan
from kvreuse.tokens import TOKEN_BYTES, common_prefix_tokens


# Picklable and copyable when compiled too. Built only by compiled code: mypyc (2.4) skips
# __init__ of a serializable class called from interpreted code.
@mypyc_attr(serializable=True)
class _Edge:
    """A run of tokens and the replicas that hold all of them."""

    __slots__ = ("children", "holders", "key", "parent")

    def __init__(self, key: bytes, parent: _Edge | None, holders: int) -> None:
        self.key = key
        self.parent = parent
        self.holders = holders
        self.children: dict[bytes, _Edge] = {}


class CacheMirror:
    """Per-replica cache contents from KV events only; see the module docstring."""

    uses_kv_events = True

    def __init__(self, block_size: int = 16) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.events_applied = 0
        self._roots: dict[CacheIdentity, _Edge] = {}
        # Hashing a CacheIdentity costs ~0.5 µs; requests of one tenant share one instance.
        self._last_identity: CacheIdentity | None = None
        self._last_root: _Edge | None = None
        self._bits: dict[ReplicaId, int] = {}
        self._plans: dict[tuple[ReplicaId, ...], FleetPlan] = {}
        self._held: dict[int, int] = {}  # bit -> tokens held
        self._num_edges = 0

    # ------------------------------------------------------------------ queries

    def tree_tokens(self, replica: ReplicaId) -> int:
        """Tokens the replica holds, over all identities. O(1)."""
        bit = self._bits.get(replica)
        return 0 if bit is None else self._held[bit]

    def cached_blocks(self, replica: ReplicaId) -> int:
        """Held tokens in whole blocks (the size SGLang's rule compares). O(1)."""
        return self.tree_tokens(replica) // self.block_size

    @property
    def num_edges(self) -> int:
        return self._num_edges

    def predict(
        self, request: RequestView, replicas: Iterable[ReplicaId], now: float
    ) -> dict[ReplicaId, int]:
        """Each replica's longest held prefix of the prompt, in whole blocks. One walk for all
        replicas: O(n) bytes compared plus O(depth) lookups."""
        ids = replicas if type(replicas) is tuple else tuple(replicas)
        root = self._root(request.identity, create=False)
        if root is None:
            return dict.fromkeys(ids, 0)
        # The fleet's mask and bit -> replica names, kept per replica set: routers pass the same
        # set request after request, and per-replica Python loops cost more than the walk.
        plan = self._plans.get(ids) or fleet_plan(self._plans, ids, self._bit)
        alive, name_of = plan
        drops: list[tuple[int, int]] = []  # (replicas that dropped out, bytes matched then)
        buf = request.tokens
        end = len(buf)
        pos = 0
        children_get = root.children.get
        while alive and pos < end:
            child = children_get(buf[pos : pos + TOKEN_BYTES])
            if child is None:
                break
            held = alive & child.holders
            if held != alive:
                drops.append((alive ^ held, pos))
                alive = held
            key = child.key
            klen = len(key)
            if buf.startswith(key, pos):
                pos += klen
                children_get = child.children.get
                continue
            pos += common_prefix_tokens(key, buf[pos : pos + klen]) * TOKEN_BYTES
            break
        # Whole blocks only: floor to a multiple of block_size bytes-of-tokens in one step.
        step, size = self.block_size * TOKEN_BYTES, self.block_size
        # Replicas still alive share the final position; the ones that dropped out overwrite
        # theirs (dict order stays the order of ``ids``).
        out = dict.fromkeys(ids, pos // step * size if alive else 0)
        for dropped, at in drops:
            blocks = at // step * size
            while dropped:
                low = dropped & -dropped
                out[name_of[low]] = blocks
                dropped ^= low
        return out

    def record(self, request: RequestView, replica: ReplicaId, now: float) -> None:
        """Routing alone teaches the mirror nothing: only events do."""
        return None

    # ------------------------------------------------------------------ events

    def apply(self, event: KvEvent) -> None:
        """Fold one event into the mirror. O(n) in the event's tokens (a clear: O(tree))."""
        self.events_applied += 1
        bit = self._bits.get(event.replica) or self._bit(event.replica)
        if isinstance(event, KvCleared):
            self._clear(bit)
            return
        # The identity check skips hashing a CacheIdentity: a tenant's events share one.
        identity = event.identity
        root = (self._last_root if identity is self._last_identity
                else self._root(identity, create=True))
        assert root is not None
        if isinstance(event, KvStored):
            self._store(root, event.tokens, bit)
        else:
            self._remove(root, event.tokens, event.keep_tokens * TOKEN_BYTES, bit)

    def _store(self, root: _Edge, buf: bytes, bit: int) -> None:
        node, pos, end = root, 0, len(buf) - len(buf) % TOKEN_BYTES
        gained = 0
        while pos < end:
            first = buf[pos : pos + TOKEN_BYTES]
            child = node.children.get(first)
            if child is None:
                node.children[first] = _Edge(buf[pos:end], node, bit)
                self._num_edges += 1
                gained += end - pos
                break
            key = child.key
            if not buf.startswith(key, pos):
                common = common_prefix_tokens(key, buf[pos : pos + len(key)]) * TOKEN_BYTES
                child = self._split(child, common)
            if not child.holders & bit:
                child.holders |= bit
                gained += len(child.key)
            node = child
            pos += len(child.key)
        self._held[bit] += gained // TOKEN_BYTES

    def _remove(self, root: _Edge, buf: bytes, keep: int, bit: int) -> None:
        node, pos, end = root, 0, len(buf) - len(buf) % TOKEN_BYTES
        lost = 0
        while pos < end:
            child = node.children.get(buf[pos : pos + TOKEN_BYTES])
            if child is None:
                break
            key = child.key
            if not buf.startswith(key, pos):
                common = common_prefix_tokens(key, buf[pos : pos + len(key)]) * TOKEN_BYTES
                if pos + common <= keep:
                    break  # the path leaves the tree before the removed range
                child = self._split(child, common)
            if pos < keep < pos + len(child.key):
                child = self._split(child, keep - pos)
            if pos >= keep and child.holders & bit:
                child.holders &= ~bit
                lost += len(child.key)
            node = child
            pos += len(child.key)
        self._held[bit] -= lost // TOKEN_BYTES
        self._prune(node)

    def _clear(self, bit: int) -> None:
        for root in self._roots.values():
            for node in _subtree(root):
                node.holders &= ~bit
            for node in list(_subtree(root)):
                if node.parent is not None and not node.children:
                    self._prune(node)
        self._held[bit] = 0

    # ------------------------------------------------------------------ structure

    def _root(self, identity: CacheIdentity, *, create: bool) -> _Edge | None:
        if identity is self._last_identity:
            return self._last_root
        root = self._roots.get(identity)
        if root is None:
            if not create:
                return None
            root = self._roots[identity] = _Edge(b"", None, 0)
        self._last_identity, self._last_root = identity, root
        return root

    def _bit(self, replica: ReplicaId) -> int:
        bit = self._bits.get(replica)
        if bit is None:
            bit = self._bits[replica] = 1 << len(self._bits)
            self._held[bit] = 0
        return bit

    def _split(self, child: _Edge, at: int) -> _Edge:
        """Cut ``child``'s edge ``at`` bytes in; returns the new upper edge. O(edge)."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key), "split outside the edge"
        upper = _Edge(child.key[:at], parent, child.holders)
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[:TOKEN_BYTES]] = child
        parent.children[upper.key[:TOKEN_BYTES]] = upper
        self._num_edges += 1
        return upper

    def _prune(self, node: _Edge) -> None:
        """Drop held-by-nobody leaves upward from ``node``, then rejoin edges cut in two whose
        halves are held alike, so the splits removals make do not pile up. O(depth)."""
        while node.parent is not None and not node.holders and not node.children:
            parent = node.parent
            del parent.children[node.key[:TOKEN_BYTES]]
            node.parent = None
            self._num_edges -= 1
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
        upper.key += lower.key
        upper.children = lower.children
        for child in upper.children.values():
            child.parent = upper
        lower.parent = None
        self._num_edges -= 1

    def check_invariants(self) -> None:
        """O(tree) self-check: links, key filing, token counts per replica, no dead leaves."""
        held = dict.fromkeys(self._held, 0)
        count = 0
        for root in self._roots.values():
            for node in _subtree(root):
                for first, child in node.children.items():
                    assert child.parent is node, "edge with the wrong parent"
                    assert child.key[:TOKEN_BYTES] == first and child.key, "edge filed wrongly"
                if node.parent is None:
                    continue
                count += 1
                assert node.holders or node.children, "a leaf nobody holds was kept"
                for bit in held:
                    if node.holders & bit:
                        held[bit] += len(node.key) // TOKEN_BYTES
        assert held == self._held, f"held tokens {self._held} != {held}"
        assert count == self._num_edges, f"num_edges {self._num_edges} != {count}"


def _subtree(root: _Edge) -> Iterator[_Edge]:
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())
