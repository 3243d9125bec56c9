"""The gateway's upstream leg: a small HTTP/1.1 keep-alive client, one pool per upstream.

Why not httpx: at a thousand proxied requests a second its per-request cost is the gateway's
budget several times over (measured in benchmarks/gateway_throughput.py and docs/performance.md:
~1.7 ms of CPU per request with one tuned ``AsyncClient`` per upstream, ~2.7 ms with one shared
client, against ~0.03 ms here), most of it in the connection pool's scan of every pooled
connection per request. The upstreams are vLLM-style servers on a trusted network, so a narrow
client is enough: requests with a body of known length, responses framed by
``content-length``, chunked encoding or close, parsed by ``httptools`` (the parser uvicorn
uses), on ``asyncio`` transports (uvloop's when installed).

What it does:

* **Pooling** (:class:`UpstreamPool`): idle connections are reused most-recent first, O(1) per
  request; at ``max_connections`` a request waits for one to come back (FIFO). A connection idle
  longer than ``idle_timeout_s`` is closed rather than reused, so the gateway, not the server
  (uvicorn's keep-alive timeout is 5 s), ends idle connections; should the server close one
  anyway just as a request goes out, that request is sent again once on a new connection - only
  when not one byte of the response came back.
* **Timeouts**: ``connect_timeout_s`` to open a connection, ``read_timeout_s`` for each wait on
  the upstream (headers, then every body chunk); both raise :class:`UpstreamTimeout`.
* **Streaming**: :meth:`UpstreamResponse.chunks` yields the body as it arrives (transfer
  decoding undone, content untouched); reading pauses while a slow consumer has more than
  ``HIGH_WATER_BYTES`` unread, so a slow client cannot make the gateway buffer a stream.
* **Failures** raise :class:`UpstreamError` subclasses; a response abandoned before its end
  closes its connection (it cannot be reused mid-message).
"""

from __future__ import annotations

import asyncio
import collections
import json
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

from kvreuse.errors import KvreuseError

HIGH_WATER_BYTES = 1 << 20
IDLE_TIMEOUT_S = 4.0


class UpstreamError(KvreuseError):
    """Talking to an upstream failed (not the caller's mistake); ``kind`` labels metrics."""

    kind = "UpstreamError"


class UpstreamConnectError(UpstreamError):
    """The upstream could not be reached (refused, unreachable, TLS failed)."""

    kind = "ConnectError"


class UpstreamTimeout(UpstreamError):
    """Connecting or waiting for the upstream's bytes took longer than configured."""

    kind = "Timeout"


class UpstreamProtocolError(UpstreamError):
    """The upstream closed the connection mid-response or sent something that is not HTTP."""

    kind = "ProtocolError"


class _Stale(UpstreamProtocolError):
    """A reused connection died before any byte of the response: safe to send again."""


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection and the response being read on it."""

    def __init__(self, pool: UpstreamPool) -> None:
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
        self.complete = False
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
        self.pool._lost(self)
        if self.in_use and not self.complete:
            if not self.got_bytes and self.served:
                self._fail(_Stale(f"{self.pool.url} closed a kept-alive connection"))
            else:
                self._fail(UpstreamProtocolError(
                    f"{self.pool.url} closed the connection mid-response"
                    + (f": {exc}" if exc else "")))

    # ------------------------------------------------------------------ httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER_BYTES and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
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

    async def wait(self, timeout_s: float) -> None:
        """Wait for more of the response; raises its error, or UpstreamTimeout."""
        if self.error is not None:
            raise self.error
        waiter = self.waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout_s, self._expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None
        if self.error is not None:
            raise self.error

    def _expire(self, waiter: asyncio.Future[None]) -> None:
        if waiter is self.waiter:
            self._fail(UpstreamTimeout(f"{self.pool.url} sent nothing for "
                                       f"{self.pool.read_timeout_s:g} s"))

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
        assert self.transport is not None and not self.in_use, "connection is busy"
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
            self.pool._release(self)
        else:
            self.close()

    def close(self) -> None:
        self.in_use = False
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.close()
            self.pool._lost(self)


class UpstreamResponse:
    """Status and headers of an upstream's answer; read the body with :meth:`read` or
    :meth:`chunks`, or drop it with :meth:`aclose` (always safe to call, also twice)."""

    __slots__ = ("_conn", "_timeout_s", "headers", "status")

    def __init__(self, conn: _Connection, timeout_s: float) -> None:
        self._conn: _Connection | None = conn
        self._timeout_s = timeout_s
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

    async def read(self) -> bytes:
        """The whole body. O(body)."""
        conn = self._conn
        if conn is None:
            return b""
        try:
            while not conn.complete:
                await conn.wait(self._timeout_s)
            data = conn.take()
        except BaseException:
            self._abandon()
            raise
        self._conn = None
        conn.done()
        return data

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body piece by piece as the upstream sends it (empty pieces are skipped)."""
        conn = self._conn
        if conn is None:
            return
        try:
            while True:
                if conn.body:
                    yield conn.take()
                    continue
                if conn.complete:
                    break
                await conn.wait(self._timeout_s)
        except BaseException:
            self._abandon()
            raise
        self._conn = None
        conn.done()

    async def json(self) -> Any:
        return json.loads(await self.read())

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


class UpstreamPool:
    """Keep-alive connections to one upstream (``http://`` or ``https://``, optional base path).

    One event loop owns a pool; create it inside that loop. ``headers`` are sent with every
    request (e.g. ``authorization``).
    """

    def __init__(
        self,
        url: str,
        *,
        max_connections: int = 1024,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 600.0,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        assert max_connections >= 1, "max_connections must be >= 1"
        parts = urlsplit(url)
        assert parts.scheme in ("http", "https") and parts.hostname, f"not an http URL: {url}"
        self.url = url.rstrip("/")
        self.loop = asyncio.get_running_loop()
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if parts.scheme == "https" else None)
        self.base_path = parts.path.rstrip("/").encode()
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle_timeout_s = idle_timeout_s
        fixed = {"host": parts.netloc, "user-agent": "kvreuse-gateway", **(headers or {})}
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode("latin-1")
        self._idle: list[_Connection] = []
        self._open = 0  # connections open or being opened
        self._waiters: collections.deque[asyncio.Future[_Connection | None]] = (
            collections.deque())
        self._closing = False

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> UpstreamResponse:
        """Send one request and wait for the response's status and headers.

        ``timeout_s`` overrides the read timeout of this request. Raises
        :class:`UpstreamError`. The caller must read or :meth:`~UpstreamResponse.aclose` the
        response, or the connection is not reused.
        """
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode(
            "latin-1") if headers else b""
        head = b"%s %s%s HTTP/1.1\r\n%s%scontent-length: %d\r\n\r\n" % (
            method.encode(), self.base_path, path.encode(), self._fixed, extra, len(body))
        timeout = self.read_timeout_s if timeout_s is None else timeout_s
        conn = await self._acquire()
        try:
            return await self._exchange(conn, head, body, timeout)
        except _Stale:
            conn = await self._acquire(fresh=True)
            return await self._exchange(conn, head, body, timeout)

    async def _exchange(self, conn: _Connection, head: bytes, body: bytes,
                        timeout_s: float) -> UpstreamResponse:
        try:
            conn.send(head, body)
            while not conn.headers_done:
                await conn.wait(timeout_s)
        except BaseException:
            conn.close()
            raise
        return UpstreamResponse(conn, timeout_s)

    # ------------------------------------------------------------------ pool

    async def _acquire(self, *, fresh: bool = False) -> _Connection:
        if self._closing:
            raise UpstreamConnectError(f"the pool for {self.url} is closed")
        now = time.monotonic()
        idle = self._idle
        while idle and not fresh:
            conn = idle.pop()
            if conn.closed:
                continue
            if now - conn.idle_since > self.idle_timeout_s:
                conn.close()  # the older ones below it are older still; they go next
                continue
            return conn
        if self._open >= self.max_connections:
            waiter: asyncio.Future[_Connection | None] = self.loop.create_future()
            self._waiters.append(waiter)
            try:
                handed = await waiter
            except BaseException:
                if not waiter.done() or waiter.cancelled():
                    self._waiters.remove(waiter)
                elif (handed_over := waiter.result()) is not None:
                    self._release(handed_over)
                else:
                    self._open -= 1
                    self._slot_freed()
                raise
            if handed is not None:
                return handed
            return await self._connect(reserved=True)  # the freed slot was counted for us
        return await self._connect()

    async def _connect(self, *, reserved: bool = False) -> _Connection:
        if not reserved:
            self._open += 1
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: _Connection(self), self.host, self.port, ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None),
                self.connect_timeout_s)
        except BaseException as exc:
            self._open -= 1
            self._slot_freed()
            if isinstance(exc, asyncio.TimeoutError):
                raise UpstreamTimeout(f"connecting to {self.url} took longer than "
                                      f"{self.connect_timeout_s:g} s") from None
            if isinstance(exc, OSError):
                raise UpstreamConnectError(f"cannot connect to {self.url}: {exc}") from None
            raise
        return conn

    def _slot_freed(self) -> None:
        """A connection slot is free: the first waiter, if any, takes it to open a connection
        (counted now, so no newcomer can take the same slot meanwhile)."""
        if not self._closing and self._pass_on(None):
            self._open += 1

    def _pass_on(self, conn: _Connection | None) -> bool:
        """Hand a connection (or, with None, the right to open one) to the first waiter."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return True
        return False

    def _release(self, conn: _Connection) -> None:
        if self._closing:
            conn.close()
        elif not self._pass_on(conn):
            conn.idle_since = time.monotonic()
            self._idle.append(conn)

    def _lost(self, conn: _Connection) -> None:
        """A connection closed (either side): free its slot. Called once per connection."""
        if conn.slot_freed:
            return
        conn.slot_freed = True
        self._open -= 1
        assert self._open >= 0, f"{self.url}: pool count went negative"
        if conn in self._idle:  # O(idle); only when a connection closes
            self._idle.remove(conn)
        self._slot_freed()

    @property
    def open_connections(self) -> int:
        return self._open

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    async def aclose(self) -> None:
        """Close every idle connection; busy ones close when their response ends."""
        self._closing = True
        for conn in list(self._idle):
            conn.close()
        self._idle.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(UpstreamConnectError(f"the pool for {self.url} closed"))
