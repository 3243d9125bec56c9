"""The gateway's upstream HTTP/1.1 client, against scripted servers on real sockets.

Every test runs on asyncio's loop and on uvloop's (what ``kvreuse route`` uses): their
transports differ (uvloop's are no subclass of asyncio.Transport).
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvreuse.gateway.upstream_client import (
    UpstreamConnectError,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from kvreuse.testing.servers import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    """Runs a coroutine on a fresh event loop of the parametrized kind."""
    if request.param == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return uvloop.run  # type: ignore[no-any-return]
    return asyncio.run


@dataclass
class Script:
    """A server whose connections are handled by ``handler(reader, writer, index)``."""

    handler: Handler
    connections: int = 0
    server: asyncio.Server | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def start(self) -> str:
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            index = self.connections
            self.connections += 1
            try:
                await self.handler(reader, writer, index)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(accept, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head and body (content-length framed)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


async def keep_answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         index: int) -> None:
    while True:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()


async def roundtrip(pool: UpstreamPool, path: str = "/x", body: bytes = b"{}") -> bytes:
    response = await pool.request("POST", path, body)
    assert response.status == 200
    return await response.read()


def test_keep_alive_reuses_one_connection(run: Callable[..., Any]) -> None:
    """Sequential requests travel over the same kept-alive connection."""
    async def main() -> int:
        script = Script(keep_answering)
        pool = UpstreamPool(await script.start())
        for _ in range(5):
            assert await roundtrip(pool) == b"ok"
        await pool.aclose()
        await script.stop()
        return script.connections

    assert run(main()) == 1


def test_request_carries_method_path_headers_and_body(run: Callable[..., Any]) -> None:
    """The request line, base path, fixed and per-request headers and body go out as given."""
    seen: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     index: int) -> None:
        seen.append(await read_request(reader))
        writer.write(OK)
        await writer.drain()

    async def main() -> None:
        script = Script(record)
        url = await script.start()
        pool = UpstreamPool(url + "/base/", headers={"authorization": "Bearer k"})
        response = await pool.request("POST", "/v1/completions", b'{"a": 1}',
                                      {"x-request-id": "r-1"})
        assert response.header("content-type") == "text/plain"
        await response.read()
        await pool.aclose()
        await script.stop()

    run(main())
    head, _, body = seen[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /base/v1/completions HTTP/1.1"
    assert b"authorization: Bearer k" in lines and b"x-request-id: r-1" in lines
    assert b"content-length: 8" in lines and body == b'{"a": 1}'


def test_chunked_stream_arrives_piece_by_piece(run: Callable[..., Any]) -> None:
    """A chunked body is yielded as it arrives, not after the response ends."""
    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     index: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()
        await read_request(reader)  # the connection is reused afterwards
        writer.write(OK)
        await writer.drain()

    async def main() -> tuple[list[tuple[bytes, float]], float]:
        script = Script(stream)
        pool = UpstreamPool(await script.start())
        started = time.monotonic()
        response = await pool.request("GET", "/events")
        pieces = [(chunk, time.monotonic() - started) async for chunk in response.chunks()]
        assert await roundtrip(pool) == b"ok" and script.connections == 1
        await pool.aclose()
        await script.stop()
        return pieces, time.monotonic() - started

    pieces, _ = run(main())
    assert b"".join(p for p, _ in pieces) == b"firstsecond"
    assert pieces[0][0] == b"first" and pieces[0][1] < 0.25 <= pieces[-1][1]


def test_stale_kept_alive_connection_is_retried_on_a_new_one(run: Callable[..., Any]) -> None:
    """A reused connection the server closes without answering is replaced transparently."""
    async def answer_once_then_drop(reader: asyncio.StreamReader,
                                    writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        if index == 0:
            await read_request(reader)  # the second request: close without a byte back
            return
        await keep_answering(reader, writer, index)

    async def main() -> int:
        script = Script(answer_once_then_drop)
        pool = UpstreamPool(await script.start())
        assert await roundtrip(pool) == b"ok"
        assert await roundtrip(pool) == b"ok"
        await pool.aclose()
        await script.stop()
        return script.connections

    assert run(main()) == 2


def test_fresh_connection_closed_before_answer_is_an_error(run: Callable[..., Any]) -> None:
    """A new connection that closes without a response raises (never silently resent)."""
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   index: int) -> None:
        await read_request(reader)

    async def main() -> int:
        script = Script(drop)
        pool = UpstreamPool(await script.start())
        with pytest.raises(UpstreamProtocolError):
            await pool.request("POST", "/x", b"{}")
        await pool.aclose()
        await script.stop()
        return script.connections

    assert run(main()) == 1


def test_connection_closed_mid_body_raises(run: Callable[..., Any]) -> None:
    """A body cut short by the server's close raises instead of returning partial bytes."""
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  index: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly a part")
        await writer.drain()

    async def main() -> None:
        script = Script(cut)
        pool = UpstreamPool(await script.start())
        response = await pool.request("POST", "/x", b"{}")
        with pytest.raises(UpstreamProtocolError):
            await response.read()
        await pool.aclose()
        await script.stop()

    run(main())


def test_silent_upstream_times_out(run: Callable[..., Any]) -> None:
    """No response within the read timeout raises UpstreamTimeout, promptly."""
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     index: int) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async def main() -> float:
        script = Script(silent)
        pool = UpstreamPool(await script.start(), read_timeout_s=0.2)
        started = time.monotonic()
        with pytest.raises(UpstreamTimeout):
            await pool.request("POST", "/x", b"{}")
        waited = time.monotonic() - started
        await pool.aclose()
        await script.stop()
        return waited

    assert 0.15 < run(main()) < 2.0


def test_refused_connection_is_a_connect_error(run: Callable[..., Any]) -> None:
    """Nothing listening: UpstreamConnectError naming the upstream."""
    async def main() -> None:
        url = f"http://127.0.0.1:{free_port()}"
        pool = UpstreamPool(url)
        with pytest.raises(UpstreamConnectError, match=re.escape(url)):
            await pool.request("GET", "/health")
        assert pool.open_connections == 0
        await pool.aclose()

    run(main())


def test_max_connections_queues_requests(run: Callable[..., Any]) -> None:
    """With one connection allowed, concurrent requests wait their turn and all succeed."""
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   index: int) -> None:
        while True:
            await read_request(reader)
            await asyncio.sleep(0.02)
            writer.write(OK)
            await writer.drain()

    async def main() -> tuple[list[bytes], int, int]:
        script = Script(slow)
        pool = UpstreamPool(await script.start(), max_connections=1)
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, pool.open_connections)
                await asyncio.sleep(0.001)

        watcher = asyncio.get_running_loop().create_task(watch())
        bodies = await asyncio.gather(*(roundtrip(pool) for _ in range(8)))
        watcher.cancel()
        await pool.aclose()
        await script.stop()
        return bodies, script.connections, peak

    bodies, connections, peak = run(main())
    assert bodies == [b"ok"] * 8 and connections == 1 and peak == 1


def test_cancelled_waiter_does_not_leak_the_slot(run: Callable[..., Any]) -> None:
    """A request cancelled while waiting for a connection leaves the pool usable."""
    async def main() -> bytes:
        script = Script(keep_answering)
        pool = UpstreamPool(await script.start(), max_connections=1)
        held = await pool.request("POST", "/x", b"{}")  # not read yet: holds the only slot
        waiting = asyncio.get_running_loop().create_task(roundtrip(pool))
        await asyncio.sleep(0.05)
        waiting.cancel()
        await held.read()
        body = await asyncio.wait_for(roundtrip(pool), 2.0)
        await pool.aclose()
        await script.stop()
        return body

    assert run(main()) == b"ok"


def test_abandoned_response_closes_its_connection(run: Callable[..., Any]) -> None:
    """A response dropped before its end is not reused: the next request opens a new one."""
    async def long_then_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           index: int) -> None:
        await read_request(reader)
        if index == 0:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf")
            await writer.drain()
            await asyncio.sleep(1)
            return
        writer.write(OK)
        await writer.drain()

    async def main() -> int:
        script = Script(long_then_ok)
        pool = UpstreamPool(await script.start())
        response = await pool.request("POST", "/x", b"{}")
        await response.aclose()
        assert await roundtrip(pool) == b"ok"
        await pool.aclose()
        await script.stop()
        return script.connections

    assert run(main()) == 2


def test_idle_connection_past_its_timeout_is_not_reused(run: Callable[..., Any]) -> None:
    """A connection idle longer than idle_timeout_s is closed, not sent on."""
    async def main() -> int:
        script = Script(keep_answering)
        pool = UpstreamPool(await script.start(), idle_timeout_s=0.05)
        await roundtrip(pool)
        await asyncio.sleep(0.1)
        await roundtrip(pool)
        await pool.aclose()
        await script.stop()
        return script.connections

    assert run(main()) == 2


def test_connection_close_response_is_not_reused(run: Callable[..., Any]) -> None:
    """``Connection: close`` from the server retires the connection."""
    async def close_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         index: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    async def main() -> int:
        script = Script(close_each)
        pool = UpstreamPool(await script.start())
        for _ in range(3):
            assert await roundtrip(pool) == b"ok"
        await pool.aclose()
        await script.stop()
        return script.connections

    assert run(main()) == 3


def test_slow_reader_pauses_the_upstream(run: Callable[..., Any]) -> None:
    """An unread stream stops being read (the server's writes block), so the gateway does not
    buffer an upstream's whole answer; reading it then gets every byte."""
    size = 64 << 20
    finished: list[bool] = []

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    index: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        block = b"x" * (1 << 20)
        for _ in range(size >> 20):
            writer.write(block)
            await writer.drain()
        finished.append(True)

    async def main() -> tuple[bool, int]:
        script = Script(flood)
        pool = UpstreamPool(await script.start())
        response = await pool.request("GET", "/big")
        await asyncio.sleep(0.5)  # read nothing meanwhile
        blocked = not finished
        total = 0
        async for chunk in response.chunks():
            total += len(chunk)
        await pool.aclose()
        await script.stop()
        return blocked, total

    blocked, total = run(main())
    assert blocked and total == size


def test_body_delimited_by_close_is_complete(run: Callable[..., Any]) -> None:
    """A response with neither content-length nor chunked encoding ends at the close."""
    async def old_style(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        index: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end")
        await writer.drain()

    async def main() -> tuple[bytes, int]:
        script = Script(old_style)
        pool = UpstreamPool(await script.start())
        body = await roundtrip(pool)
        second = await roundtrip(pool)
        assert second == body
        await pool.aclose()
        await script.stop()
        return body, script.connections

    assert run(main()) == (b"until the end", 2)


def test_connection_closed_after_answering_fails_no_queued_request(
        run: Callable[..., Any]) -> None:
    """A kept-alive connection the server closes right after answering, while requests queue
    for it (one connection allowed), is replaced for them: none fails, none waits out the
    read timeout."""
    async def first_closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           index: int) -> None:
        if index > 0:
            await keep_answering(reader, writer, index)
        await read_request(reader)
        writer.write(OK)  # keep-alive as far as the client knows, then closed at once
        await writer.drain()

    async def main() -> list[bytes]:
        script = Script(first_closes)
        pool = UpstreamPool(await script.start(), max_connections=1, read_timeout_s=3.0)
        bodies = await asyncio.wait_for(
            asyncio.gather(*(roundtrip(pool) for _ in range(4))), 2.0)
        await pool.aclose()
        await script.stop()
        return bodies

    for _ in range(5):
        assert run(main()) == [b"ok"] * 4


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_pool_survives_random_cancellations(run: Callable[..., Any], seed: int) -> None:
    """Seeded stress: requests cancelled at random points (waiting for a slot, mid-request)
    leak no connection slot, the limit holds, and the pool still serves afterwards."""
    rng = random.Random(seed)

    async def jittery(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      index: int) -> None:
        while True:
            await read_request(reader)
            await asyncio.sleep(rng.random() * 0.004)
            writer.write(OK)
            await writer.drain()

    async def main() -> tuple[int, int, int, list[bytes]]:
        script = Script(jittery)
        pool = UpstreamPool(await script.start(), max_connections=4)
        peak = 0
        loop = asyncio.get_running_loop()
        tasks = []
        for _ in range(120):
            tasks.append(loop.create_task(roundtrip(pool)))
            if rng.random() < 0.3:
                victim = rng.choice(tasks)
                loop.call_later(rng.random() * 0.01, victim.cancel)
            peak = max(peak, pool.open_connections)
            await asyncio.sleep(rng.random() * 0.002)
        await asyncio.gather(*tasks, return_exceptions=True)
        after = await asyncio.wait_for(asyncio.gather(*(roundtrip(pool) for _ in range(8))),
                                       2.0)
        open_now, idle_now = pool.open_connections, pool.idle_connections
        await pool.aclose()
        await script.stop()
        return peak, open_now, idle_now, after

    peak, open_now, idle_now, after = run(main())
    assert peak <= 4 and after == [b"ok"] * 8
    assert open_now == idle_now <= 4  # every open connection is back in the pool
