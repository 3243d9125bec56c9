"""Hostile KV-event publishers against a running gateway: real ZMQ, real ``kvreuse engine``.

A rogue PUB socket connects to the events endpoint the gateway binds (as anything that can
reach that port can) and sends what the issue reproduced: a frame nested 100,000 deep, a batch
numbered 2^62, frames above the size cap, nothing at all. The engine's own stream must go on,
and exact-mode predictions must still equal the engine's realized cached tokens.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from kvreuse.gateway.subscriber import StreamStats
from kvreuse.hitrate.prometheus import parse_exposition
from kvreuse.index.events import AllBlocksCleared
from kvreuse.kv_event_codec import encode_payload

from .fleet import Engine, RunningGateway, start_engine

Factory = Callable[..., RunningGateway]
TOPIC = b"kv-events"


class Rogue:
    """A PUB socket connected to the gateway's bound events endpoint."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def until_heard(self, stats: StreamStats, timeout_s: float = 5.0) -> None:
        """PUB drops messages until its connection is up: probe with a two-frame message
        (counted as bad_frames) until one is counted."""
        before = stats.dropped.get("bad_frames", 0)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.send([TOPIC, b"probe"])
            time.sleep(0.05)
            if stats.dropped.get("bad_frames", 0) > before:
                return
        raise AssertionError("the gateway never heard the rogue publisher")

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def engine() -> Iterator[Engine]:
    started = start_engine("e0")
    yield started
    started.server.stop()


def text(words: int = 80) -> str:
    return uuid.uuid4().hex + " " + " ".join(f"w{i % 37}" for i in range(words))


def exchange(gateway: RunningGateway, prompt: str) -> tuple[int, int]:
    """(predicted, realized) cached tokens of one completion."""
    body: dict[str, Any] = {"model": "sim", "prompt": prompt, "max_tokens": 2}
    response = httpx.post(gateway.url + "/v1/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text
    gateway.events_settled()
    return (int(response.headers["x-kvreuse-predicted-cached-tokens"]),
            response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def predictions_hold(gateway: RunningGateway) -> list[tuple[int, int]]:
    """A prompt, then the same prompt extended: exact mode must predict the hit exactly."""
    prompt = text()
    pairs = [exchange(gateway, prompt), exchange(gateway, prompt + " more words here")]
    assert pairs[1][1] > 0, pairs
    return pairs


def metric(gateway: RunningGateway, name: str, **labels: str) -> float:
    for sample in parse_exposition(httpx.get(gateway.url + "/metrics", timeout=5).text,
                                   only=(name,)):
        if dict(sample.labels) == labels:
            return sample.value
    raise AssertionError(f"{name}{labels} not in /metrics")


def test_deeply_nested_frame_is_counted_and_the_stream_goes_on(engine: Engine,
                                                               gateway_factory: Factory) -> None:
    """[topic, seq, 0x91 * 100000 + 0xc0] is dropped as too_deep; later events still apply."""
    gateway = gateway_factory([engine], policy="exact", policy_options={"block_size": 4})
    stats = gateway.gateway.router.streams["e0"]
    rogue = Rogue(engine.upstream.events or "")
    try:
        rogue.until_heard(stats)
        nested = b"\x91" * 100_000 + b"\xc0"
        rogue.send([b"", (1).to_bytes(8, "big"), nested])  # the frame: topic filtered
        rogue.send([TOPIC, (1).to_bytes(8, "big"), nested])  # the same past the topic filter
        deadline = time.monotonic() + 5
        while stats.dropped.get("too_deep", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        rogue.close()
    assert stats.dropped.get("too_deep") == 1
    assert stats.state == "running"
    assert metric(gateway, "kvreuse_gateway_kv_events_dropped_total", upstream="e0",
                  reason="too_deep") == 1
    assert metric(gateway, "kvreuse_gateway_kv_subscriber_state", upstream="e0",
                  state="running") == 1
    assert all(p == r for p, r in predictions_hold(gateway))
    assert metric(gateway, "kvreuse_gateway_kv_events_last_age_seconds", upstream="e0") < 5


def test_forged_far_ahead_sequence_is_dropped_not_adopted(engine: Engine,
                                                          gateway_factory: Factory) -> None:
    """A batch numbered 2^62 clearing the index is dropped; the index and predictions hold."""
    gateway = gateway_factory([engine], policy="exact", policy_options={"block_size": 4})
    router = gateway.gateway.router
    stats = router.streams["e0"]
    before = predictions_hold(gateway)
    assert all(p == r for p, r in before)
    blocks = router.indexes["e0"].num_blocks
    assert blocks > 0
    rogue = Rogue(engine.upstream.events or "")
    try:
        rogue.until_heard(stats)
        forged = encode_payload([AllBlocksCleared()], ts=0.0)
        rogue.send([TOPIC, (2**62).to_bytes(8, "big"), forged])
        deadline = time.monotonic() + 5
        while stats.dropped.get("seq_far_ahead", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        rogue.close()
    assert stats.dropped.get("seq_far_ahead") == 1
    subscriber = gateway.gateway.subscribers[0]
    assert subscriber.tracker.last_seq is not None and subscriber.tracker.last_seq < 2**62
    assert router.indexes["e0"].num_blocks == blocks and stats.cold_resets == 0
    after = predictions_hold(gateway)
    assert all(p == r for p, r in after), after


def test_frames_above_the_cap_are_refused_by_the_socket(engine: Engine,
                                                        gateway_factory: Factory) -> None:
    """A frame over kv_events_max_frame_bytes never reaches the decoder; the stream goes on."""
    gateway = gateway_factory([engine], policy="exact", policy_options={"block_size": 4},
                              kv_events_max_frame_bytes=1 << 20)
    stats = gateway.gateway.router.streams["e0"]
    rogue = Rogue(engine.upstream.events or "")
    try:
        rogue.until_heard(stats)
        dropped_before = dict(stats.dropped)
        # Valid msgpack, so a frame that got through would be decoded (and counted).
        huge = msgspec.msgpack.encode([0.0, [], 0, "x" * (3 << 20)])
        for _ in range(3):
            rogue.send([TOPIC, (5).to_bytes(8, "big"), huge])
        time.sleep(0.5)
        assert stats.dropped == dropped_before
        rogue.until_heard(stats)  # the socket still listens: the publisher reconnected
    finally:
        rogue.close()
    assert stats.malformed_batches == sum(stats.dropped.values())
    assert all(p == r for p, r in predictions_hold(gateway))


def test_a_publisher_that_connects_and_never_sends_changes_nothing(
        engine: Engine, gateway_factory: Factory) -> None:
    """Idle rogue connections (a hundred of them) neither stall nor disturb the stream."""
    gateway = gateway_factory([engine], policy="exact", policy_options={"block_size": 4})
    rogues = [Rogue(engine.upstream.events or "") for _ in range(100)]
    try:
        time.sleep(0.3)
        assert all(p == r for p, r in predictions_hold(gateway))
    finally:
        for rogue in rogues:
            rogue.close()
    assert gateway.gateway.router.streams["e0"].dropped == {}


def test_watchdog_restarts_a_subscriber_that_stopped(engine: Engine,
                                                     gateway_factory: Factory) -> None:
    """A subscriber loop that ends anyway is run again and its events flow again."""
    gateway = gateway_factory([engine], policy="exact", policy_options={"block_size": 4})
    stats = gateway.gateway.router.streams["e0"]
    task = gateway.gateway._subscriber_tasks["e0"]
    loop = task.get_loop()
    loop.call_soon_threadsafe(task.cancel)  # the loop stops as if a bug escaped it
    deadline = time.monotonic() + 10
    while stats.restarts < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats.restarts == 1
    assert gateway.gateway._subscriber_tasks["e0"] is not task
    assert all(p == r for p, r in predictions_hold(gateway))
    assert stats.state == "running"
    assert metric(gateway, "kvreuse_gateway_kv_subscriber_restarts_total", upstream="e0") == 1


def test_ready_reports_an_upstream_whose_events_went_silent(gateway_factory: Factory) -> None:
    """Events published to another address than the gateway's: /ready names the upstream
    (still 200: it serves, only its index is blind) once it answered uncached prompts."""
    engine = start_engine("e0")
    try:
        wrong = engine.upstream.__class__(engine.upstream.url, name="e0",
                                          events=f"tcp://127.0.0.1:{_free()}", topic="kv-events")
        gateway = gateway_factory([wrong], policy="exact", policy_options={"block_size": 4},
                                  events_silence_s=0.2)
        ready = httpx.get(gateway.url + "/ready", timeout=5).json()
        assert ready["kv_events_silent"] == []
        for _ in range(3):
            body = {"model": "sim", "prompt": text(), "max_tokens": 2}
            assert httpx.post(gateway.url + "/v1/completions", json=body,
                              timeout=10).status_code == 200
            time.sleep(0.15)
        time.sleep(0.3)
        response = httpx.get(gateway.url + "/ready", timeout=5)
    finally:
        engine.server.stop()
    assert response.status_code == 200
    assert response.json()["kv_events_silent"] == ["e0"]
    assert response.json()["degraded"] is True


def _free() -> int:
    from kvreuse.testing.servers import free_port

    return free_port()
