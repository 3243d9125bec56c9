"""vLLM's per-request block flow (``KVCacheManager``) on a :class:`~kvreuse.index.BlockIndex`.

A simulated engine drives a request through the same steps as vLLM's scheduler:

1. ``match(tokens, identity, touch=False)``: ``get_computed_blocks``, read-only;
2. ``allocate_slots(request_id, num_tokens, match=...)``: the request takes references on the
   matched blocks and enough new blocks for ``num_tokens`` tokens; ``None`` when too few blocks
   are free (backpressure: the scheduler retries later or preempts);
3. ``cache_blocks(request_id, tokens)`` after each step: blocks that became full are cached
   under their hashes and a ``BlockStored`` event is emitted. Like vLLM, a recomputed block
   whose hash is already cached elsewhere is cached again (block tables stay append-only);
4. ``free_request(request_id)`` at finish or preemption: blocks are freed tail first.

While a request runs its blocks are referenced and never evicted; after it is freed its full
blocks stay cached until allocation reuses them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvreuse.errors import ConfigError, IndexStateError
from kvreuse.identity import CacheIdentity
from kvreuse.index.block_pool import BlockPool, KVBlock
from kvreuse.index.events import EventSink
from kvreuse.index.hashing import BlockHash, BlockHasher, token_ids_view
from kvreuse.tokens import Tokens

if TYPE_CHECKING:
    from kvreuse.index.block_index import BlockMatch, Namespace


@dataclass(slots=True, eq=False)
class RunningRequest:
    """A running request's blocks (block table order) and the hashes of its full blocks."""

    request_id: Hashable
    namespace: Namespace
    blocks: list[KVBlock]
    hashes: list[BlockHash]
    num_cached_blocks: int

    @property
    def block_ids(self) -> tuple[int, ...]:
        return tuple(block.block_id for block in self.blocks)


class RequestBlocksMixin:
    """The per-request operations of :class:`~kvreuse.index.BlockIndex`."""

    block_size: int
    pool: BlockPool
    hasher: BlockHasher
    on_event: EventSink | None
    requests: dict[Hashable, RunningRequest]

    if TYPE_CHECKING:

        def namespace(self, identity: CacheIdentity | None = None) -> Namespace: ...

        def resolve(self, handle: BlockMatch) -> list[KVBlock]: ...

        def _allocate(self, count: int) -> list[KVBlock] | None: ...

        def _emit_stored(
            self,
            ns: Namespace,
            view: Sequence[int],
            hashes: Sequence[BlockHash],
            positions: list[int],
        ) -> None: ...

    def allocate_slots(
        self,
        request_id: Hashable,
        num_tokens: int,
        *,
        match: BlockMatch | None = None,
        identity: CacheIdentity | None = None,
    ) -> tuple[int, ...] | None:
        """Give ``request_id`` blocks for ``num_tokens`` tokens in all (computed plus new).

        On the first call the request is admitted: it takes a reference on ``match``'s blocks
        (from ``match(..., touch=False)``), whose identity it adopts, else ``identity``. Returns
        the ids of newly allocated blocks, or ``None`` with nothing changed when the free blocks
        (less the free ones the hit would take) do not suffice, as vLLM's ``allocate_slots``.
        O(blocks).
        """
        request = self.requests.get(request_id)
        computed: list[KVBlock] = []
        if request is None:
            if match is not None and identity is not None and identity != match.identity:
                raise ConfigError("identity differs from the match's identity; pass one of them")
            if match is not None:
                computed = self.resolve(match)
            held = len(computed)
        elif match is not None:
            raise IndexStateError(
                f"request {request_id!r} is already running; pass match only on its first call"
            )
        else:
            held = len(request.blocks)
        needed = max(-(-num_tokens // self.block_size) - held, 0)
        taken_by_hit = sum(1 for block in computed if block.ref_cnt == 0)
        if needed + taken_by_hit > self.pool.num_free_blocks:
            return None
        if request is None:
            self.pool.touch(computed)
            request = RunningRequest(
                request_id,
                self.namespace(match.identity if match is not None else identity),
                computed,
                list(match.block_hashes) if match is not None else [],
                len(computed),
            )
            self.requests[request_id] = request
        new = self._allocate(needed) if needed else []
        assert new is not None, "free blocks vanished between the check and the allocation"
        request.blocks.extend(new)
        return tuple(block.block_id for block in new)

    def cache_blocks(
        self, request_id: Hashable, tokens: Tokens, num_computed_tokens: int | None = None
    ) -> int:
        """Cache the request's blocks that are full and computed.

        ``tokens`` is the request's whole token sequence so far (prompt and output, append
        only); ``num_computed_tokens`` (default: all of them) is how many have KV. Hashes are
        extended incrementally, as vLLM's request block hasher does. Returns tokens newly
        cached. O(new tokens).
        """
        request = self._running(request_id)
        view = token_ids_view(tokens)
        computed = len(view) if num_computed_tokens is None else num_computed_tokens
        if not 0 <= computed <= len(view):
            raise ConfigError(
                f"num_computed_tokens must be in [0, {len(view)}] (the tokens passed), "
                f"got {computed}"
            )
        size, hashes, ns = self.block_size, request.hashes, request.namespace
        if len(view) // size > len(hashes):
            start = len(hashes) * size
            parent = hashes[-1] if hashes else None
            hashes.extend(
                self.hasher.iter_hashes(view[start:], size, ns.keys, parent=parent, start=start)
            )
        first = request.num_cached_blocks
        last = min(computed // size, len(request.blocks))
        if last <= first:
            return 0
        for position in range(first, last):
            block = request.blocks[position]
            self.pool.cache_block(block, ns.key(hashes[position]), hashes[position])
        request.num_cached_blocks = last
        if self.on_event is not None:
            self._emit_stored(ns, view, hashes, list(range(first, last)))
        return (last - first) * size

    def free_request(self, request_id: Hashable) -> None:
        """The request finished or was preempted: free its blocks tail first. O(blocks)."""
        request = self._running(request_id)
        del self.requests[request_id]
        self.pool.free_blocks(request.blocks[::-1])
        request.blocks.clear()

    def request_block_ids(self, request_id: Hashable) -> tuple[int, ...]:
        """The request's block table. O(blocks)."""
        return self._running(request_id).block_ids

    def _running(self, request_id: Hashable) -> RunningRequest:
        request = self.requests.get(request_id)
        if request is None:
            raise IndexStateError(
                f"request {request_id!r} is not running; call allocate_slots first"
            )
        return request
