"""One simulated engine replica: a KV pool, a radix cache inside it, a prefill queue, decode.

Memory (seed 001, "cache memory is borrowed, not reserved"). The pool holds ``pool_tokens`` of
KV. Two things live in it: the radix cache (every token the tree holds, whether a running request
has it locked or not) and each running request's private KV (prompt tokens not yet in the tree,
and its output tokens). Always ``cache.total_tokens + private_tokens <= pool_tokens``.

Admission. When a request is picked to prefill, its cached prefix is matched and locked, then
``uncached + output_len`` tokens are reserved (the output is reserved up front, as for an engine
told ``max_tokens``; it only moves *when* the memory is taken, not how much). If they do not fit,
unlocked cache is evicted (LRU leaves, so shared trunks outlive private tails). If even an empty
cache would not make room because running requests pin the rest, the request is not refused and
nothing is preempted: it waits at the head of the queue, and the replica admits nothing else
until a finishing request frees memory (head-of-line blocking, which is what shows up in TTFT).
A request larger than the whole pool could never run and is a configuration error.

Prefill batching rule. A replica prefills one request at a time, in scheduling order, each
costing ``overhead_s + uncached / prefill_tokens_per_s`` (seed 001: 15 ms, 10,000 tok/s). With
this additive cost, grouping k requests into one step would take exactly the sum of their costs
and only delay the first token of the earlier ones, so the serial form *is* the batching rule:
chunked prefill with a budget of one request per step. Decode runs beside prefill and costs no
prefill time: a request's last token comes ``output_len × time_per_output_token_s`` after its
first.

Cache updates. When prefill ends the prompt is inserted and the lock moves to it (a concurrent
request with the same document now hits); at finish prompt + output are inserted (the next turn
matches through its own answer) and the lock is released.

Scheduling. ``fcfs``; or ``lpm``, longest cached prefix first (SGLang), which falls back to fcfs
when more than ``lpm_max_waiting`` (128, SGLang's rule) requests wait.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvreuse.errors import ConfigError
from kvreuse.identity import CacheIdentity
from kvreuse.index import RadixIndex, RadixNode
from kvreuse.routing.base import ReplicaLoad
from kvreuse.routing.events import KvEvent, KvRemoved, KvStored
from kvreuse.sim.engine import Engine, Finish, PrefillDone
from kvreuse.sim.requests import SimRequest
from kvreuse.tokens import TOKEN_BYTES, TokenBuffer

SCHEDULERS = ("fcfs", "lpm")


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """A replica's constants. Defaults are seed 001's illustrative numbers."""

    pool_tokens: int = 8192
    prefill_tokens_per_s: float = 10_000.0
    overhead_s: float = 0.015
    time_per_output_token_s: float = 0.02
    scheduling: str = "fcfs"
    lpm_max_waiting: int = 128
    page_size: int = 1
    eviction: str = "lru"
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.pool_tokens <= 0:
            raise ConfigError(f"pool_tokens (cache tokens) must be > 0, got {self.pool_tokens}")
        if self.prefill_tokens_per_s <= 0:
            raise ConfigError(f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}")
        if self.overhead_s < 0 or self.time_per_output_token_s < 0:
            raise ConfigError("overhead_s and time_per_output_token_s must be >= 0")
        if self.scheduling not in SCHEDULERS:
            raise ConfigError(f"scheduling must be one of {SCHEDULERS}, got {self.scheduling!r}")


class Job:
    """A request's mutable state inside its replica (engine-internal; records are frozen)."""

    __slots__ = (
        "branch",
        "cached",
        "estimate",
        "lock_node",
        "predicted",
        "prefill_end",
        "request",
    )

    def __init__(self, request: SimRequest, branch: str, predicted: int) -> None:
        self.request = request
        self.branch = branch
        self.predicted = predicted
        self.estimate = 0
        self.cached = 0
        self.prefill_end = 0.0
        self.lock_node: RadixNode | None = None


class EventingRadix(RadixIndex):
    """A :class:`RadixIndex` that reports each evicted leaf as a :class:`KvRemoved` event.

    Relies on ``RadixIndex._detach_leaf`` being the single place leaves leave the tree; a public
    eviction callback on the index would be the cleaner hook. ``tests/sim`` checks that removal
    events keep flowing, so a refactor of the index cannot silently blind the ``exact`` policy.
    """

    def __init__(self, replica: str, sink: Callable[[KvEvent], None], **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self._replica = replica
        self._sink = sink
        self.event_time = 0.0

    def _detach_leaf(self, node: RadixNode) -> RadixNode:
        parts: list[bytes] = []
        walker: RadixNode | None = node
        while walker is not None and walker.parent is not None:
            parts.append(walker.key)
            walker = walker.parent
        path = TokenBuffer(b"".join(reversed(parts)))
        keep = len(path) // TOKEN_BYTES - node.num_tokens
        self._sink(KvRemoved(self._replica, path, keep, node.identity, self.event_time))
        return super()._detach_leaf(node)


class Replica:
    """See the module docstring."""

    def __init__(
        self,
        index: int,
        config: ReplicaConfig,
        engine: Engine,
        on_first_token: Callable[[Job, int, float], None],
        on_finish: Callable[[Job, int, float], None],
        kv_sink: Callable[[KvEvent], None] | None = None,
    ) -> None:
        self.index = index
        self.replica_id = f"r{index}"
        self.config = config
        self.engine = engine
        self._on_first_token = on_first_token
        self._on_finish = on_finish
        self._kv_sink = kv_sink
        self.cache: RadixIndex
        if kv_sink is None:
            self.cache = RadixIndex(page_size=config.page_size, eviction=config.eviction)
        else:
            self.cache = EventingRadix(
                self.replica_id, kv_sink, page_size=config.page_size, eviction=config.eviction
            )
        self.waiting: list[Job] = []
        self.busy: Job | None = None
        self.private_tokens = 0
        self.queued_prefill_tokens = 0
        self.in_flight = 0
        self.blocked_admissions = 0
        self.prefill_busy_s = 0.0
        self.requests_served = 0
        self._rate = config.prefill_tokens_per_s
        self._tpot = config.time_per_output_token_s
        self._overhead = config.overhead_s
        self._lpm = config.scheduling == "lpm"
        self._caching = config.prefix_caching

    # ------------------------------------------------------------------ views

    @property
    def evicted_tokens(self) -> int:
        return self.cache.evicted_tokens_total

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(
            self.replica_id,
            self.queued_prefill_tokens,
            len(self.waiting) + (self.busy is not None),
            self.in_flight,
        )

    # ------------------------------------------------------------------ request life

    def enqueue(self, job: Job, now: float) -> None:
        """A routed request arrives. Its queued prefill estimate uses the cache as it is now."""
        request = job.request
        need = request.prompt_len + request.output_len
        if need > self.config.pool_tokens:
            raise ConfigError(
                f"request {request.request_id} needs {need} tokens of KV (prompt + output) but "
                f"a replica's pool holds {self.config.pool_tokens}; raise the cache size"
            )
        cached = 0
        if self._caching:
            cached = self.cache.match(request.tokens, request.identity, now).length
        job.estimate = request.prompt_len - cached
        self.queued_prefill_tokens += job.estimate
        self.in_flight += 1
        self.waiting.append(job)
        if self.busy is None:
            self._start_next(now)

    def _pick(self, now: float) -> int:
        """Index in ``waiting`` of the next request to prefill."""
        waiting = self.waiting
        if not self._lpm or not self._caching or len(waiting) <= 1:
            return 0
        if len(waiting) > self.config.lpm_max_waiting:
            return 0
        match = self.cache.match
        best, best_len = 0, -1
        for pos, job in enumerate(waiting):
            length = match(job.request.tokens, job.request.identity, now).length
            if length > best_len:
                best, best_len = pos, length
        return best

    def _start_next(self, now: float) -> None:
        if not self.waiting:
            return
        pos = self._pick(now)
        job = self.waiting[pos]
        request = job.request
        cache = self.cache
        if isinstance(cache, EventingRadix):
            cache.event_time = now
        if self._caching:
            found = cache.match(request.tokens, request.identity, now)
            node, cached = found.node, found.length
        else:
            node, cached = cache.root(request.identity), 0
        cache.lock(node)
        uncached = request.prompt_len - cached
        need = uncached + request.output_len
        over = cache.total_tokens + self.private_tokens + need - self.config.pool_tokens
        if over > 0:
            cache.evict(over)
            if cache.total_tokens + self.private_tokens + need > self.config.pool_tokens:
                cache.unlock(node)
                self.blocked_admissions += 1
                return  # waits until a finish frees memory
        del self.waiting[pos]
        self.private_tokens += need
        self.queued_prefill_tokens += uncached - job.estimate
        job.estimate = uncached
        job.cached = cached
        job.lock_node = node
        duration = self._overhead + uncached / self._rate
        self.prefill_busy_s += duration
        self.busy = job
        self.engine.schedule(now + duration, PrefillDone(self.index, job))

    def prefill_done(self, job: Job, now: float) -> None:
        request = job.request
        cache = self.cache
        if isinstance(cache, EventingRadix):
            cache.event_time = now
        self.queued_prefill_tokens -= job.estimate
        job.prefill_end = now
        if self._caching:
            cache.insert(request.tokens, request.identity, now)
            found = cache.match(request.tokens, request.identity, now)
            cache.lock(found.node)
            assert job.lock_node is not None
            cache.unlock(job.lock_node)
            job.lock_node = found.node
            self.private_tokens -= job.estimate
            job.estimate = 0
        if self._kv_sink is not None and self._caching:
            self._kv_sink(KvStored(self.replica_id, request.tokens, request.identity, now))
        self.busy = None
        self._on_first_token(job, self.index, now)
        self.engine.schedule(now + request.output_len * self._tpot, Finish(self.index, job))
        self._start_next(now)

    def finish(self, job: Job, now: float) -> None:
        request = job.request
        cache = self.cache
        if isinstance(cache, EventingRadix):
            cache.event_time = now
        full = request.tokens if request.output is None else request.tokens + request.output
        if self._caching:
            cache.insert(full, request.identity, now)
        assert job.lock_node is not None
        cache.unlock(job.lock_node)
        job.lock_node = None
        # Without caching the prompt stayed private (job.estimate); with it, only the output.
        self.private_tokens -= request.output_len + job.estimate
        self.in_flight -= 1
        self.requests_served += 1
        if self._kv_sink is not None and self._caching and request.output is not None:
            self._kv_sink(KvStored(self.replica_id, TokenBuffer(full), request.identity, now))
        self._on_finish(job, self.index, now)
        if self.busy is None:
            self._start_next(now)

    def check_invariants(self) -> None:
        """Pool accounting and the cache's own invariants. O(cache nodes)."""
        self.cache.check_invariants()
        assert self.private_tokens >= 0, "negative private KV"
        used = self.cache.total_tokens + self.private_tokens
        assert used <= self.config.pool_tokens, f"pool over capacity: {used}"

    def namespaces(self) -> list[CacheIdentity]:
        return self.cache.identities()
