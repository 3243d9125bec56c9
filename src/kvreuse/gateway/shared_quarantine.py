"""Requests of death held by every gateway once one holds them (``--shared-quarantine``).

Each gateway keeps its own :class:`~kvreuse.gateway.quarantine.Quarantine`. Behind N gateways
(a TCP load balancer spreading a client's retries over them), a request that kills the engines
serving it went to two engines through each gateway before that gateway held it: 2 × N dead
engines, where one gateway stops at 2. Measured on three gateways in front of six killer
upstreams (tests/multigateway/test_shared_quarantine.py): without sharing, the request and
two retries through the next gateways killed all six; shared, the first gateway's verdict
reached the others before the retry and it killed two.

How: every verdict a gateway comes to hold (a request of death, or one that brought two
upstreams down) is appended to one Redis stream (``{prefix}:quarantine``, trimmed to
``stream_maxlen`` entries); every gateway reads that stream and holds each request it names
for its own ``--quarantine-time`` from when it read it (clocks of different hosts are not
compared beyond the entry's wall-clock expiry, which only decides whether a gateway that starts
late still adopts an entry it finds in the retained tail). Redis is never on a request's path:
verdicts are queued and written in the background, and a Redis outage only makes each
gateway's table its own again (counted, logged once per 10 s).

What an entry holds: the request's 128-bit key (a BLAKE2b of path, cache identity and body:
no text, no tokens), the status, the names of the upstreams that answered it and of those it
brought down, the gateways' message excerpt, and its expiry. What Redis holds is input, never
trusted: an entry that does not decode, or names what no gateway sends (a status outside
500-599, too many or too long names, a detail over the quarantine's bound), is skipped and
counted. Someone who can write to that Redis can make the gateways answer one exact request
(whose key they must already know) with a 5xx for ``--quarantine-time`` at a time, and do
no more through the entries' meaning, which is the trust the shared index asks of the same
Redis already. Their size is another matter: the Redis client reads an entry whole before it is
decoded, so a writer of entries of hundreds of megabytes costs every gateway that memory. Let
only the gateways reach that Redis (README, "Several gateways in front of the same engines").
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.gateway.quarantine import MAX_DETAIL_CHARS, NAMED_UPSTREAMS, Quarantine, Verdict
from kvreuse.gateway.shared_index import (
    SyncStats,
    publish,
    retrying,
    rewound,
    run_in_lifespan,
)
from kvreuse.gateway.telemetry import ThrottledLog

if TYPE_CHECKING:
    from kvreuse.gateway.app import Gateway

log = logging.getLogger("kvreuse.gateway.shared_quarantine")
_skipped = ThrottledLog(log, burst=1, interval_s=10.0)

KEY_BYTES = 16
MAX_NAME_CHARS = 256


@dataclass(frozen=True, slots=True)
class SharedVerdict:
    """One stream entry: a verdict of ``origin`` (a gateway's random id) on request ``key``,
    held there until ``expires_at`` (Unix seconds)."""

    origin: str
    key: int
    status: int
    upstreams: tuple[str, ...]
    brought_down: tuple[str, ...]
    detail: str
    expires_at: float


def encode_verdict(verdict: SharedVerdict) -> dict[str, bytes]:
    """A stream entry's fields. O(detail)."""
    return {"o": verdict.origin.encode(), "k": verdict.key.to_bytes(KEY_BYTES, "little"),
            "s": str(verdict.status).encode(), "u": "\n".join(verdict.upstreams).encode(),
            "b": "\n".join(verdict.brought_down).encode(), "d": verdict.detail.encode(),
            "e": repr(verdict.expires_at).encode()}


def decode_verdict(fields: MutableMapping[Any, Any]) -> SharedVerdict:
    """The inverse of :func:`encode_verdict`; :class:`InputFormatError` names what is wrong
    (see the module docstring for what is refused). O(entry)."""
    where = "shared quarantine entry"
    raw = {name: fields.get(name.encode()) for name in "oksubde"}
    missing = [name for name, value in raw.items() if not isinstance(value, bytes)]
    if missing:
        raise InputFormatError(f"needs byte fields {', '.join(missing)}", where)
    try:
        text = {name: value.decode() for name, value in raw.items()
                if name != "k" and isinstance(value, bytes)}
        status, expires_at = int(text["s"]), float(text["e"])
    except (UnicodeDecodeError, ValueError) as exc:
        raise InputFormatError(f"not text and numbers ({exc})", where) from None
    key = raw["k"]
    assert isinstance(key, bytes)
    if len(key) != KEY_BYTES:
        raise InputFormatError(f"a key of {len(key)} bytes, not {KEY_BYTES}", where)
    if not 500 <= status <= 599:
        raise InputFormatError(f"status {status} is no 5xx", where)
    if not expires_at < float("inf"):  # NaN too
        raise InputFormatError("the expiry is not a finite time", where)
    names = {part: tuple(name for name in text[part].split("\n") if name) for part in "ub"}
    for part, found in names.items():
        if len(found) > NAMED_UPSTREAMS or any(len(name) > MAX_NAME_CHARS for name in found):
            raise InputFormatError(f"more than {NAMED_UPSTREAMS} names, or a name over "
                                   f"{MAX_NAME_CHARS} characters, in field {part}", where)
    if len(text["d"]) > MAX_DETAIL_CHARS or len(text["o"]) > MAX_NAME_CHARS:
        raise InputFormatError("a detail or an origin over its bound", where)
    return SharedVerdict(text["o"], int.from_bytes(key, "little"), status, names["u"],
                         names["b"], text["d"], expires_at)


class RedisQuarantineSync:
    """Shares a :class:`Quarantine`'s verdicts through one Redis stream; see the module
    docstring. ``client`` is a ``redis.asyncio.Redis`` (built by the caller so tests can pass
    their own); ``clock`` the monotonic clock the quarantine is given, ``wall`` Unix time."""

    def __init__(self, quarantine: Quarantine, client: Any, *, prefix: str = "kvreuse",
                 stream_maxlen: int = 4096, max_pending: int = 1024, block_ms: int = 200,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        if stream_maxlen < 1 or max_pending < 1:
            raise ConfigError("stream_maxlen and max_pending must be >= 1")
        self.quarantine = quarantine
        self.client = client
        self.stream = f"{prefix}:quarantine"
        self.origin = uuid.uuid4().hex
        self.stream_maxlen = stream_maxlen
        self.block_ms = block_ms
        self.clock = clock
        self.wall = wall
        self.stats = SyncStats()
        self._pending: asyncio.Queue[SharedVerdict] = asyncio.Queue(max_pending)
        quarantine.on_condemned = self._enqueue

    def _enqueue(self, key: int, verdict: Verdict) -> None:
        remaining = max(verdict.until - self.clock(), 0.0)
        shared = SharedVerdict(self.origin, key, verdict.status, verdict.upstreams,
                               verdict.brought_down, verdict.detail, self.wall() + remaining)
        try:
            self._pending.put_nowait(shared)
        except asyncio.QueueFull:
            self.stats.dropped += 1  # backpressure: this verdict stays local

    async def run(self) -> None:
        """Adopt the live entries of the retained tail, then publish and read until
        cancelled; Redis errors are counted and retried, and never reach requests."""
        meanwhile = "holding this gateway's own verdicts meanwhile"
        await asyncio.gather(
            retrying(self._read_loop, self.stats, "shared quarantine", meanwhile),
            retrying(self._write_loop, self.stats, "shared quarantine", meanwhile))

    async def _read_loop(self) -> None:
        tail = await self.client.xrevrange(self.stream, count=self.stream_maxlen)
        last = tail[0][0] if tail else "0-0"
        for _, fields in reversed(tail):
            self._take(fields)
        self.stats.connected = True
        while True:
            replies = await self.client.xread({self.stream: last}, block=self.block_ms,
                                              count=512)
            for _, entries in replies or ():
                for entry_id, fields in entries:
                    last = entry_id
                    self._take(fields)
            last = await rewound(self.client, self.stream, last)

    def _take(self, fields: MutableMapping[Any, Any]) -> None:
        try:
            verdict = decode_verdict(fields)
        except InputFormatError as exc:
            self.stats.malformed += 1
            _skipped.warning("shared quarantine: skipped a malformed entry: %s", str(exc))
            return
        if verdict.origin == self.origin or verdict.expires_at <= self.wall():
            return
        if self.quarantine.adopt(verdict.key, verdict.status, verdict.upstreams,
                                 verdict.brought_down, verdict.detail, self.clock()):
            self.stats.received += 1
        else:
            self.stats.malformed += 1
            _skipped.warning("shared quarantine: skipped an entry no gateway writes (status "
                             "%d, %d upstreams, %d brought down)", verdict.status,
                             len(verdict.upstreams), len(verdict.brought_down))

    async def _write_loop(self) -> None:
        await publish(self.client, self._pending,
                      lambda verdict: (self.stream, encode_verdict(verdict)), self.stats,
                      "shared quarantine", maxlen=self.stream_maxlen, batch=128)


def attach_quarantine(gateway: Gateway, redis_url: str, *,
                      prefix: str = "kvreuse") -> RedisQuarantineSync:
    """Share ``gateway``'s quarantine through the Redis at ``redis_url``: the sync runs for
    the life of the app, and its counters are exported on /metrics."""
    import redis.asyncio as aioredis

    try:
        client = aioredis.from_url(redis_url)
    except ValueError as exc:
        raise ConfigError(f"--shared-quarantine {redis_url!r}: {exc}") from None
    sync = RedisQuarantineSync(gateway.quarantine, client, prefix=prefix)
    run_in_lifespan(gateway, sync.run, sync.client)
    gateway.state.quarantine_sync = sync.stats
    return sync
