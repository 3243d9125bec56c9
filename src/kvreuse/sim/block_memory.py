"""vLLM's block pool as a replica's KV memory (``cache_kind="block"``).

See :mod:`kvreuse.sim.memory` for the memory contract and how the block model differs from the
radix one: the pool *is* the replica's memory, requests are admitted with vLLM's
``get_computed_blocks`` and ``allocate_slots``, whole blocks are cached at prefill end and at
release, and vLLM's hash-named KV events are translated back to token paths for the router.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvreuse.errors import ConfigError
from kvreuse.identity import DEFAULT_IDENTITY, CacheIdentity
from kvreuse.index import AllBlocksCleared, BlockIndex, BlockRemoved, BlockStored, KVCacheEvent
from kvreuse.index.hashing import BlockHash
from kvreuse.routing.events import KvCleared, KvRemoved, KvStored
from kvreuse.sim.memory import Job, KvSink
from kvreuse.sim.requests import SimRequest
from kvreuse.tokens import TOKEN_BYTES, TokenBuffer

if TYPE_CHECKING:
    from kvreuse.sim.config import ReplicaConfig

SIM_HASH_SEED = "kvreuse-sim"
"""Block hashes only name blocks inside one run; a fixed seed keeps runs identical anyway."""


class _HeldBlock:
    """Where a cached block hash sits: the first ``end`` tokens of ``path`` end with it."""

    __slots__ = ("copies", "end", "identity", "path")

    def __init__(self, path: bytes, end: int, identity: CacheIdentity) -> None:
        self.path = path
        self.end = end
        self.identity = identity
        self.copies = 1


class BlockMemory:
    """The ``block`` model; see the module docstring."""

    def __init__(self, replica_id: str, config: ReplicaConfig, sink: KvSink | None) -> None:
        size = config.block_size
        blocks = config.pool_tokens // size
        if blocks < 1:
            raise ConfigError(
                f"pool_tokens {config.pool_tokens} holds no {size}-token block; raise it"
            )
        self.replica_id = replica_id
        self.block_size = size
        self._caching = config.prefix_caching
        self._sink = sink if config.prefix_caching else None
        self._now = 0.0
        self._storing: tuple[bytes, CacheIdentity] = (b"", DEFAULT_IDENTITY)
        self._held: dict[BlockHash, _HeldBlock] = {}
        self.cache = BlockIndex(
            num_blocks=blocks + 1,  # block 0 is vLLM's null block
            block_size=size,
            algorithm="xxhash",
            none_hash_seed=SIM_HASH_SEED,
            on_event=self._translate if self._sink is not None else None,
        )

    @property
    def capacity_tokens(self) -> int:
        return self.cache.capacity_tokens

    @property
    def evicted_tokens(self) -> int:
        return self.cache.evicted_tokens_total

    @property
    def private_tokens(self) -> int:
        """Blocks running requests hold that carry no hash (yet). O(running)."""
        held = sum(len(r.blocks) - r.num_cached_blocks for r in self.cache.requests.values())
        return held * self.block_size

    @property
    def used_tokens(self) -> int:
        return self.cache.pool.num_used_blocks * self.block_size

    def footprint(self, request: SimRequest) -> int:
        size = self.block_size
        return -(-(request.prompt_len + request.output_len) // size) * size

    def peek(self, request: SimRequest, now: float) -> int:
        if not self._caching:
            return 0
        return self.cache.match(request.tokens, request.identity, now, touch=False).length

    def admit(self, job: Job, now: float) -> bool:
        request = job.request
        self._now = now
        found = None
        if self._caching:
            found = self.cache.match(request.tokens, request.identity, now, touch=False)
        job.cached = 0 if found is None else found.length
        granted = self.cache.allocate_slots(
            request.request_id,
            request.prompt_len + request.output_len,
            match=found,
            identity=None if found is not None else request.identity,
        )
        if granted is None:
            return False
        job.handle = request.request_id
        return True

    def prefilled(self, job: Job, now: float) -> None:
        if self._caching:
            self._cache_blocks(job, job.request.tokens, now)
            job.prompt_cached = True

    def release(self, job: Job, now: float) -> None:
        request = job.request
        if self._caching:
            output = request.output
            full = request.tokens if output is None else TokenBuffer(request.tokens + output)
            self._cache_blocks(job, full, now)
        self._now = now
        self.cache.free_request(request.request_id)
        job.handle = None

    def _cache_blocks(self, job: Job, tokens: TokenBuffer, now: float) -> None:
        self._now = now
        self._storing = (tokens, job.request.identity)
        self.cache.cache_blocks(job.request.request_id, tokens)

    def _translate(self, event: KVCacheEvent) -> None:
        """vLLM's hash-named events to token-path events (the gateway does the same from the
        wire). A hash stays held while any copy of its block is cached."""
        assert self._sink is not None
        size = self.block_size
        if isinstance(event, BlockStored):
            path, identity = self._storing
            parent = event.parent_block_hash
            start = 0 if parent is None else self._held[parent].end
            end = start
            for block_hash in event.block_hashes:
                end += size
                held = self._held.get(block_hash)
                if held is None:
                    self._held[block_hash] = _HeldBlock(path, end, identity)
                else:
                    held.copies += 1
            stored = TokenBuffer(path[: end * TOKEN_BYTES])
            self._sink(KvStored(self.replica_id, stored, identity, self._now))
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                held = self._held[block_hash]
                held.copies -= 1
                if held.copies == 0:
                    del self._held[block_hash]
                    cut = TokenBuffer(held.path[: held.end * TOKEN_BYTES])
                    self._sink(
                        KvRemoved(self.replica_id, cut, held.end - size, held.identity, self._now)
                    )
        else:
            assert isinstance(event, AllBlocksCleared), f"unknown KV event {event!r}"
            self._held.clear()
            self._sink(KvCleared(self.replica_id, self._now))

    def check_invariants(self) -> None:
        self.cache.check_invariants()
        assert self.used_tokens <= self.capacity_tokens, "pool over capacity"
