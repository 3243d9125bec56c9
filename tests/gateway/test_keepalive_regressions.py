"""Keep-alive regressions of the client-facing limits and the upstream client's checks, over
real sockets: legitimate clients and upstreams whose requests were refused or raced."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import pytest

from kvreuse.gateway.serve import MAX_HEAD_BYTES
from kvreuse.gateway.upstream_client import UpstreamPool

from .fleet import Engine
from .test_serve_limits import BODY, Factory, Reader, connect, request

HEAD_TIMEOUT_S = 0.4


def chunked(body: bytes, size: int) -> bytes:
    """A POST /v1/completions whose body is sent in chunks of ``size`` bytes."""
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
                      for i in range(0, len(body), size))
    return head + chunks + b"0\r\n\r\n"


def unsolicited(sock: socket.socket) -> bytes:
    """What the server sent unasked (without waiting)."""
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return b""
    finally:
        sock.setblocking(True)


def served_after_idle(gateway_factory: Factory, engine: Engine, first: bytes) -> None:
    """Send ``first`` (a request and whatever follows it), read its answer, wait three head
    timeouts: nothing came unasked, and the next request on the connection is served."""
    gateway = gateway_factory([engine.upstream], head_timeout_s=HEAD_TIMEOUT_S,
                              idle_timeout_s=5.0)
    with connect(gateway) as sock:
        reader = Reader(sock)
        sock.sendall(first)
        assert reader.response()[0] == 200
        time.sleep(3 * HEAD_TIMEOUT_S)
        assert unsolicited(sock) == b""
        sock.sendall(request())
        status, _, body = reader.response()
        assert status == 200, body[:300]


def test_a_chunked_request_body_leaves_no_unsolicited_408(engine: Engine,
                                                          gateway_factory: Factory) -> None:
    """After a request with a chunked body, the idle connection gets no 408 at the head timeout."""
    served_after_idle(gateway_factory, engine, chunked(BODY, 16))


def test_empty_lines_between_requests_leave_no_unsolicited_408(engine: Engine,
                                                               gateway_factory: Factory) -> None:
    """An empty line a client sends after a body (RFC 9112 2.2) starts no head timer."""
    served_after_idle(gateway_factory, engine, request() + b"\r\n")


def test_a_finely_chunked_body_is_not_counted_in_the_next_head(engine: Engine,
                                                               gateway_factory: Factory) -> None:
    """The chunk markers of a body are no part of the next request's head (no wrong 431)."""
    gateway = gateway_factory([engine.upstream])
    body = BODY + b" " * 8000  # (JSON allows the trailing spaces)
    with connect(gateway) as sock:
        reader = Reader(sock)
        sock.sendall(chunked(body, 1))  # ~40 KB of chunk markers
        assert reader.response()[0] == 200
        sock.sendall(request(head_bytes=MAX_HEAD_BYTES // 2))
        status, _, answer = reader.response()
        assert status == 200, answer[:300]


@pytest.mark.parametrize("interim", [
    b"HTTP/1.1 100 Continue\r\n\r\n",
    b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n",
    b"HTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 100 Continue\r\n\r\n",
])
def test_an_upstreams_interim_1xx_answers_are_skipped(interim: bytes) -> None:
    """1xx interim answers before the final one are read past (RFC 9110 15.2), not a 502."""
    final = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(interim)
                await writer.drain()
                await asyncio.sleep(0.01)  # (the final answer in a read of its own)
                writer.write(final)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def scenario() -> list[tuple[int, bytes, int]]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = UpstreamPool(f"http://127.0.0.1:{port}")
        answers = []
        try:
            for _ in range(2):
                response = await pool.request("POST", "/x", json.dumps({}).encode())
                answers.append((response.status, await response.read(),
                                pool.open_connections))
        finally:
            await pool.aclose()
            server.close()
        return answers

    assert asyncio.run(scenario()) == [(200, b"ok", 1), (200, b"ok", 1)]


def test_empty_lines_trickled_on_an_idle_connection_are_timed(engine: Engine,
                                                              gateway_factory: Factory) -> None:
    """Empty lines sent now and then after an answer cannot hold the connection open for ever."""
    gateway = gateway_factory([engine.upstream], head_timeout_s=HEAD_TIMEOUT_S,
                              idle_timeout_s=1.0)
    with connect(gateway) as sock:
        reader = Reader(sock)
        sock.sendall(request())
        assert reader.response()[0] == 200
        started = time.monotonic()
        with contextlib.suppress(OSError):
            while time.monotonic() - started < 6 and not unsolicited(sock):
                sock.sendall(b"\r\n")  # faster than both the idle and the head timeout
                time.sleep(0.1)
        assert time.monotonic() - started < 3
        assert reader.response()[0] == 408
        assert reader.at_eof()
