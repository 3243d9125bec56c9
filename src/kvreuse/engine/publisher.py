"""Publish KV events exactly as vLLM's ``ZmqEventPublisher`` does.

One PUB socket sends ``[topic, seq (8 bytes big-endian), msgpack EventBatch]``; the last
``buffer_steps`` batches are kept for a ROUTER replay socket, which answers a request holding a
start sequence number with every buffered batch from there, then an end marker (seq ``-1``).
Endpoint rule, vLLM's: a wildcard (``tcp://*:P``) or ``ipc://``/``inproc://`` endpoint is bound,
any other is connected to (the subscriber binds it). The replay endpoint is always bound.

The replay buffer is bounded in bytes as well as in batches (vLLM bounds it in batches only).
A batch carries its blocks' token ids, so one long prompt is a large batch: measured, each
distinct 32,000-token request grew the engine by ~380 KB with no subscriber, so vLLM's 10,000
batches would hold ~1.9 GB; :data:`DEFAULT_BUFFER_BYTES` caps it (oldest batches go first,
the newest always stays). A subscriber asking to replay from a dropped batch gets what is left,
as when batches pass the step bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from kvreuse.errors import ConfigError
from kvreuse.index.events import KVCacheEvent
from kvreuse.kv_event_codec import END_OF_REPLAY, encode_message, encode_payload

log = logging.getLogger("kvreuse.engine.events")

DEFAULT_BUFFER_BYTES = 256 * 1024 * 1024


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's ``_is_bind_endpoint``: wildcard and ipc/inproc endpoints are bound."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EventPublisher:
    """PUB plus optional replay ROUTER. Call :meth:`start` inside the event loop."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        shape: str = "map",
        int_hashes: bool = True,
        buffer_steps: int = 10_000,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        dp_rank: int = 0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.shape = shape
        self.int_hashes = int_hashes
        self.dp_rank = dp_rank
        self.seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffer_steps = buffer_steps
        self._buffer_bytes = buffer_bytes
        self.buffered_bytes = 0
        # payload bytes held for replay: at most buffer_bytes, or the newest batch alone
        self._ctx = context or zmq.asyncio.Context.instance()
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None

    def open(self) -> None:
        """Bind or connect the PUB socket and bind the replay ROUTER, once (``kvreuse engine``
        calls it before its server starts, :meth:`start` otherwise). An endpoint ZeroMQ
        refuses (malformed, in use, not this machine's) is a :class:`ConfigError` naming it,
        and leaves nothing open."""
        if self._pub is not None:
            return
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        replay = None
        endpoint = self.endpoint
        try:
            if is_bind_endpoint(endpoint):
                pub.bind(endpoint)
            else:
                pub.connect(endpoint)
            if self.replay_endpoint is not None:
                endpoint = self.replay_endpoint
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(endpoint)
        except zmq.ZMQError as exc:
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=0)
            raise ConfigError(f"KV events: cannot use {endpoint}: {exc.strerror}") from None
        self._pub, self._replay = pub, replay

    def start(self) -> None:
        """:meth:`open`, then serve the replay socket; inside the event loop."""
        self.open()
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def publish(self, events: Sequence[KVCacheEvent], ts: float) -> None:
        """Send one batch (nothing when ``events`` is empty). Never blocks on a slow reader:
        a PUB socket drops at its high-water mark, which the subscriber sees as a gap."""
        if not events or self._pub is None:
            return
        payload = encode_payload(
            events, ts=ts, dp_rank=self.dp_rank, shape=self.shape, int_hashes=self.int_hashes
        )
        seq = self.seq
        self.seq += 1
        self._buffer.append((seq, payload))
        self.buffered_bytes += len(payload)
        buffer = self._buffer
        while len(buffer) > self._buffer_steps or (
            self.buffered_bytes > self._buffer_bytes and len(buffer) > 1
        ):
            self.buffered_bytes -= len(buffer.popleft()[1])
        await self._pub.send_multipart(encode_message(self.topic, seq, payload))

    async def _serve_replay(self) -> None:
        replay = self._replay
        assert replay is not None
        while True:
            try:
                frames = await replay.recv_multipart()
            except (asyncio.CancelledError, zmq.ContextTerminated, zmq.ZMQError):
                return
            if len(frames) != 3:
                log.warning("invalid replay request with %d frames", len(frames))
                continue
            client, _, start_frame = frames
            start = int.from_bytes(start_frame, "big")
            topic = self.topic.encode()
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await replay.send_multipart([client, b"", topic, seq.to_bytes(8, "big"),
                                                 payload])
            await replay.send_multipart([client, b"", b"", END_OF_REPLAY, b""])

    def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
        for sock in (self._pub, self._replay):
            if sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sock.close(linger=0)
        self._pub = self._replay = None
