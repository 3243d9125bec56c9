"""Subscribe to an upstream's KV events over ZeroMQ, in order, with gap repair.

Endpoint convention (vLLM's): a ``tcp://HOST:PORT`` given to vLLM makes vLLM *connect* its PUB
socket, so the gateway's SUB must *bind* that address; ``tcp://*:PORT`` or ``ipc://`` makes
vLLM bind, and the gateway connects. ``bind`` chooses. The replay endpoint is always bound by
vLLM (a ROUTER); the gateway connects a DEALER and asks for every batch from a sequence number.

:class:`SequenceTracker` is the pure part: it says, for each arriving batch, whether to apply
it, skip it (a duplicate, or a number too far from the stream's to be believed) or first repair
a gap. :class:`EventSubscriber` does the I/O: on a gap it asks the replay socket for the missing
batches; when that is impossible (no replay endpoint, timeout, batches no longer buffered) it
reports the stream cold and the caller forgets that upstream's index, which rebuilds from the
next events.

Hostile input (the events endpoint accepts any publisher that can reach it; see DEVELOPERS.md,
"The KV-event endpoint's trust model"): frames above ``max_frame_bytes`` are refused by the
socket itself (``ZMQ_MAXMSGSIZE``: libzmq drops the connection that sent one); every decode or
apply error is caught, counted in :attr:`StreamStats.dropped` by reason, logged (at most five
lines per ``LOG_EVERY_S`` per upstream), and the loop goes on. A sequence number more than
``window`` batches ahead is dropped and never adopted; one inside the window that the replay
socket cannot confirm (the publisher never published it) is dropped too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from kvreuse.errors import InputFormatError
from kvreuse.gateway.telemetry import ThrottledLog
from kvreuse.kv_event_codec import END_OF_REPLAY, EventBatch, MalformedBatch, decode_message

log = logging.getLogger("kvreuse.gateway.events")

DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024
"""Largest frame the SUB socket accepts (vLLM's batches are kilobytes)."""
DEFAULT_SEQ_WINDOW = 100_000
"""How far ahead of the last batch a sequence number may jump and still be a gap. vLLM
publishes at most one batch per engine step and buffers 10,000 for replay by default, so a
larger real gap could not be repaired anyway."""
RIVAL_RUN = 3
"""Consecutive batches of another numbering (out of the window, or behind) after which that
numbering is adopted, with a cold reset: the publisher restarted without us seeing its batch 0,
or the gateway lost more than a window of batches, or the first number it adopted was forged."""
RETIRED_PATIENCE = 256
"""After a renumbering, batches continuing the numbering left behind (a killed engine's backlog
still queued in the socket) are dropped; this many in a row with no batch of the new numbering
between them mean the old numbering is the one alive (the renumbering was forged, or the new
publisher stopped), and it is adopted back."""
LOG_EVERY_S = 10.0
POLL_MS = 250


@dataclass(slots=True)
class StreamStats:
    """Counters for one upstream's event stream (exported as Prometheus metrics)."""

    batches: int = 0
    events: int = 0
    malformed_events: int = 0
    malformed_batches: int = 0
    gaps: int = 0
    repaired_gaps: int = 0
    replayed_batches: int = 0
    lost_batches: int = 0
    cold_resets: int = 0
    resyncs: int = 0
    restarts: int = 0
    orphan_blocks: int = 0
    unknown_removals: int = 0
    ignored_events: int = 0
    trimmed_blocks: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # batches not applied, by reason
    state: str = "idle"  # idle, running, resyncing, stopped, failed
    last_batch_at: float | None = None  # time.monotonic() of the last applied batch
    heartbeat_at: float | None = None  # the receive loop's last turn (the watchdog reads it)
    last_error: str = ""
    errors: list[str] = field(default_factory=list)

    def note(self, message: str) -> None:
        """Keep the last few problems for /ready and logs; never grows without bound."""
        self.last_error = message[:500]
        self.errors.append(self.last_error)
        del self.errors[:-20]

    def drop(self, reason: str) -> None:
        """One batch not applied, for ``reason`` (the metric's label)."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do with a batch: ``apply`` it; or first repair ``missing_from`` up to its seq;
    ``restarted``: forget the index first (a new numbering). ``drop`` says why a batch that is
    not applied is not."""

    apply: bool
    missing_from: int | None = None
    restarted: bool = False
    drop: str = ""


class SequenceTracker:
    """Sequence bookkeeping of one stream. vLLM numbers batches 0, 1, 2, ... per publisher.

    ``window``: a batch more than this many ahead of the last is not a gap but a forgery or a
    corruption, dropped. A run of ``RIVAL_RUN`` consecutive numbers the stream would otherwise
    drop is adopted (see :data:`RIVAL_RUN`), so a real renumbering heals and a lone forged
    number costs nothing."""

    def __init__(self, window: int = DEFAULT_SEQ_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.last_seq: int | None = None
        self._rival_next: int | None = None
        self._rival_run = 0
        self._retired_next: int | None = None  # the next number of the numbering left behind
        self._retired_run = 0

    def check(self, seq: int) -> Verdict:
        """Called for each live batch before it is applied. O(1)."""
        last = self.last_seq
        if seq < 0:
            return Verdict(apply=False, drop="negative_seq")
        if last is None or seq == last + 1:
            self._retired_run = 0
            return Verdict(apply=True)
        if seq == self._retired_next:
            self._retired_next, self._retired_run = seq + 1, self._retired_run + 1
            if self._retired_run < RETIRED_PATIENCE:
                return Verdict(apply=False, drop="retired_publisher")
            return self._renumbered(last)
        if seq == 0:
            # A publisher numbering from 0 again is a restarted engine: its cache is empty.
            return self._renumbered(last)
        if last < seq <= last + self.window:
            return Verdict(apply=True, missing_from=last + 1)
        run = self._rival_run + 1 if seq == self._rival_next else 1
        self._rival_next, self._rival_run = seq + 1, run
        if run >= RIVAL_RUN:
            self._rival_next, self._rival_run = None, 0
            return self._renumbered(last)
        return Verdict(apply=False, drop="seq_far_ahead" if seq > last else "duplicate_batch")

    def _renumbered(self, last: int | None) -> Verdict:
        """Adopt the batch's numbering (the caller forgets the index); the numbering left
        behind is retired, so what is still queued of it cannot take the stream back."""
        self._retired_next = None if last is None else last + 1
        self._retired_run = 0
        return Verdict(apply=True, restarted=True)

    def advance(self, seq: int) -> None:
        """Called after a batch (live or replayed) was applied."""
        self.last_seq = seq


BatchSink = Callable[[EventBatch], None]
ColdSink = Callable[[str], None]


class EventSubscriber:
    """One SUB socket for one upstream; :meth:`run` until :meth:`close`.

    ``on_batch`` receives each batch in sequence order (replayed ones included); ``on_cold``
    is called with a reason when the index must be forgotten (unrepairable gap, restart,
    a rebuild asked for with :meth:`request_resync`).
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
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        seq_window: int = DEFAULT_SEQ_WINDOW,
        stats: StreamStats | None = None,
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_frame_bytes < 1:
            raise ValueError(f"max_frame_bytes must be >= 1, got {max_frame_bytes}")
        self.replica = replica
        self.endpoint = endpoint
        self.bind = bind
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.stats = stats if stats is not None else StreamStats()
        self.tracker = SequenceTracker(seq_window)
        self.clock = clock
        self._on_batch = on_batch
        self._on_cold = on_cold
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._closed = False
        self._resync_wanted = False
        self._log = ThrottledLog(log, burst=5, interval_s=LOG_EVERY_S)

    def open(self) -> None:
        """Create and bind/connect the SUB socket (before the upstream starts publishing); a
        ``zmq.ZMQError`` (endpoint in use, not this machine's) leaves nothing open."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        # libzmq refuses a larger frame before buffering it and drops that peer's connection.
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        try:
            if self.bind:
                sub.bind(self.endpoint)
            else:
                sub.connect(self.endpoint)
        except zmq.ZMQError:
            sub.close(linger=0)
            raise
        self._sub = sub

    @property
    def closed(self) -> bool:
        return self._closed

    def request_resync(self) -> None:
        """Ask the receive loop to forget the index and rebuild it from the replay socket (all
        the batches it still buffers); without one the index is only forgotten. Called when the
        index is suspect (its predictions exceed what the engine reports)."""
        self._resync_wanted = True

    async def run(self) -> None:
        """Receive until closed. Never raises on bad input: it is counted and reported. A
        watchdog (the gateway's) runs it again should it stop anyway."""
        if self._sub is None:
            self.open()
        sub = self._sub
        assert sub is not None
        self.stats.state = "running"
        try:
            while not self._closed:
                self.stats.heartbeat_at = self.clock()
                # Also after a watchdog restart, whose cancelled predecessor may end after this
                # loop began and leave "failed" behind.
                self.stats.state = "running"
                try:
                    if self._resync_wanted:
                        await self._resync()
                    try:  # a backlog is read without a poll per message
                        frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        # Wait with a timeout, so the loop turns (heartbeat, resync requests).
                        if not await sub.poll(POLL_MS):
                            continue
                        frames = await sub.recv_multipart()
                except (asyncio.CancelledError, zmq.ContextTerminated):
                    break
                except zmq.ZMQError as exc:
                    if self._closed:
                        break
                    self._problem("receive_error", f"receive failed: {exc}")
                    await asyncio.sleep(0.1)
                    continue
                try:
                    await self.handle(frames)
                except asyncio.CancelledError:
                    break
                except Exception as exc:  # whatever a frame provokes, the loop goes on
                    self.stats.drop("internal_error")
                    self._problem("internal_error", f"handling a batch failed: {exc!r}")
        finally:
            self.stats.state = "stopped" if self._closed else "failed"

    async def handle(self, frames: list[bytes]) -> None:
        """Decode, order and deliver one live message."""
        try:
            batch = decode_message(frames)
        except InputFormatError as exc:
            reason = exc.reason if isinstance(exc, MalformedBatch) else "malformed_batch"
            # The sequence number may still be readable; a lost batch is a gap like any other.
            self.stats.malformed_batches += 1
            self.stats.drop(reason)
            self._problem(reason, f"malformed batch: {exc}")
            return
        verdict = self.tracker.check(batch.seq)
        if not verdict.apply:
            self.stats.drop(verdict.drop)
            if verdict.drop != "duplicate_batch":
                self._problem(verdict.drop, f"batch {batch.seq} dropped ({verdict.drop}); the "
                              f"stream is at {self.tracker.last_seq}")
            return
        if verdict.restarted:
            self._cold(f"{self.replica}: publisher renumbered (sequence {batch.seq} after "
                       f"{self.tracker.last_seq}): restarted; index forgotten")
        if verdict.missing_from is not None:
            start = verdict.missing_from
            repaired = await self._replay(start, batch.seq)
            if repaired is None:
                # The publisher's own buffer has nothing from `start` on, not even this batch:
                # it never published that number. A forgery, not a gap.
                self.stats.drop("seq_unconfirmed")
                self._problem("seq_unconfirmed", f"batch {batch.seq} dropped: the replay "
                              f"socket has no batch from {start} on")
                return
            self.stats.gaps += 1
            if repaired:
                self.stats.repaired_gaps += 1
            else:
                self.stats.lost_batches += batch.seq - start
                self._cold(
                    f"{self.replica}: batches {start}..{batch.seq - 1} lost "
                    "and not replayable; index marked cold"
                )
        self._deliver(batch)

    def _deliver(self, batch: EventBatch, *, advance: bool = True) -> None:
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.last_batch_at = self.clock()
        if batch.malformed:
            self.stats.malformed_events += len(batch.malformed)
            self._problem("malformed_event", f"{len(batch.malformed)} malformed event(s) in "
                          f"batch {batch.seq}, first: {batch.malformed[0]}")
        if advance:
            self.tracker.advance(batch.seq)
        try:
            self._on_batch(batch)
        except Exception as exc:  # a consumer bug must not stop the stream; it is reported
            self.stats.drop("apply_error")
            log.exception("%s: applying batch %d failed", self.replica, batch.seq)
            self.stats.note(f"{self.replica}: applying batch {batch.seq} failed: {exc!r}")

    def _problem(self, reason: str, message: str) -> None:
        self.stats.note(f"{self.replica}: {message}")
        self._log.warning("KV events of %s: %s (%s)", self.replica, message, reason)

    def _cold(self, reason: str) -> None:
        self.stats.cold_resets += 1
        self.stats.note(reason)
        log.warning("%s", reason)
        self._on_cold(reason)

    async def _fetch(self, start: int) -> list[EventBatch] | None:
        """Every batch the replay socket buffers from ``start`` on, in order; None when it
        cannot be asked or does not answer in time."""
        if self.replay_endpoint is None:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        dealer.connect(self.replay_endpoint)
        replayed: dict[int, EventBatch] = {}
        # The replay socket is the engine's, but an answer that never ends must not hold the
        # stream: the whole replay gets a deadline and a batch count bound.
        deadline = self.clock() + 10 * self.replay_timeout_s
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while len(replayed) <= self.tracker.window:
                left = min(self.replay_timeout_s, deadline - self.clock())
                if left <= 0:
                    raise TimeoutError("replay did not end in time")
                async with asyncio.timeout(left):  # not wait_for: see gateway/tasks.py
                    parts = await dealer.recv_multipart()
                frames = parts[1:] if parts and parts[0] == b"" else parts
                if len(frames) >= 2 and frames[1] == END_OF_REPLAY:
                    break
                batch = decode_message(frames)
                if batch.seq >= start:
                    replayed[batch.seq] = batch
        except (TimeoutError, InputFormatError, zmq.ZMQError) as exc:
            self.stats.note(f"{self.replica}: replay from {start} failed: {exc!r}")
            return None
        finally:
            dealer.close(linger=0)
        return [replayed[seq] for seq in sorted(replayed)]

    async def _replay(self, start: int, stop: int) -> bool | None:
        """Ask the replay socket for batches ``start..stop-1`` and deliver them. True when
        repaired; False when the range cannot be recovered completely; None when the replay
        socket answered with no batch at all from ``start`` on (``stop`` was never
        published)."""
        fetched = await self._fetch(start)
        if fetched is None:
            return False
        if not fetched:
            return None
        replayed = [b for b in fetched if b.seq < stop]
        if [b.seq for b in replayed] != list(range(start, stop)):
            self.stats.note(f"{self.replica}: replay from {start} incomplete")
            return False
        for batch in replayed:
            self.stats.replayed_batches += 1
            self._deliver(batch)
        return True

    async def _resync(self) -> None:
        """Forget the index and refold every batch the replay socket still holds, up to the
        stream's position; the live batches wait in the socket meanwhile."""
        self._resync_wanted = False
        self.stats.resyncs += 1
        self.stats.state = "resyncing"
        try:
            last = self.tracker.last_seq
            fetched = await self._fetch(0) if last is not None else None
            self._cold(f"{self.replica}: index suspect; forgotten and rebuilt from "
                       f"{len(fetched) if fetched else 0} replayed batch(es)")
            for batch in fetched or ():
                assert last is not None
                if batch.seq <= last:
                    self.stats.replayed_batches += 1
                    self._deliver(batch, advance=False)
        finally:
            self.stats.state = "running"

    def close(self) -> None:
        self._closed = True
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.close(linger=0)
            self._sub = None
