"""vLLM's block pool as a replica's KV memory (``cache_kind="block"``).

See :mod:`kvreuse.sim.memory` for the memory contract and how the block model differs from the
radix one: the pool *is* the replica's memory, requests are admitted with vLLM's
``get_computed_blocks`` and ``allocate_slots``, whole blocks are cached at prefill end and at
release, and vLLM's hash-named KV events are translated back to token paths for the router by
the gateway's own translator (:class:`~kvreuse.routing.event_index.EventIndex`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvreuse.errors import ConfigError
from kvreuse.identity import DEFAULT_IDENTITY, CacheIdentity
from kvreuse.index import BlockIndex, KVCacheEvent
from kvreuse.routing.event_index import EventIndex
from kvreuse.sim.memory import Job, KvSink
from kvreuse.sim.requests import SimRequest
from kvreuse.tokens import TokenBuffer

if TYPE_CHECKING:
    from kvreuse.sim.config import ReplicaConfig

SIM_HASH_SEED = "kvreuse-sim"
"""Block hashes only name blocks inside one run; a fixed seed keeps runs identical anyway."""


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
        # The tokens and namespace of the blocks being cached: events carry neither whole.
        self._storing: tuple[TokenBuffer, CacheIdentity] = (TokenBuffer(b""), DEFAULT_IDENTITY)
        self._translator = EventIndex(replica_id)
        self.cache = BlockIndex(
            num_blocks=blocks + 1,  # block 0 is vLLM's null block
            block_size=size,
            algorithm="xxhash",
            none_hash_seed=SIM_HASH_SEED,
            on_event=self._translate if self._sink is not None else None,
            events_name_keys=True,  # a replica here may serve several models
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

    def cached_prefix(self, request: SimRequest) -> int:
        return self.peek(request, 0.0)  # match(touch=False) reads, whatever the time

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
        """The engine's events as the gateway would forward them, under the model being cached
        (events name none, and a replica here may serve several), with paths sliced from the
        tokens being cached rather than rebuilt from the translator's tree."""
        assert self._sink is not None
        tokens, identity = self._storing
        for routed in self._translator.apply(event, self._now, identity, tokens).routing_events:
            self._sink(routed)

    def check_invariants(self) -> None:
        self.cache.check_invariants()
        self._translator.check_invariants()
        assert self.used_tokens <= self.capacity_tokens, "pool over capacity"
