"""Subscribe to an upstream's KV events over ZeroMQ, in order, with gap repair.

Endpoint convention (vLLM's): a ``tcp://HOST:PORT`` given to vLLM makes vLLM *connect* its PUB
socket, so the gateway's SUB must *bind* that address; ``tcp://*:PORT`` or ``ipc://`` makes
vLLM bind, and the gateway connects. ``bind`` chooses. The replay endpoint is always bound by
vLLM (a ROUTER); the gateway connects a DEALER and asks for every batch from a sequence number.

:class:`SequenceTracker` is the pure part: it says, for each arriving batch, whether to apply
it, skip it (a duplicate) or first repair a gap. :class:`EventSubscriber` does the I/O: on a gap
it asks the replay socket for the missing batches; when that is impossible (no replay endpoint,
timeout, batches no longer buffered) it reports the stream cold and the caller forgets that
upstream's index, which rebuilds from the next events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from kvreuse.errors import InputFormatError
from kvreuse.gateway.kv_events import END_OF_REPLAY, EventBatch, decode_message

log = logging.getLogger("kvreuse.gateway.events")


@dataclass(slots=True)
class StreamStats:
    """Counters for one upstream's event stream (exported as Prometheus metrics)."""

    batches: int = 0
    events: int = 0
    malformed_events: int = 0
    malformed_batches: int = 0
    duplicates: int = 0
    gaps: int = 0
    repaired_gaps: int = 0
    replayed_batches: int = 0
    lost_batches: int = 0
    cold_resets: int = 0
    orphan_blocks: int = 0
    unknown_removals: int = 0
    ignored_events: int = 0
    last_error: str = ""
    errors: list[str] = field(default_factory=list)

    def note(self, message: str) -> None:
        """Keep the last few problems for /ready and logs; never grows without bound."""
        self.last_error = message
        self.errors.append(message)
        del self.errors[:-20]


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do with a batch: ``apply`` it; or first repair ``missing_from`` up to its seq."""

    apply: bool
    missing_from: int | None = None
    restarted: bool = False


class SequenceTracker:
    """Sequence bookkeeping of one stream. vLLM numbers batches 0, 1, 2, ... per publisher."""

    def __init__(self) -> None:
        self.last_seq: int | None = None

    def check(self, seq: int) -> Verdict:
        """Called for each live batch before it is applied. O(1)."""
        last = self.last_seq
        if last is None or seq == last + 1:
            return Verdict(apply=True)
        if seq == 0:
            # A publisher numbering from 0 again is a restarted engine: its cache is empty.
            return Verdict(apply=True, restarted=True)
        if seq <= last:
            return Verdict(apply=False)
        return Verdict(apply=True, missing_from=last + 1)

    def advance(self, seq: int) -> None:
        """Called after a batch (live or replayed) was applied."""
        self.last_seq = seq


BatchSink = Callable[[EventBatch], None]
ColdSink = Callable[[str], None]


class EventSubscriber:
    """One SUB socket for one upstream; :meth:`run` until :meth:`close`.

    ``on_batch`` receives each batch in sequence order (replayed ones included); ``on_cold``
    is called with a reason when the index must be forgotten (unrepairable gap, restart).
    """

    def __init__(
        self,
        replica: str,
        endpoint: str,
        *,
        on_batch: BatchSink,
        on_cold: ColdSink,
        bind: bool = True,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_s: float = 1.0,
        stats: StreamStats | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.replica = replica
        self.endpoint = endpoint
        self.bind = bind
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.stats = stats if stats is not None else StreamStats()
        self.tracker = SequenceTracker()
        self._on_batch = on_batch
        self._on_cold = on_cold
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._closed = False

    def open(self) -> None:
        """Create and bind/connect the SUB socket (before the upstream starts publishing)."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        if self.bind:
            sub.bind(self.endpoint)
        else:
            sub.connect(self.endpoint)
        self._sub = sub

    async def run(self) -> None:
        """Receive until closed. Never raises on bad input: it is counted and reported."""
        if self._sub is None:
            self.open()
        sub = self._sub
        assert sub is not None
        while not self._closed:
            try:
                frames = await sub.recv_multipart()
            except (asyncio.CancelledError, zmq.ContextTerminated):
                break
            except zmq.ZMQError as exc:
                if self._closed:
                    break
                self.stats.note(f"receive failed: {exc}")
                await asyncio.sleep(0.1)
                continue
            await self.handle(frames)

    async def handle(self, frames: list[bytes]) -> None:
        """Decode, order and deliver one live message."""
        try:
            batch = decode_message(frames)
        except InputFormatError as exc:
            # The sequence number may still be readable; a lost batch is a gap like any other.
            self.stats.malformed_batches += 1
            self.stats.note(f"{self.replica}: malformed batch: {exc}")
            return
        verdict = self.tracker.check(batch.seq)
        if not verdict.apply:
            self.stats.duplicates += 1
            return
        if verdict.restarted:
            self._cold(f"{self.replica}: publisher restarted (sequence back to 0)")
        if verdict.missing_from is not None:
            self.stats.gaps += 1
            if await self._replay(verdict.missing_from, batch.seq):
                self.stats.repaired_gaps += 1
            else:
                self.stats.lost_batches += batch.seq - verdict.missing_from
                self._cold(
                    f"{self.replica}: batches {verdict.missing_from}..{batch.seq - 1} lost "
                    "and not replayable; index marked cold"
                )
        self._deliver(batch)

    def _deliver(self, batch: EventBatch) -> None:
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        if batch.malformed:
            self.stats.malformed_events += len(batch.malformed)
            for problem in batch.malformed:
                self.stats.note(f"{self.replica}: {problem}")
        self.tracker.advance(batch.seq)
        try:
            self._on_batch(batch)
        except Exception as exc:  # a consumer bug must not stop the stream; it is reported
            log.exception("%s: applying batch %d failed", self.replica, batch.seq)
            self.stats.note(f"{self.replica}: applying batch {batch.seq} failed: {exc!r}")

    def _cold(self, reason: str) -> None:
        self.stats.cold_resets += 1
        self.stats.note(reason)
        log.warning("%s", reason)
        self._on_cold(reason)

    async def _replay(self, start: int, stop: int) -> bool:
        """Ask the replay socket for batches ``start..stop-1`` and deliver them; False when the
        range cannot be recovered completely."""
        if self.replay_endpoint is None:
            return False
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        replayed: list[EventBatch] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                parts = await asyncio.wait_for(dealer.recv_multipart(), self.replay_timeout_s)
                frames = parts[1:] if parts and parts[0] == b"" else parts
                if len(frames) >= 2 and frames[1] == END_OF_REPLAY:
                    break
                batch = decode_message(frames)
                if start <= batch.seq < stop:
                    replayed.append(batch)
        except (TimeoutError, InputFormatError, zmq.ZMQError) as exc:
            self.stats.note(f"{self.replica}: replay from {start} failed: {exc!r}")
            return False
        finally:
            dealer.close(linger=0)
        replayed.sort(key=lambda b: b.seq)
        if [b.seq for b in replayed] != list(range(start, stop)):
            self.stats.note(f"{self.replica}: replay from {start} incomplete")
            return False
        for batch in replayed:
            self.stats.replayed_batches += 1
            self._deliver(batch)
        return True

    def close(self) -> None:
        self._closed = True
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.close(linger=0)
            self._sub = None
