"""The load generator's HTTP client against peers that are not well-behaved servers."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import Awaitable, Callable

from kvreuse.testing.loadgen import _cached_tokens
from kvreuse.testing.rawhttp import RawClient, Reply

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def post_to(handler: Handler, *, timeout_s: float = 5.0, tail_bytes: int = 4096) -> Reply:
    """One POST from a RawClient to a local server answering with ``handler``."""

    async def go() -> Reply:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)  # the body, b"{}"
            try:
                await handler(reader, writer)
                await writer.drain()
            except ConnectionError:
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = RawClient(timeout_s=timeout_s, tail_bytes=tail_bytes)
        try:
            return await client.post(f"http://127.0.0.1:{port}/v1/x", b"{}", {})
        finally:
            await client.close()
            server.close()

    return asyncio.run(go())


def test_a_peer_that_does_not_speak_http_is_an_error_on_the_request() -> None:
    """An SSH banner for a status line gives a readable error, not an IndexError."""

    async def ssh(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n")

    reply = post_to(ssh)
    assert reply.status == 0 and reply.error == (
        "ConnectionError: not an HTTP answer: 'SSH-2.0-OpenSSH_9.6'")


def test_a_malformed_chunk_size_or_length_is_an_error_on_the_request() -> None:
    """A chunk size that is not hex, or a Content-Length that is not a number, names itself."""

    async def bad_chunk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n")

    async def bad_length(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: -5\r\n\r\n")

    assert post_to(bad_chunk).error == "ConnectionError: not a body length: 'zz'"
    assert post_to(bad_length).error == "ConnectionError: not a body length: '-5'"


def test_headers_past_the_bound_are_an_error_on_the_request() -> None:
    """Thousands of header lines past MAX_HEAD_BYTES end the request with an error."""

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"x-filler: " + b"y" * 1000 + b"\r\n")
        for _ in range(400):
            writer.write(b"x-filler: " + b"y" * 1000 + b"\r\n")
            await writer.drain()

    assert post_to(flood).error == "ConnectionError: the answer's headers exceed 262,144 bytes"


def test_a_body_delimited_by_close_is_read() -> None:
    """Neither Content-Length nor chunks: the body runs to the close (RFC 9112 6.3)."""

    async def close_delimited(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nhello ")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"world")

    reply = post_to(close_delimited)
    assert (reply.status, reply.error, reply.tail) == (200, "", b"hello world")
    assert reply.first_byte_at is not None


def peak_bytes_of(run: Callable[[], Reply]) -> tuple[Reply, int]:
    """``run()`` and the peak of memory Python allocated meanwhile."""
    tracemalloc.start()
    try:
        return run(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


PIECE = b"x" * ((1 << 20) - 3) + b"end"


def test_a_huge_sized_body_keeps_only_its_tail() -> None:
    """A 40 MB sized body is read in pieces: the reply holds its last tail_bytes, and the
    client never holds the body (the server's own 1 MB pieces are most of the peak)."""
    size = 40 << 20

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        for _ in range(size // len(PIECE)):
            writer.write(PIECE)
            await writer.drain()

    reply, peak = peak_bytes_of(lambda: post_to(big, tail_bytes=8))
    assert (reply.status, reply.error, reply.tail) == (200, "", b"xxxxxend")
    assert peak < 10 << 20, f"peak {peak:,} bytes"


def test_a_chunk_claiming_a_terabyte_is_read_in_pieces_until_the_timeout() -> None:
    """A chunk size of 0xffffffffff, 30 MB of it, then silence: the timeout ends it and the
    client held only the tail (reading the chunk whole held all 30 MB)."""

    async def liar(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nffffffffff\r\n")
        for _ in range(30):
            writer.write(PIECE)
            await writer.drain()
        await asyncio.sleep(5)

    reply, peak = peak_bytes_of(lambda: post_to(liar, timeout_s=2.0, tail_bytes=8))
    assert reply.error.startswith("TimeoutError") and reply.tail == b"xxxxxend"
    assert peak < 10 << 20, f"peak {peak:,} bytes"


def test_a_body_cut_short_of_its_length_says_by_how_much() -> None:
    """A close 996 bytes before the Content-Length is an error naming the shortfall."""

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\nabcd")

    assert post_to(cut).error == (
        "ConnectionError: the answer broke off 996 bytes short of its Content-Length")


def test_malformed_usage_events_give_no_cached_count() -> None:
    """A usage that is a list, details that are a number, or an event that is a list: None."""
    for event in (b'{"usage": [1]}', b'{"usage": {"prompt_tokens_details": 5}}', b'[{"usage": 1}]',
                  b'{"usage": {"prompt_tokens_details": {"cached_tokens": true}}}'):
        assert _cached_tokens(b"data: " + event + b"\n\n") is None
    assert _cached_tokens(b'data: {"usage": {"prompt_tokens_details": {"cached_tokens": 7}}}\n'
                          ) == 7
