"""A replica's KV memory: the prefix cache and the running requests' KV in one pool.

Two models, chosen by ``ReplicaConfig.cache_kind`` (:data:`kvreuse.sim.replica.CACHE_KINDS`);
the block model's code is in :mod:`kvreuse.sim.block_memory`:

``radix`` (SGLang's RadixAttention, token granular) — a :class:`~kvreuse.index.RadixIndex` plus
a count of private tokens. The pool holds ``pool_tokens`` of KV: every token the tree holds
(locked by a running request or idle) and each running request's private KV (prompt tokens not
yet in the tree, and its output). Always ``cache.total_tokens + private_tokens <= pool_tokens``.
A request is admitted by matching and locking its cached prefix and reserving ``uncached +
output_len`` tokens, evicting idle LRU leaves first if they do not fit (so shared trunks outlive
private tails). At prefill end the prompt is inserted and the lock moves to it (a concurrent
request with the same prefix now hits); at release prompt + output are inserted (the next turn
matches through its own answer) and the lock is dropped.

``block`` (vLLM's automatic prefix caching, block granular) — a
:class:`~kvreuse.index.BlockIndex` whose pool *is* the replica's memory: ``pool_tokens //
block_size`` blocks. A request is admitted with vLLM's ``get_computed_blocks`` (whole blocks, at
most prompt - 1 tokens) and ``allocate_slots`` for prompt + output, which reuses the least
recently freed cached blocks when no empty one is left; full prompt blocks are cached at prefill
end, full prompt + output blocks at release, then the request's blocks are freed tail first. A
partial last block is never cached, so block granularity costs tokens the radix model keeps.

Both reserve the output up front (an engine told ``max_tokens``): it moves *when* memory is
taken, not how much. ``admit`` returning ``False`` means the request does not fit even with the
idle cache evicted; the replica then waits for a finish (see :mod:`kvreuse.sim.replica`).

KV events. With a ``sink`` both publish path events (:mod:`kvreuse.routing.events`): a
:class:`KvStored` when prompt (or prompt + output) enters the cache, a :class:`KvRemoved` per
evicted radix leaf (through ``RadixIndex(on_evict=...)``) or per block hash whose last copy was
reused (the block model translates vLLM's hash-named events back to token paths).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from kvreuse.index import BlockIndex, RadixIndex, RadixNode
from kvreuse.routing.events import KvEvent, KvRemoved, KvStored
from kvreuse.sim.requests import SimRequest
from kvreuse.tokens import TOKEN_BYTES, TokenBuffer

if TYPE_CHECKING:
    from kvreuse.sim.config import ReplicaConfig

KvSink = Callable[[KvEvent], None]


class Job:
    """A request's mutable state inside its replica (engine-internal; records are frozen).

    ``estimate``: uncached prompt tokens counted in the replica's queue; ``cached``: prompt
    tokens found cached at admission; ``handle``: what the memory holds for the request;
    ``private``: tokens of the pool reserved for it outside the cache (radix model);
    ``prefill_s``: how long its prefill took, once started; ``sent``:
    what a router measuring speeds knew as it routed the request (the fleet's, or ``None``)."""

    __slots__ = (
        "branch",
        "cached",
        "estimate",
        "handle",
        "predicted",
        "prefill_end",
        "prefill_s",
        "private",
        "prompt_cached",
        "request",
        "sent",
    )

    def __init__(self, request: SimRequest, branch: str, predicted: int) -> None:
        self.request = request
        self.branch = branch
        self.predicted = predicted
        self.estimate = 0
        self.cached = 0
        self.prefill_end = 0.0
        self.prefill_s = 0.0
        self.private = 0
        self.prompt_cached = False
        self.handle: object = None
        self.sent: tuple[int, int, int, str] | None = None


class ReplicaMemory(Protocol):
    """What a replica asks of its KV memory. One instance per replica."""

    @property
    def cache(self) -> RadixIndex | BlockIndex:
        """The index itself, for inspection."""
        ...

    @property
    def capacity_tokens(self) -> int:
        """Tokens of KV the pool can hold at once."""
        ...

    @property
    def evicted_tokens(self) -> int:
        """Cached tokens evicted over the run."""
        ...

    @property
    def private_tokens(self) -> int:
        """Tokens running requests hold outside the prefix cache."""
        ...

    @property
    def used_tokens(self) -> int:
        """Tokens of the pool in use, cache included."""
        ...

    def footprint(self, request: SimRequest) -> int:
        """Pool tokens ``request`` needs with nothing cached (prompt + output, rounded to the
        memory's granularity); never smaller for a larger prompt + output, which lets the fleet
        check only its largest request."""
        ...

    def peek(self, request: SimRequest, now: float) -> int:
        """Cached prefix of ``request`` now, for queue estimates and lpm; called at enqueue
        and when lpm orders the queue."""
        ...

    def cached_prefix(self, request: SimRequest) -> int:
        """Cached prefix of ``request`` now, read without touching or changing the cache: for
        observers outside the run (``benchmarks/default_vs_peers.py --at-arrival``), whose
        looking must not move the run's figures."""
        ...

    def admit(self, job: Job, now: float) -> bool:
        """``job`` is picked to prefill: set ``job.cached``, hold its prefix and reserve its
        KV; ``False`` (nothing held) when it does not fit even after evicting idle cache."""
        ...

    def prefilled(self, job: Job, now: float) -> None:
        """``job``'s prompt KV is computed and decode starts: cache the prompt, keep it held."""
        ...

    def release(self, job: Job, now: float) -> None:
        """``job`` finished: cache prompt + output, free everything it held."""
        ...

    def check_invariants(self) -> None:
        """Self-check of the pool and the index. O(cache)."""
        ...


class RadixMemory:
    """The ``radix`` model; see the module docstring."""

    def __init__(self, replica_id: str, config: ReplicaConfig, sink: KvSink | None) -> None:
        self.replica_id = replica_id
        self.pool_tokens = config.pool_tokens
        self._caching = config.prefix_caching
        self._sink = sink if config.prefix_caching else None
        self._now = 0.0
        self.private = 0
        self.cache = RadixIndex(
            page_size=config.page_size,
            eviction=config.eviction,
            on_evict=self._evicted if self._sink is not None else None,
        )

    @property
    def capacity_tokens(self) -> int:
        return self.pool_tokens

    @property
    def evicted_tokens(self) -> int:
        return self.cache.evicted_tokens_total

    @property
    def private_tokens(self) -> int:
        return self.private

    @property
    def used_tokens(self) -> int:
        return self.cache.total_tokens + self.private

    def footprint(self, request: SimRequest) -> int:
        return request.prompt_len + request.output_len

    def peek(self, request: SimRequest, now: float) -> int:
        if not self._caching:
            return 0
        return self.cache.match_length(request.tokens, request.identity, now)

    def cached_prefix(self, request: SimRequest) -> int:
        if not self._caching:
            return 0
        return self.cache.prefix_length(request.tokens, request.identity)

    def admit(self, job: Job, now: float) -> bool:
        request = job.request
        cache = self.cache
        self._now = now
        if self._caching:
            found = cache.match(request.tokens, request.identity, now)
            node, cached = found.node, found.length
        else:
            node, cached = cache.root(request.identity), 0
        job.cached = cached
        private = request.prompt_len - cached + request.output_len
        cache.lock(node)
        over = cache.total_tokens + self.private + private - self.pool_tokens
        if over > 0:
            cache.evict(over)
            if cache.total_tokens + self.private + private > self.pool_tokens:
                cache.unlock(node)
                return False
        job.handle = node
        job.private = private
        self.private += private
        return True

    def prefilled(self, job: Job, now: float) -> None:
        if not self._caching:
            return
        request = job.request
        cache = self.cache
        self._now = now
        held = job.handle
        assert isinstance(held, RadixNode), "prefilled before admit"
        # The held node ends at the cached prefix, so the prompt grows from there (no second
        # walk from the root, and no second "hit" counted on the path).
        end = cache.extend(held, request.tokens, now)
        cache.lock(end)
        cache.unlock(held)
        job.handle = end
        uncached = request.prompt_len - job.cached
        self.private -= uncached
        job.private -= uncached
        job.prompt_cached = True
        if self._sink is not None:
            self._sink(KvStored(self.replica_id, request.tokens, request.identity, now))

    def release(self, job: Job, now: float) -> None:
        request = job.request
        cache = self.cache
        self._now = now
        held = job.handle
        assert isinstance(held, RadixNode), "released before admit"
        if self._caching:
            output = request.output
            full = request.tokens if output is None else TokenBuffer(request.tokens + output)
            cache.extend(held, full, now)
            if self._sink is not None and (output is not None or not job.prompt_cached):
                self._sink(KvStored(self.replica_id, full, request.identity, now))
        cache.unlock(held)
        job.handle = None
        self.private -= job.private
        job.private = 0

    def _evicted(self, node: RadixNode) -> None:
        """``on_evict`` hook: the leaf is still linked, so its path can be read."""
        assert self._sink is not None
        path = TokenBuffer(node.path_key())
        keep = (len(path) - len(node.key)) // TOKEN_BYTES
        self._sink(KvRemoved(self.replica_id, path, keep, node.identity, self._now))

    def check_invariants(self) -> None:
        self.cache.check_invariants()
        assert self.private >= 0, "negative private KV"
        assert self.used_tokens <= self.pool_tokens, f"pool over capacity: {self.used_tokens}"
