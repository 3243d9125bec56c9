"""One approximate prefix index per upstream, shared by several gateways through Redis.

Several ``kvreuse route`` processes in front of the same engines must agree on where each prefix
lives, or a conversation's turns scatter across replicas as soon as they reach different gateways.
In exact mode every gateway subscribes to every engine's KV events and agreement is free. In
approximate mode (``cache_aware``: the router remembers what it *sent* where) each gateway only
sees its own share of the traffic; this module gives all of them the union.

Two halves:

* :class:`SharedPrefixIndex` — pure (no I/O, time passed in): per upstream, the chained 64-bit
  hashes of the full blocks of every prompt routed there, LRU-bounded to ``capacity_blocks``
  (set it near the engine's KV capacity so the guess forgets about as fast as the engine does).
  It is a :class:`~kvreuse.routing.CacheEstimator` learning from routing, so any policy with
  an approximate estimator can route on it instead.
  Only hashes are kept and shared, never token ids: a Redis reader learns which prefixes were
  routed where, not what they say (hashes are keyed by the cache identity, salt included, so a
  salted tenant's prompts cannot be confirmed by hashing a guess).
* :class:`RedisIndexSync` — the I/O: every :meth:`SharedPrefixIndex.record` made here is queued
  and appended (pipelined, in the background) to one Redis stream per upstream
  (``{prefix}:routed:{upstream}``, trimmed to ``stream_maxlen`` entries, so Redis memory is
  bounded by ``stream_maxlen × (8 bytes per block + ~100)`` per upstream); a reader task
  ``XREAD``\\ s every stream and folds the other gateways' records in. A gateway that starts late
  reads the retained tail first. Redis is never on a request's path: routing stays local and a
  Redis outage only makes the index as local as a lone gateway's (counted in :attr:`stats`).

Redis is shared, so what the gateway reads there is input, never trusted: an entry that does
not decode is skipped and counted; a chain longer than :data:`MAX_SHARED_CHAIN_BLOCKS` is
read only that far (no engine's context holds more, so nothing routable is lost), because
decoding and merging a forged chain of millions of blocks stalled the event loop, and with it
every request, for seconds, again at each re-read after a Redis error; the reader yields to
the event loop every :data:`YIELD_BLOCKS` blocks merged. Redis errors and skipped entries are
logged at most once per 10 s each (with the count held back): a Redis outage or a stream full
of garbage logged a line per retry (two a second) or per entry.

One forged entry can stop a stream for good: Redis refuses every ``XADD`` to a stream that has
held an entry at the largest id (:data:`MAX_STREAM_ID`), "exhausted the last possible ID", even
once that entry is deleted, so every gateway's records to that upstream were dropped (counted,
logged) until someone deleted the stream by hand. A writer that meets that refusal deletes the
stream (no gateway writes such an id: ours are Redis's own) and counts it
(``streams_reset``); a reader whose cursor stands at that id goes back to the start of the
stream once the stream no longer ends there, else it would wait for ids past the largest.

Wiring: ``kvreuse route --shared-index redis://HOST:PORT/DB`` calls :func:`attach`, which gives
the policy the index as its estimator and runs :meth:`RedisIndexSync.run` in the app's
lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Iterable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType, TypeVar, cast

from kvreuse.errors import ConfigError, InputFormatError, require_at_least
from kvreuse.gateway.asgi import Receive, Scope, Send
from kvreuse.gateway.tasks import cancel_and_wait
from kvreuse.gateway.telemetry import ThrottledLog
from kvreuse.routing import KvEvent, ReplicaId, RequestView, block_chain

if TYPE_CHECKING:
    from kvreuse.gateway.app import Gateway

log = logging.getLogger("kvreuse.gateway.shared_index")

# A record's chain is read up to this many blocks: 1M tokens at the default 16 per block,
# more than any engine's context (see the module docstring). Merging that many takes ~20 ms.
MAX_SHARED_CHAIN_BLOCKS = 1 << 16
YIELD_BLOCKS = 8192  # the reader lets requests run after merging about this many blocks

MAX_STREAM_ID = "18446744073709551615-18446744073709551615"
"""Redis's largest stream entry id; see the module docstring."""
_EXHAUSTED = "exhausted the last possible ID"  # Redis's refusal of an XADD past MAX_STREAM_ID

Item = TypeVar("Item")
_redis_errors = ThrottledLog(log, burst=1, interval_s=10.0)
_resets = ThrottledLog(log, burst=1, interval_s=10.0)
_skipped = ThrottledLog(log, burst=1, interval_s=10.0)

ChainHash = NewType("ChainHash", int)
"""A chained block hash: names the prefix that ends with this block, identity included."""


@dataclass(frozen=True, slots=True)
class RoutedRecord:
    """A prompt's block chain routed to ``upstream`` by gateway ``origin``."""

    upstream: ReplicaId
    chain: tuple[ChainHash, ...]
    origin: str


class SharedPrefixIndex:
    """Per-upstream LRU sets of block-prefix hashes; see the module docstring.

    ``on_record`` (set by :class:`RedisIndexSync`) hears every local record, to share it.
    """

    uses_kv_events = False

    def __init__(self, *, block_size: int = 16, capacity_blocks: int = 1 << 20,
                 origin: str | None = None) -> None:
        require_at_least("shared index block_size", block_size, 1)
        require_at_least("shared index capacity_blocks", capacity_blocks, 1)
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.origin = origin or uuid.uuid4().hex[:12]
        self._blocks: dict[ReplicaId, OrderedDict[ChainHash, None]] = {}
        self.on_record: Callable[[RoutedRecord], None] | None = None
        self.evicted_blocks = 0

    # ------------------------------------------------------------------ estimator interface

    def predict(
        self, request: RequestView, replicas: Iterable[ReplicaId], now: float
    ) -> dict[ReplicaId, int]:
        """Each replica's longest recorded prefix of the prompt, in whole blocks. Stops at the
        first missing block (an engine's hit rule). O(n) to hash plus O(matched) lookups."""
        chain = self._chain(request)
        out: dict[ReplicaId, int] = {}
        for rid in replicas:
            held = self._blocks.get(rid)
            matched = 0
            if held:
                for block in chain:
                    if block not in held:
                        break
                    matched += 1
            out[rid] = matched * self.block_size
        return out

    def record(self, request: RequestView, replica: ReplicaId, now: float) -> None:
        """The local router sent ``request`` to ``replica``: remember it and share it. O(n)."""
        chain = tuple(self._chain(request))
        if not chain:
            return
        self.merge(RoutedRecord(replica, chain, self.origin))
        if self.on_record is not None:
            self.on_record(RoutedRecord(replica, chain, self.origin))

    def apply(self, event: KvEvent) -> None:
        """Only what the gateways routed feeds this index, never KV events."""
        return None

    def tree_tokens(self, replica: ReplicaId) -> int:
        """Tokens recorded for ``replica``, in whole blocks. O(1)."""
        return self.cached_blocks(replica) * self.block_size

    def cached_blocks(self, replica: ReplicaId) -> int:
        """Blocks recorded for ``replica``. O(1)."""
        return len(self._blocks.get(replica, ()))

    def capacity_of(self, replica: ReplicaId) -> int | None:
        """``capacity_blocks`` in tokens: the LRU bound of every upstream's record. O(1)."""
        return self.capacity_blocks * self.block_size

    def _chain(self, request: RequestView) -> list[ChainHash]:
        return cast("list[ChainHash]",
                    block_chain(request.tokens, request.identity, self.block_size))

    # ------------------------------------------------------------------ shared records

    def merge(self, record: RoutedRecord) -> None:
        """Fold a record (local or another gateway's) in. Blocks are touched tail first so a
        prefix is always fresher than its extensions and LRU trims tails, not roots.
        O(len(chain)) plus evictions."""
        held = self._blocks.setdefault(record.upstream, OrderedDict())
        for block in reversed(record.chain):
            held[block] = None
            held.move_to_end(block)
        overflow = len(held) - self.capacity_blocks
        for _ in range(max(overflow, 0)):
            held.popitem(last=False)
        self.evicted_blocks += max(overflow, 0)

    def check_invariants(self) -> None:
        for upstream, held in self._blocks.items():
            assert len(held) <= self.capacity_blocks, f"{upstream}: over capacity"


def encode_record(record: RoutedRecord) -> dict[str, bytes]:
    """A stream entry: origin and the chain as little-endian uint64s. O(len(chain))."""
    packed = b"".join(block.to_bytes(8, "little") for block in record.chain)
    return {"o": record.origin.encode(), "c": packed}


def decode_record(upstream: ReplicaId, fields: MutableMapping[Any, Any],
                  max_blocks: int | None = None) -> RoutedRecord:
    """The inverse of :func:`encode_record`, reading at most ``max_blocks`` blocks of the
    chain when given (its root end); :class:`InputFormatError` names what is wrong."""
    origin, packed = fields.get(b"o"), fields.get(b"c")
    if not isinstance(origin, bytes) or not isinstance(packed, bytes):
        raise InputFormatError("stream entry needs byte fields 'o' and 'c'", f"upstream {upstream}")
    if len(packed) % 8:
        raise InputFormatError(f"chain of {len(packed)} bytes is not whole uint64s",
                               f"upstream {upstream}")
    end = len(packed) if max_blocks is None else min(len(packed), max_blocks * 8)
    chain = tuple(ChainHash(int.from_bytes(packed[i : i + 8], "little"))
                  for i in range(0, end, 8))
    return RoutedRecord(upstream, chain, origin.decode(errors="replace"))


@dataclass(slots=True)
class SyncStats:
    """What the Redis side did; the gateway can export these."""

    published: int = 0
    dropped: int = 0  # local records not shared: the queue was full or Redis was down
    received: int = 0  # other gateways' records applied
    malformed: int = 0
    redis_errors: int = 0
    streams_reset: int = 0  # streams deleted because an entry at MAX_STREAM_ID stopped them
    connected: bool = False


class RedisIndexSync:
    """Shares a :class:`SharedPrefixIndex` through Redis streams; see the module docstring.

    ``client`` is a ``redis.asyncio.Redis`` (or anything with its ``xread``/``xrevrange``/
    ``delete``/``pipeline`` methods), built by the caller so tests can pass their own.
    """

    def __init__(
        self,
        index: SharedPrefixIndex,
        client: Any,
        upstreams: Iterable[ReplicaId],
        *,
        prefix: str = "kvreuse",
        stream_maxlen: int = 50_000,
        bootstrap_entries: int = 50_000,
        max_pending: int = 10_000,
        block_ms: int = 200,
    ) -> None:
        if stream_maxlen < 1 or max_pending < 1:
            raise ConfigError("stream_maxlen and max_pending must be >= 1")
        self.index = index
        self.client = client
        self.streams = {f"{prefix}:routed:{u}": u for u in upstreams}
        self._stream_of = {u: key for key, u in self.streams.items()}
        self.stream_maxlen = stream_maxlen
        self.bootstrap_entries = bootstrap_entries
        self.block_ms = block_ms
        self.stats = SyncStats()
        self._pending: asyncio.Queue[RoutedRecord] = asyncio.Queue(max_pending)
        self._max_blocks = min(index.capacity_blocks, MAX_SHARED_CHAIN_BLOCKS)
        self._merged = 0  # blocks merged since the reader last yielded to the event loop
        index.on_record = self._enqueue

    def _enqueue(self, record: RoutedRecord) -> None:
        try:
            self._pending.put_nowait(record)
        except asyncio.QueueFull:
            self.stats.dropped += 1  # backpressure: this record stays local

    async def run(self) -> None:
        """Bootstrap from the retained tail, then publish and read until cancelled. Redis
        errors are counted and retried after a pause; they never reach requests."""
        await asyncio.gather(self._retrying(self._read_loop), self._retrying(self._write_loop))

    async def _retrying(self, loop: Callable[[], Awaitable[None]]) -> None:
        await retrying(loop, self.stats, "shared index",
                       "routing on this gateway's own records meanwhile")

    async def _read_loop(self) -> None:
        last = await self._bootstrap()
        self.stats.connected = True
        while True:
            replies = await self.client.xread(last, block=self.block_ms, count=1000)
            for stream, entries in replies or ():
                key = stream.decode() if isinstance(stream, bytes) else str(stream)
                for entry_id, fields in entries:
                    last[key] = entry_id
                    self._take(self.streams[key], fields)
                    await self._yield_if_due()
            for key, cursor in last.items():
                last[key] = await rewound(self.client, key, cursor)

    async def _bootstrap(self) -> dict[str, Any]:
        """Apply the retained tail of each stream (oldest first); returns the read cursor."""
        cursor: dict[str, Any] = {}
        for key, upstream in self.streams.items():
            entries = await self.client.xrevrange(key, count=self.bootstrap_entries)
            cursor[key] = entries[0][0] if entries else "0-0"
            for _, fields in reversed(entries):
                self._take(upstream, fields, include_own=True)
                await self._yield_if_due()
        return cursor

    async def _yield_if_due(self) -> None:
        """Let requests run once about :data:`YIELD_BLOCKS` blocks were merged since the
        last time: a batch of long chains is otherwise merged in one go on the event loop."""
        if self._merged >= YIELD_BLOCKS:
            self._merged = 0
            await asyncio.sleep(0)

    def _take(self, upstream: ReplicaId, fields: MutableMapping[Any, Any],
              include_own: bool = False) -> None:
        try:
            record = decode_record(upstream, fields, self._max_blocks)
        except InputFormatError as exc:
            self.stats.malformed += 1
            _skipped.warning("shared index: skipped a malformed entry: %s", str(exc))
            return
        if record.origin == self.index.origin and not include_own:
            return
        self._merged += len(record.chain)
        self.index.merge(record)
        self.stats.received += 1

    async def _write_loop(self) -> None:
        def entry(record: RoutedRecord) -> tuple[str, dict[str, bytes]]:
            key = self._stream_of.get(record.upstream, f"kvreuse:routed:{record.upstream}")
            return key, encode_record(record)

        await publish(self.client, self._pending, entry, self.stats, "shared index",
                      maxlen=self.stream_maxlen, batch=512)


async def publish(client: Any, pending: asyncio.Queue[Item],
                  entry: Callable[[Item], tuple[str, dict[str, bytes]]], stats: SyncStats,
                  what: str, *, maxlen: int, batch: int) -> None:
    """Append what is queued in ``pending`` to Redis streams until cancelled or Redis fails
    (raised, to be retried): up to ``batch`` items per pipeline, each ``entry(item)`` (stream
    key and fields) trimmed to about ``maxlen``; ``stats`` counts what was published and
    what was dropped, and a stream stopped by a forged entry is reset."""
    while True:
        items = [await pending.get()]
        while not pending.empty() and len(items) < batch:
            items.append(pending.get_nowait())
        entries = [entry(item) for item in items]
        pipe = client.pipeline(transaction=False)
        for key, fields in entries:
            pipe.xadd(key, fields, maxlen=maxlen, approximate=True)
        try:
            results = await pipe.execute(raise_on_error=False)
        except Exception:
            stats.dropped += len(items)
            raise
        refused = [(key, result) for (key, _), result in zip(entries, results, strict=True)
                   if isinstance(result, Exception)]
        stats.dropped += len(refused)
        stats.published += len(items) - len(refused)
        stats.connected = True
        await _reset_exhausted(client, refused, stats, what)


async def retrying(loop: Callable[[], Awaitable[None]], stats: SyncStats, what: str,
                   meanwhile: str) -> None:
    """Run ``loop`` until cancelled; a Redis error is counted in ``stats``, logged (at most
    once per 10 s, saying what the gateway does ``meanwhile``) and retried after 0.5 s."""
    while True:
        try:
            await loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a Redis client raises many types; all mean "retry"
            stats.redis_errors += 1
            stats.connected = False
            _redis_errors.warning("%s: redis error %s: %s (%s)", what, type(exc).__name__,
                                  str(exc), meanwhile)
            await asyncio.sleep(0.5)


async def _reset_exhausted(client: Any, refused: list[tuple[str, Any]], stats: SyncStats,
                          what: str) -> None:
    """After a pipeline of XADDs: delete each stream Redis refused as exhausted (see
    the module docstring) and count it; raise the first other refusal, to be retried."""
    for key in sorted({key for key, error in refused if _EXHAUSTED in str(error)}):
        await client.delete(key)
        stats.streams_reset += 1
        _resets.warning("%s: stream %s held an entry at Redis's largest id (forged: no "
                        "gateway writes one), so Redis refused every new record; deleted the "
                        "stream so sharing resumes", what, key)
    others = [error for _, error in refused if _EXHAUSTED not in str(error)]
    if others:
        raise others[0]


async def rewound(client: Any, key: str, cursor: Any) -> Any:
    """A reader's cursor on stream ``key``: back to the start when it stands at
    :data:`MAX_STREAM_ID` and the stream no longer ends there (a writer deleted the stream a
    forged entry stopped, and it has begun again), else as it was."""
    if _id_text(cursor) == MAX_STREAM_ID:
        top = await client.xrevrange(key, count=1)
        if not top or _id_text(top[0][0]) != MAX_STREAM_ID:
            return "0-0"
    return cursor


def run_in_lifespan(gateway: Gateway, run: Callable[[], Coroutine[Any, Any, None]],
                    client: Any) -> None:
    """Run ``run()`` as a task for the life of ``gateway``'s app, then close ``client``."""
    inner = gateway.app

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await inner(scope, receive, send)
            return
        task = asyncio.get_running_loop().create_task(run())
        try:
            await inner(scope, receive, send)
        finally:
            await cancel_and_wait([task], f"the Redis sync {run.__qualname__}")
            with contextlib.suppress(Exception):
                await client.aclose()

    gateway.app = app


def _id_text(entry_id: Any) -> str:
    """A stream entry id as text, whether the client decodes replies or not."""
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


def attach(gateway: Gateway, redis_url: str, *, capacity_blocks: int = 1 << 20,
           block_size: int = 16, prefix: str = "kvreuse",
           stream_maxlen: int = 50_000) -> RedisIndexSync:
    """Make an existing :class:`~kvreuse.gateway.app.Gateway` share its policy's index: the
    policy's estimator is replaced by a :class:`SharedPrefixIndex` and the sync task runs
    inside the app's lifespan. A policy without an estimator, or whose estimator learns from KV
    events (every gateway already reads the same events), is refused."""
    import redis.asyncio as aioredis

    policy = gateway.router.estimating
    if policy is None or policy.estimator.uses_kv_events:
        raise ConfigError(
            f"--shared-index shares a policy's approximate cache estimator; "
            f"{gateway.policy.name!r} has none (cache-blind, or on KV events, which every "
            f"gateway reads already)"
        )
    index = SharedPrefixIndex(block_size=block_size, capacity_blocks=capacity_blocks)
    policy.estimator = index
    names = [u.name for u in gateway.upstreams]
    sync = RedisIndexSync(index, aioredis.from_url(redis_url), names, prefix=prefix,
                          stream_maxlen=stream_maxlen)
    run_in_lifespan(gateway, sync.run, sync.client)
    gateway.state.shared_sync = sync.stats  # exported on /metrics
    return sync
