"""HTTP/1.1 on an asyncio transport, client side: one connection, one response at a time.

The building block of :mod:`kvreuse.gateway.upstream_client` (which pools these and says why
the gateway has its own client). Responses are parsed by ``httptools`` (the parser uvicorn
uses) and framed by ``content-length``, chunked encoding or, for HTTP/1.0-style answers, the
close. Waiting for the upstream is bounded per wait (headers, then each body chunk) by a read
timeout, and the wait for the first byte (the status line, and for a stream the first body
chunk) by a deadline of its own; a reader that falls more than ``HIGH_WATER_BYTES`` behind
pauses the socket (whole bodies are drained as they arrive, so only their size limit bounds
them).

What no proxy can relay is a protocol error (:class:`UpstreamProtocolError`, a 502 to the
client when no other candidate answers): a status outside 200-599 (a 1xx or 101 as the answer,
a 0 or 999 that uvicorn cannot even write, which once left the client with no byte at all),
response headers over ``MAX_RESPONSE_HEAD_BYTES``. A second response in answer to one request
is dropped, and the connection is not reused. Interim answers (1xx but 101: an unsolicited
``100 Continue``, ``102 Processing``, ``103 Early Hints``) are no answer and no error: a
client must read past them to the final one (RFC 9110, 15.2), and this one does.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Protocol, cast

import httptools

from kvreuse.errors import KvreuseError

HIGH_WATER_BYTES = 1 << 20
MAX_RESPONSE_HEAD_BYTES = 1 << 18
"""An upstream's response headers over this many bytes (names and values) are a protocol
error: an engine sends a few hundred, and an endless head once grew the gateway by 220 MiB."""


class UpstreamError(KvreuseError):
    """Talking to an upstream failed (not the caller's mistake); ``kind`` labels metrics."""

    kind = "UpstreamError"


class UpstreamConnectError(UpstreamError):
    """The upstream could not be reached (refused, unreachable, TLS failed)."""

    kind = "ConnectError"


class UpstreamTimeout(UpstreamError):
    """Connecting or waiting for the upstream's bytes took longer than configured."""

    kind = "Timeout"


class UpstreamTooLarge(UpstreamError):
    """A whole response is larger than the caller's limit (not retried: it is the answer)."""

    kind = "TooLarge"


class UpstreamProtocolError(UpstreamError):
    """The upstream closed the connection mid-response or sent something that is not HTTP."""

    kind = "ProtocolError"


class StaleConnection(UpstreamProtocolError):
    """A reused connection died before any byte of the response: safe to send again."""


class ConnectionOwner(Protocol):
    """The pool a :class:`Http1Connection` belongs to."""

    url: str
    loop: asyncio.AbstractEventLoop

    def connection_reusable(self, conn: Http1Connection) -> None:
        """Called when a response was read to its end and the server keeps the connection
        open: idle it or hand it to a waiting request."""
        ...

    def connection_closed(self, conn: Http1Connection) -> None:
        """Called when the connection closes, from either side (maybe more than once): free
        its slot."""
        ...


class Http1Connection(asyncio.Protocol):
    """One TCP (or TLS) connection and the response being read on it; one request at a
    time. Created by its owner's ``loop.create_connection``."""

    def __init__(self, pool: ConnectionOwner) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.slot_freed = False  # the pool has counted this connection out
        self.served = 0  # responses completed on this connection
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.headers_done = False
        self.framed = False  # content-length or chunked: else the body ends at close
        self.complete = False
        self.surplus = False  # the upstream sent more than one response: never reuse
        self.interim = False  # reading a 1xx interim response (skipped)
        self.head_bytes = 0
        self.keep_alive = False
        self.got_bytes = False
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False
        self.in_use = False

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        if not self.in_use:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamProtocolError(f"malformed HTTP response from {self.pool.url}: "
                                             f"{exc}"))
            self.close()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.connection_closed(self)
        if self.in_use and self.headers_done and not self.framed and exc is None:
            self.complete = True  # an HTTP/1.0-style body, delimited by the close
            self._wake()
        if self.in_use and not self.complete:
            if not self.got_bytes and self.served:
                self._fail(StaleConnection(f"{self.pool.url} closed a kept-alive connection"))
            else:
                self._fail(UpstreamProtocolError(
                    f"{self.pool.url} closed the connection mid-response"
                    + (f": {exc}" if exc else "")))

    # ------------------------------------------------------------------ httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete:  # a second response to one request: keep the first, drop the rest
            self.surplus = True
            self.keep_alive = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.surplus:
            return
        self.head_bytes += len(name) + len(value)
        if self.head_bytes > MAX_RESPONSE_HEAD_BYTES:
            self._refuse(f"response headers over {MAX_RESPONSE_HEAD_BYTES} bytes")
            return
        name = name.lower()
        if name in (b"content-length", b"transfer-encoding"):
            self.framed = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.surplus or self.error is not None:
            return
        status = self.parser.get_status_code()
        if 100 <= status <= 199 and status != 101:  # interim: the final answer follows
            self.interim = True
            self.headers, self.head_bytes, self.framed = [], 0, False
            return
        if not 200 <= status <= 599:
            self._refuse(f"status {status}, which is no final HTTP answer a proxy can relay")
            return
        self.status = status
        self.headers_done = True
        self._wake()

    def _refuse(self, what: str) -> None:
        self._fail(UpstreamProtocolError(f"{self.pool.url} answered with {what}"))
        self.close()

    def on_body(self, body: bytes) -> None:
        if self.surplus or self.error is not None:
            return
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER_BYTES and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        if self.surplus or self.error is not None:
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # ------------------------------------------------------------------ used by the response

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    async def wait(self, timeout_s: float, first_byte: bool = False) -> None:
        """Wait for more of the response; raises its error, or UpstreamTimeout (which, with
        ``first_byte``, says the first byte is late rather than that the upstream paused)."""
        if self.error is not None:
            raise self.error
        waiter = self.waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout_s, self._expire, waiter, timeout_s, first_byte)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None
        if self.error is not None:
            raise self.error

    def _expire(self, waiter: asyncio.Future[None], timeout_s: float, first_byte: bool) -> None:
        if waiter is self.waiter:
            self._fail(UpstreamTimeout(
                f"{self.pool.url} sent no first byte within the upstream timeout" if first_byte
                else f"{self.pool.url} sent nothing for {timeout_s:g} s"))

    def take(self) -> bytes:
        """The body bytes received and not yet taken."""
        data = b"".join(self.body) if len(self.body) != 1 else self.body[0]
        self.body.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def send(self, head: bytes, body: bytes) -> None:
        """Write one request. Raises StaleConnection when the connection closed while it was
        being handed over (nothing was sent: safe to send again elsewhere)."""
        assert self.transport is not None and not self.in_use, "connection is busy"
        if self.closed or self.transport.is_closing():
            raise StaleConnection(f"{self.pool.url} closed the connection before it was used")
        self._reset()
        self.in_use = True
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)

    def done(self) -> None:
        """The response was read to its end: reuse the connection when the server allows."""
        self.in_use = False
        self.served += 1
        if self.keep_alive and not self.closed:
            self.pool.connection_reusable(self)
        else:
            self.close()

    def close(self) -> None:
        self.in_use = False
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.close()
            self.pool.connection_closed(self)


class UpstreamResponse:
    """Status and headers of an upstream's answer; read the body with :meth:`read` or
    :meth:`chunks`, or drop it with :meth:`aclose` (always safe to call, also twice).

    ``first_byte_deadline`` (loop time) bounds the wait for the first body chunk of
    :meth:`chunks`: a stream whose headers came at once but whose first event does not."""

    __slots__ = ("_conn", "_first_byte_deadline", "_timeout_s", "headers", "status")

    def __init__(self, conn: Http1Connection, timeout_s: float,
                 first_byte_deadline: float | None = None) -> None:
        self._conn: Http1Connection | None = conn
        self._timeout_s = timeout_s
        self._first_byte_deadline = first_byte_deadline
        self.status = conn.status
        self.headers = conn.headers

    def header_bytes(self, name: bytes) -> bytes | None:
        """The first value of a header (name in lower case), as sent."""
        for header, value in self.headers:
            if header == name:
                return value
        return None

    def header(self, name: str) -> str | None:
        """The first value of a header (name in lower case), decoded as latin-1."""
        value = self.header_bytes(name.encode())
        return None if value is None else value.decode("latin-1")

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body, drained as it arrives (a body of any size never stalls on the
        read-ahead pause); :class:`UpstreamTooLarge` past ``limit`` bytes, declared or
        received. O(body)."""
        conn = self._conn
        if conn is None:
            return b""
        parts: list[bytes] = []
        size = 0
        try:
            if limit is not None:
                declared = self.header_bytes(b"content-length")
                if declared is not None and declared.isdigit() and int(declared) > limit:
                    raise UpstreamTooLarge(
                        f"{conn.pool.url} answered {int(declared)} bytes, over the "
                        f"{limit}-byte response limit (--max-response-bytes)")
            while True:
                if conn.body:
                    part = conn.take()
                    size += len(part)
                    if limit is not None and size > limit:
                        raise UpstreamTooLarge(
                            f"{conn.pool.url} answered more than {limit} bytes, the response "
                            f"limit (--max-response-bytes)")
                    parts.append(part)
                elif conn.complete:
                    break
                else:
                    await conn.wait(self._timeout_s)
        except BaseException:
            self._abandon()
            raise
        self._conn = None
        conn.done()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body piece by piece as the upstream sends it (empty pieces are skipped)."""
        conn = self._conn
        if conn is None:
            return
        deadline = self._first_byte_deadline
        try:
            while True:
                if conn.body:
                    deadline = None
                    yield conn.take()
                    continue
                if conn.complete:
                    break
                if deadline is None:
                    await conn.wait(self._timeout_s)
                else:
                    await conn.wait(min(max(deadline - conn.loop.time(), 0.0), self._timeout_s),
                                    first_byte=True)
        except BaseException:
            self._abandon()
            raise
        self._conn = None
        conn.done()

    async def aclose(self) -> None:
        """Give the connection back, or close it when the body was not read to the end."""
        conn = self._conn
        if conn is None:
            return
        if conn.complete and not conn.body:
            self._conn = None
            conn.done()
        else:
            self._abandon()

    def _abandon(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
