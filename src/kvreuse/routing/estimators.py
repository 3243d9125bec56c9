"""What a router believes each replica has cached.

Two sources, in seed 000's order of accuracy and cost:

* :class:`ApproxTrees` — SGLang router's approach: one radix tree per replica of the prompts the
  router *sent* there. It never hears what the engine evicted, so it over-predicts; it is trimmed
  by LRU to ``max_tree_tokens`` every ``eviction_interval_s`` (SGLang: 120 s, 2**26), and our
  variant may also cap each tree at the replica's cache size (``capacity_tokens``) so the guess
  forgets roughly as fast as the engine does.
* :class:`~kvreuse.routing.mirror.CacheMirror` — Dynamo-style: built only from the KV events
  replicas publish (:mod:`kvreuse.routing.events`), so it tracks real contents up to the event
  lag; one shared radix tree with a replica bit mask per edge, matches rounded down to blocks.

:func:`block_chain` (chained 64-bit block hashes) is kept for callers that key blocks by hash.

Both answer ``predict(request, replica_ids) -> dict[replica, cached tokens]``.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

from kvreuse.errors import ConfigError
from kvreuse.identity import CacheIdentity
from kvreuse.index import RadixIndex
from kvreuse.routing.base import ReplicaId, RequestView
from kvreuse.routing.ring import identity_seed, stable_hash
from kvreuse.tokens import TOKEN_BYTES, TokenBuffer


class ApproxTrees:
    """Per-replica radix trees of what the router sent (SGLang's approximate tree)."""

    def __init__(
        self,
        *,
        eviction_interval_s: float = 120.0,
        max_tree_tokens: int = 2**26,
        capacity_tokens: int | None = None,
    ) -> None:
        if eviction_interval_s <= 0:
            raise ConfigError(f"eviction_interval_s must be > 0, got {eviction_interval_s}")
        if max_tree_tokens < 0:
            raise ConfigError(f"max_tree_tokens must be >= 0, got {max_tree_tokens}")
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_tokens = max_tree_tokens
        self.capacity_tokens = capacity_tokens
        self._trees: dict[ReplicaId, RadixIndex] = {}
        self._next_eviction: float | None = None

    def tree(self, replica: ReplicaId) -> RadixIndex:
        tree = self._trees.get(replica)
        if tree is None:
            tree = RadixIndex(capacity_tokens=self.capacity_tokens)
            self._trees[replica] = tree
        return tree

    def tree_tokens(self, replica: ReplicaId) -> int:
        tree = self._trees.get(replica)
        return 0 if tree is None else tree.total_tokens

    def predict(
        self, request: RequestView, replicas: Iterable[ReplicaId], now: float
    ) -> dict[ReplicaId, int]:
        """Longest match of the prompt in each replica's tree. O(r·n) bytes compared."""
        self._maybe_evict(now)
        out: dict[ReplicaId, int] = {}
        for rid in replicas:
            tree = self._trees.get(rid)
            if tree is None:
                out[rid] = 0
            else:
                out[rid] = tree.match(request.tokens, request.identity, now).length
        return out

    def record(self, request: RequestView, replica: ReplicaId, now: float) -> None:
        """The router sent ``request`` to ``replica``: remember its prompt there."""
        self.tree(replica).insert(request.tokens, request.identity, now)

    def _maybe_evict(self, now: float) -> None:
        if self._next_eviction is None:
            self._next_eviction = now + self.eviction_interval_s
        if now < self._next_eviction:
            return
        for tree in self._trees.values():
            overflow = tree.total_tokens - self.max_tree_tokens
            if overflow > 0:
                tree.evict(overflow)
        self._next_eviction = now + self.eviction_interval_s


def block_chain(tokens: TokenBuffer, identity: CacheIdentity, block_size: int) -> list[int]:
    """Chained 64-bit hashes of the full blocks of ``tokens``: entry b names the prefix of
    (b+1)·block_size tokens under ``identity``. O(n)."""
    step = block_size * TOKEN_BYTES
    full = len(tokens) // step
    digest = xxhash.xxh3_64_intdigest
    h = stable_hash(identity_seed(identity))
    chain = []
    for b in range(full):
        h = digest(tokens[b * step : (b + 1) * step], seed=h)
        chain.append(h)
    return chain
