"""A simulated vLLM replica: a real block cache, a prefill queue, timed token streaming.

Timing model (documented in ``kvreuse engine --help``):

* one prefill lane, first come first served: a request waits for the requests ahead of it, then
  takes ``overhead_s + uncached_tokens / prefill_tokens_per_s``; TTFT = queueing + that;
* decode runs batched beside prefill: the first output token comes with the end of prefill,
  every next one ``time_per_output_token_s`` later (the request finishes one step after its
  last token, when a simulated replica's does);
* KV: the cache is a :class:`~kvreuse.index.BlockIndex` driven through vLLM's per-request flow
  (``match`` read-only, ``allocate_slots`` for prompt plus ``max_tokens``, ``cache_blocks`` after
  prefill and at finish, ``free_request`` tail first), so hits, eviction order and the KV events
  are vLLM's. A request that does not fit waits until a running one finishes; one that could
  never fit is refused.

Counters carry vLLM's metric meaning: ``queries`` are prompt tokens looked up at admission and
``hits`` the tokens served from cache (their ratio is the token hit rate).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.identity import CacheIdentity
from kvreuse.index import BlockIndex
from kvreuse.index.events import KVCacheEvent
from kvreuse.tokens import TokenBuffer, num_tokens, pack

EventsSink = Callable[[list[KVCacheEvent], float], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """A simulated replica's constants (seed 001's illustrative figures by default)."""

    model: str = "kvreuse-sim"
    block_size: int = 16
    num_blocks: int = 8192
    prefill_tokens_per_s: float = 10_000.0
    overhead_s: float = 0.015
    time_per_output_token_s: float = 0.005
    max_model_len: int = 32_768
    hash_algorithm: str = "sha256"
    served_names: tuple[str, ...] = ()  # vLLM's --served-model-name; empty: ``model`` alone

    @property
    def names(self) -> tuple[str, ...]:
        """The model names requests may use; all share one cache, as in vLLM."""
        return self.served_names or (self.model,)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_blocks < 2:
            raise ConfigError("block_size must be >= 1 and num_blocks >= 2 (one is the null block)")
        if not 0 < self.prefill_tokens_per_s < math.inf:  # also refuses NaN
            raise ConfigError(f"prefill_tokens_per_s must be a finite number > 0, got "
                              f"{self.prefill_tokens_per_s}")
        if not (0 <= self.overhead_s < math.inf and 0 <= self.time_per_output_token_s < math.inf):
            raise ConfigError("overhead_s and time_per_output_token_s must be finite and >= 0, "
                              f"got {self.overhead_s} and {self.time_per_output_token_s}")
        if self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        for name in self.names:
            if not name.strip():
                raise ConfigError(f"a served model name must not be empty, got {name!r}")


@dataclass(frozen=True, slots=True)
class Prefilled:
    """A request after prefill: how much of its prompt came from cache, and when."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    queued_s: float
    prefill_s: float


TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
"""vLLM's bucket bounds for ``vllm:time_to_first_token_seconds`` (v1 metrics), in seconds."""


@dataclass(slots=True)
class Counters:
    """Monotonic counters behind /metrics. ``ttft_buckets[i]``: requests whose time to first
    token (arrival at the replica to the end of prefill) was at most ``TTFT_BUCKETS_S[i]`` and
    more than the bound before (not cumulative; the exposition sums them)."""

    queries: int = 0
    hits: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft_sum_s: float = 0.0
    ttft_count: int = 0
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * len(TTFT_BUCKETS_S))

    def observe_ttft(self, seconds: float) -> None:
        """One request's first token, ``seconds`` after it reached the replica. O(buckets)."""
        self.ttft_sum_s += seconds
        self.ttft_count += 1
        for i, bound in enumerate(TTFT_BUCKETS_S):
            if seconds <= bound:
                self.ttft_buckets[i] += 1
                return


class SimulatedReplica:
    """One replica. Methods must be called from one event loop."""

    def __init__(self, config: EngineConfig, *, on_events: EventsSink | None = None) -> None:
        self.config = config
        self._pending: list[KVCacheEvent] = []
        self.cache = BlockIndex(
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            algorithm=config.hash_algorithm,
            on_event=self._pending.append,
        )
        self.counters = Counters()
        self._on_events = on_events
        self._prefill_lane = asyncio.Lock()
        self._freed = asyncio.Condition()
        self._ids = itertools.count()
        self.waiting = 0
        self.running = 0

    @property
    def kv_usage(self) -> float:
        """Fraction of blocks referenced by running requests (vLLM's kv_cache_usage_perc)."""
        return self.cache.pool.usage()

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def check_fits(self, tokens: TokenBuffer, max_tokens: int) -> None:
        """Refuse (InputFormatError naming the field) a request this replica could never serve:
        an empty prompt, or prompt plus ``max_tokens`` past the context length or the KV pool.
        Called by :meth:`prefill` and before rendering, so both refuse alike. O(1)."""
        count = num_tokens(tokens)
        if count == 0:
            raise InputFormatError("the prompt is empty", "prompt")
        if count + max_tokens > self.config.max_model_len:
            raise InputFormatError(
                f"prompt ({count} tokens) plus max_tokens ({max_tokens}) exceeds the model's "
                f"context length {self.config.max_model_len}", "max_tokens"
            )
        blocks_needed = -(-(count + max_tokens) // self.config.block_size)
        if blocks_needed > self.config.num_blocks - 1:
            raise InputFormatError(
                f"the request needs {blocks_needed} KV blocks, the replica has "
                f"{self.config.num_blocks - 1}", "max_tokens"
            )

    async def prefill(
        self, request_id: str, tokens: TokenBuffer, identity: CacheIdentity, max_tokens: int
    ) -> Prefilled:
        """Queue, admit and prefill one request; the caller must later call :meth:`finish`."""
        self.check_fits(tokens, max_tokens)
        count = num_tokens(tokens)
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        self.waiting += 1
        try:
            async with self._prefill_lane:
                match = await self._admit(request_id, tokens, identity, count + max_tokens)
                self.waiting -= 1
                self.running += 1
                started = loop.time()
                cached = match
                self.counters.requests += 1
                self.counters.queries += count
                self.counters.hits += cached
                self.counters.prompt_tokens += count
                prefill_s = self.config.overhead_s + (count - cached) / (
                    self.config.prefill_tokens_per_s
                )
                await asyncio.sleep(prefill_s)
                self.cache.cache_blocks(request_id, tokens)
                await self._flush(loop.time())
                self.counters.observe_ttft(loop.time() - arrived)
        except BaseException:
            if request_id in self.cache.requests:
                self.cache.free_request(request_id)
                self.running -= 1
            else:
                self.waiting -= 1
            raise
        return Prefilled(request_id, count, cached, started - arrived, prefill_s)

    async def _admit(
        self, request_id: str, tokens: TokenBuffer, identity: CacheIdentity, total: int
    ) -> int:
        """Take blocks for the request, waiting for running requests to free some."""
        while True:
            match = self.cache.match(tokens, identity, touch=False)
            if self.cache.allocate_slots(request_id, total, match=match) is not None:
                return match.length
            async with self._freed:
                await self._freed.wait()

    async def decode(self, max_tokens: int, filler: list[int]) -> AsyncIterator[int]:
        """Yield ``max_tokens`` filler token ids: the first as soon as prefill is done (vLLM
        samples it in the prefill step, so TTFT is queueing plus prefill, as in the simulator),
        each next one ``time_per_output_token_s`` later; the iterator ends one more step after
        the last, so the request holds its blocks ``max_tokens`` steps after prefill, as a
        simulated replica does."""
        tpot = self.config.time_per_output_token_s
        for index in range(max_tokens):
            self.counters.generation_tokens += 1
            yield filler[index % len(filler)]
            await asyncio.sleep(tpot)

    async def finish(self, request_id: str, tokens: TokenBuffer, output: list[int]) -> None:
        """Cache the request's full blocks (prompt and output) and free them tail first."""
        if request_id not in self.cache.requests:
            return
        whole = TokenBuffer(tokens + pack(output))
        self.cache.cache_blocks(request_id, whole)
        self.cache.free_request(request_id)
        self.running -= 1
        await self._flush(asyncio.get_running_loop().time())
        async with self._freed:
            self._freed.notify_all()

    async def abort(self, request_id: str) -> None:
        """The client went away: free without caching the unfinished output."""
        if request_id in self.cache.requests:
            self.cache.free_request(request_id)
            self.running -= 1
            async with self._freed:
                self._freed.notify_all()

    async def reset_prefix_cache(self) -> bool:
        """vLLM's /reset_prefix_cache: refused (False) while requests run."""
        if self.cache.requests:
            return False
        self.cache.reset()
        await self._flush(asyncio.get_running_loop().time())
        return True

    async def _flush(self, now: float) -> None:
        if not self._pending:
            return
        events = list(self._pending)
        self._pending.clear()
        if self._on_events is not None:
            await self._on_events(events, now)
