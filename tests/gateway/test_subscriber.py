"""KV-event subscription: ordering, duplicates, gap repair by replay, cold marking."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvreuse.engine.publisher import EventPublisher
from kvreuse.gateway.subscriber import EventSubscriber, SequenceTracker
from kvreuse.index.events import AllBlocksCleared, BlockRemoved
from kvreuse.index.hashing import BlockHash
from kvreuse.kv_event_codec import EventBatch, encode_payload
from kvreuse.testing.servers import free_port


def removed(n: int) -> BlockRemoved:
    return BlockRemoved((BlockHash(n.to_bytes(8, "big")),))


def test_tracker_applies_in_order_and_skips_duplicates() -> None:
    """Consecutive batches apply; an old sequence number is a duplicate."""
    tracker = SequenceTracker()
    assert tracker.check(7).apply  # the first batch seen sets the baseline
    tracker.advance(7)
    assert tracker.check(8).apply and tracker.check(8).missing_from is None
    tracker.advance(8)
    assert not tracker.check(5).apply


def test_tracker_reports_gaps_and_restarts() -> None:
    """A jump asks for the missing range; a return to 0 is a restarted publisher."""
    tracker = SequenceTracker()
    tracker.advance(3)
    assert tracker.check(6).missing_from == 4
    assert tracker.check(0).restarted


class Harness:
    """A publisher and a subscriber over real TCP sockets on one event loop."""

    def __init__(self, *, replay: bool) -> None:
        events_port = free_port()
        replay_port = free_port() if replay else None
        replay_endpoint = f"tcp://127.0.0.1:{replay_port}" if replay_port else None
        self.batches: list[EventBatch] = []
        self.cold: list[str] = []
        self.subscriber = EventSubscriber(
            "r0", f"tcp://127.0.0.1:{events_port}", bind=True, replay_endpoint=replay_endpoint,
            on_batch=self.batches.append, on_cold=self.cold.append, topic="kv",
        )
        self.publisher = EventPublisher(f"tcp://127.0.0.1:{events_port}",
                                        replay_endpoint=replay_endpoint, topic="kv")

    async def __aenter__(self) -> Harness:
        self.subscriber.open()
        self.publisher.start()
        self.task = asyncio.get_running_loop().create_task(self.subscriber.run())
        await self.wait_connected()
        return self

    async def wait_connected(self) -> None:
        # PUB/SUB drops messages until the connection is up: send probes until one arrives.
        for _ in range(200):
            await self.publisher.publish([AllBlocksCleared()], ts=0.0)
            await asyncio.sleep(0.02)
            if self.batches:
                break
        assert self.batches, "subscriber never connected"
        await asyncio.sleep(0.1)
        self.batches.clear()

    def lose(self, events: list[BlockRemoved]) -> None:
        """A batch the publisher buffered for replay but whose live send was lost."""
        payload = encode_payload(events, ts=0.0)
        self.publisher._buffer.append((self.publisher.seq, payload))
        self.publisher.seq += 1

    async def until(self, count: int) -> None:
        for _ in range(200):
            if len(self.batches) >= count:
                return
            await asyncio.sleep(0.01)

    async def __aexit__(self, *exc: object) -> None:
        self.subscriber.close()
        self.task.cancel()
        self.publisher.close()


def test_gap_is_repaired_from_the_replay_socket() -> None:
    """A lost batch is fetched from the replay socket and delivered in order."""

    async def scenario() -> tuple[list[int], list[str], int]:
        async with Harness(replay=True) as h:
            await h.publisher.publish([removed(1)], ts=1.0)
            h.lose([removed(2)])
            await h.publisher.publish([removed(3)], ts=3.0)
            await h.until(3)
            return [b.seq for b in h.batches], h.cold, h.subscriber.stats.replayed_batches

    seqs, cold, replayed = asyncio.run(scenario())
    assert seqs == sorted(seqs) and len(seqs) == 3 and seqs[1] == seqs[0] + 1
    assert cold == [] and replayed == 1


def test_unrepairable_gap_marks_the_index_cold() -> None:
    """Without a replay socket a gap is counted, reported, and the index forgotten."""

    async def scenario() -> tuple[list[str], int]:
        async with Harness(replay=False) as h:
            await h.publisher.publish([removed(1)], ts=1.0)
            h.lose([removed(2)])
            await h.publisher.publish([removed(3)], ts=3.0)
            await h.until(2)
            return h.cold, h.subscriber.stats.lost_batches

    cold, lost = asyncio.run(scenario())
    assert len(cold) == 1 and "not replayable" in cold[0] and lost == 1


def test_malformed_batch_is_counted_not_raised() -> None:
    """Garbage on the wire is counted and described; the stream continues."""

    async def scenario() -> tuple[int, int, str]:
        async with Harness(replay=False) as h:
            await h.subscriber.handle([b"kv", b"\0" * 8, b"\xc1\xc1"])
            await h.publisher.publish([removed(1)], ts=1.0)
            await h.until(1)
            return (h.subscriber.stats.malformed_batches, len(h.batches),
                    h.subscriber.stats.last_error)

    malformed, delivered, error = asyncio.run(scenario())
    assert malformed == 1 and delivered == 1 and "malformed" in error


def test_a_failing_consumer_does_not_stop_the_stream() -> None:
    """An exception while applying a batch is reported and the next batch still arrives."""

    async def scenario() -> tuple[int, str, dict[str, int]]:
        async with Harness(replay=False) as h:
            delivered: list[int] = []

            def explode_once(batch: EventBatch) -> None:
                delivered.append(batch.seq)
                if len(delivered) == 1:
                    raise RuntimeError("policy bug")

            h.subscriber._on_batch = explode_once
            await h.publisher.publish([removed(1)], ts=1.0)
            await h.publisher.publish([removed(2)], ts=2.0)
            for _ in range(200):
                if len(delivered) == 2:
                    break
                await asyncio.sleep(0.01)
            return len(delivered), h.subscriber.stats.last_error, h.subscriber.stats.dropped

    count, error, dropped = asyncio.run(scenario())
    assert count == 2 and "policy bug" in error and dropped == {"apply_error": 1}


def test_tracker_drops_a_far_ahead_number_without_adopting_it() -> None:
    """A jump past the window is dropped; the stream's position does not move."""
    tracker = SequenceTracker(window=100)
    tracker.advance(10)
    verdict = tracker.check(2**62)
    assert not verdict.apply and verdict.drop == "seq_far_ahead"
    assert tracker.check(11).apply and tracker.check(11).missing_from is None
    assert tracker.check(60).missing_from == 11  # inside the window: a gap as before


def test_tracker_refuses_negative_numbers() -> None:
    """A negative sequence number (the replay end marker's) is never a live batch."""
    tracker = SequenceTracker()
    assert tracker.check(-1).drop == "negative_seq"
    assert tracker.last_seq is None


def test_tracker_adopts_a_consistent_rival_numbering() -> None:
    """A forged first number adopted as baseline heals: three consecutive real batches behind
    it are adopted (with a cold reset); a lone stray number never is."""
    tracker = SequenceTracker(window=100)
    tracker.advance(2**62)  # the forged batch came first
    assert tracker.check(500).drop == "duplicate_batch"
    assert tracker.check(501).drop == "duplicate_batch"
    verdict = tracker.check(502)
    assert verdict.apply and verdict.restarted
    tracker.advance(502)
    assert tracker.check(900).drop == "seq_far_ahead"
    assert tracker.check(5000).drop == "seq_far_ahead"  # not consecutive: no run
    assert tracker.check(503).apply


def test_a_gap_the_replay_socket_cannot_confirm_is_dropped() -> None:
    """A forged number inside the window: the publisher's replay buffer has nothing from the
    gap's start on, so the batch is dropped and the index is not made cold."""

    async def scenario() -> tuple[list[int], list[str], dict[str, int], int | None]:
        async with Harness(replay=True) as h:
            await h.publisher.publish([removed(1)], ts=1.0)
            await h.until(1)
            last = h.subscriber.tracker.last_seq
            assert last is not None
            forged = encode_payload([AllBlocksCleared()], ts=0.0)
            await h.subscriber.handle([b"kv", (last + 50).to_bytes(8, "big"), forged])
            await h.publisher.publish([removed(2)], ts=2.0)
            await h.until(2)
            return ([b.seq for b in h.batches], h.cold, h.subscriber.stats.dropped,
                    h.subscriber.tracker.last_seq)

    seqs, cold, dropped, last = asyncio.run(scenario())
    assert seqs[1] == seqs[0] + 1 and last == seqs[1]
    assert cold == [] and dropped == {"seq_unconfirmed": 1}


def test_resync_forgets_and_refolds_the_replay_buffer() -> None:
    """A requested resync makes the index cold, then delivers every buffered batch up to the
    stream's position; the live stream continues after it."""

    async def scenario() -> tuple[list[int], list[str], int, int | None]:
        async with Harness(replay=True) as h:
            for n in range(3):
                await h.publisher.publish([removed(n)], ts=float(n))
            await h.until(3)
            live = [b.seq for b in h.batches]
            h.batches.clear()
            h.subscriber.request_resync()
            await h.until(4)  # the probe batch + 3 buffered ones at least
            await h.publisher.publish([removed(9)], ts=9.0)
            await h.until(len(h.batches) + 1)
            replayed = [b.seq for b in h.batches]
            assert set(live) <= set(replayed), (live, replayed)
            return replayed, h.cold, h.subscriber.stats.resyncs, h.subscriber.tracker.last_seq

    seqs, cold, resyncs, last = asyncio.run(scenario())
    assert resyncs == 1 and len(cold) == 1 and "suspect" in cold[0]
    assert seqs[-1] == last and seqs[:-1] == sorted(seqs[:-1])


def test_a_flood_of_bad_frames_is_counted_each_and_logged_a_few_times(
        caplog: pytest.LogCaptureFixture) -> None:
    """1,000 undecodable frames: 1,000 counted, a handful of log lines, the stream goes on."""

    async def scenario() -> tuple[dict[str, int], int]:
        async with Harness(replay=False) as h:
            for _ in range(1000):
                await h.subscriber.handle([b"kv", b"\0" * 8, b"\xc1"])
            await h.publisher.publish([removed(1)], ts=1.0)
            await h.until(1)
            return h.subscriber.stats.dropped, len(h.batches)

    with caplog.at_level(logging.WARNING, logger="kvreuse.gateway.events"):
        dropped, delivered = asyncio.run(scenario())
    lines = [r for r in caplog.records if r.name == "kvreuse.gateway.events"]
    assert dropped == {"not_msgpack": 1000} and delivered == 1
    assert 1 <= len(lines) <= 10


def test_a_killed_publishers_queued_backlog_cannot_take_the_stream_back() -> None:
    """After a restart (batch 0), the old numbering's batches still queued interleave with the
    new ones: they are dropped as retired, and the new numbering goes on undisturbed."""
    tracker = SequenceTracker(window=100_000)
    tracker.advance(1245)
    assert tracker.check(0).restarted
    tracker.advance(0)
    restarts = 0
    for new, old in zip(range(1, 600), range(1246, 1846), strict=False):
        verdict = tracker.check(old)
        assert not verdict.apply and verdict.drop == "retired_publisher"
        verdict = tracker.check(new)
        assert verdict.apply and verdict.missing_from is None
        restarts += verdict.restarted
        tracker.advance(new)
    assert restarts == 0 and tracker.last_seq == 599


def test_a_forged_batch_zero_loses_to_the_live_numbering() -> None:
    """A forged batch 0 retires the real numbering, but only for RETIRED_PATIENCE batches in
    a row with nothing of the 'new' numbering: then the real one is adopted back."""
    from kvreuse.gateway.subscriber import RETIRED_PATIENCE

    tracker = SequenceTracker()
    tracker.advance(500)
    assert tracker.check(0).restarted  # forged
    tracker.advance(0)
    seq = 501
    for _ in range(RETIRED_PATIENCE - 1):
        assert tracker.check(seq).drop == "retired_publisher"
        seq += 1
    verdict = tracker.check(seq)
    assert verdict.apply and verdict.restarted
    tracker.advance(seq)
    assert tracker.check(seq + 1).apply and not tracker.check(seq + 1).restarted
