"""The gateway's upstream leg: a small HTTP/1.1 keep-alive client, one pool per upstream.

Why not httpx: at a thousand proxied requests a second its per-request cost is the gateway's
budget several times over. With 32 requests in flight on this project's 2-CPU machine
(benchmarks/gateway_throughput.py, section (c); docs/performance.md), one tuned
``AsyncClient`` per upstream costs 1.7-2.9 ms of CPU per request and one shared client 3-5 ms,
most of it in httpcore's scan of every pooled connection for every request; this client costs
0.02-0.05 ms. The upstreams are vLLM-style servers on a trusted network, so a narrow
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
  the upstream (headers, then every body chunk), and per request ``first_byte_timeout_s``, a
  deadline for the status line and (read with :meth:`UpstreamResponse.chunks`) the first body
  chunk; all raise :class:`UpstreamTimeout`, and a request that times out has its connection
  closed, which is how an HTTP server learns to abort it.
* **Streaming**: :meth:`UpstreamResponse.chunks` yields the body as it arrives (transfer
  decoding undone, content untouched); reading pauses while a slow consumer has more than
  ``HIGH_WATER_BYTES`` unread, so a slow client cannot make the gateway buffer a stream
  (:mod:`kvreuse.gateway.http1` holds the per-connection side).
* **Failures** raise :class:`UpstreamError` subclasses; a response abandoned before its end
  closes its connection (it cannot be reused mid-message).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

from kvreuse.errors import ConfigError, require_at_least
from kvreuse.gateway.http1 import (
    HIGH_WATER_BYTES,
    Http1Connection,
    StaleConnection,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamTooLarge,
)

__all__ = ["HIGH_WATER_BYTES", "IDLE_TIMEOUT_S", "UpstreamConnectError", "UpstreamError",
           "UpstreamPool", "UpstreamProtocolError", "UpstreamResponse", "UpstreamTimeout",
           "UpstreamTooLarge"]

IDLE_TIMEOUT_S = 4.0
# A request meets a connection the server closed (while idle, or while being handed over) at
# most this many times before the error reaches the caller; nothing of it was answered.
STALE_ATTEMPTS = 3


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
        require_at_least("max_connections", max_connections, 1)
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"upstream url must be http(s)://HOST[:PORT][/PATH], got {url!r}")
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
        self._idle: list[Http1Connection] = []
        self._open = 0  # connections open or being opened
        self._waiters: collections.deque[asyncio.Future[Http1Connection | None]] = (
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
        first_byte_timeout_s: float | None = None,
    ) -> UpstreamResponse:
        """Send one request and wait for the response's status and headers.

        ``timeout_s`` overrides the read timeout of this request; ``first_byte_timeout_s``
        bounds the time from now to the status line and, for :meth:`UpstreamResponse.chunks`,
        to the first body chunk (waiting for a free connection included). Raises
        :class:`UpstreamError`. The caller must read or :meth:`~UpstreamResponse.aclose` the
        response, or the connection is not reused.
        """
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode(
            "latin-1") if headers else b""
        head = b"%s %s%s HTTP/1.1\r\n%s%scontent-length: %d\r\n\r\n" % (
            method.encode(), self.base_path, path.encode(), self._fixed, extra, len(body))
        timeout = self.read_timeout_s if timeout_s is None else timeout_s
        deadline = (None if first_byte_timeout_s is None
                    else self.loop.time() + first_byte_timeout_s)
        conn = await self._acquire()
        for attempt in range(STALE_ATTEMPTS):
            try:
                return await self._exchange(conn, head, body, timeout, deadline)
            except StaleConnection:
                if attempt == STALE_ATTEMPTS - 1:
                    raise
                conn = await self._acquire(fresh=True)
        raise AssertionError("unreachable: the loop returns or raises")

    async def _exchange(self, conn: Http1Connection, head: bytes, body: bytes,
                        timeout_s: float, deadline: float | None) -> UpstreamResponse:
        try:
            conn.send(head, body)
            while not conn.headers_done:
                if deadline is None:
                    await conn.wait(timeout_s)
                else:
                    await conn.wait(min(max(deadline - self.loop.time(), 0.0), timeout_s),
                                    first_byte=True)
        except BaseException:
            conn.close()
            raise
        return UpstreamResponse(conn, timeout_s, deadline)

    # ------------------------------------------------------------------ pool

    async def _acquire(self, *, fresh: bool = False) -> Http1Connection:
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
            waiter: asyncio.Future[Http1Connection | None] = self.loop.create_future()
            self._waiters.append(waiter)
            try:
                handed = await waiter
            except BaseException:
                if not waiter.done() or waiter.cancelled():
                    with contextlib.suppress(ValueError):  # (already passed over)
                        self._waiters.remove(waiter)
                elif (handed_over := waiter.result()) is not None:
                    self.connection_reusable(handed_over)
                else:
                    self._open -= 1
                    self._slot_freed()
                raise
            if handed is not None:
                return handed
            return await self._connect(reserved=True)  # the freed slot was counted for us
        return await self._connect()

    async def _connect(self, *, reserved: bool = False) -> Http1Connection:
        if not reserved:
            self._open += 1
        made: list[Http1Connection] = []

        def protocol() -> Http1Connection:
            made.append(Http1Connection(self))
            return made[-1]

        try:
            async with asyncio.timeout(self.connect_timeout_s):  # not wait_for: see tasks.py
                _, conn = await self.loop.create_connection(
                    protocol, self.host, self.port, ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None)
        except BaseException as exc:
            # Cancelled just as the connection was made: the connection may already have
            # closed and freed its slot (asyncio closes it while cancelling); else close it
            # here without it freeing the slot a second time, or the count goes wrong.
            freed = any(orphan.slot_freed for orphan in made)
            for orphan in made:
                orphan.slot_freed = True
                orphan.close()
            if not freed:
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

    def _pass_on(self, conn: Http1Connection | None) -> bool:
        """Hand a connection (or, with None, the right to open one) to the first waiter."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return True
        return False

    def connection_reusable(self, conn: Http1Connection) -> None:
        if self._closing:
            conn.close()
        elif not self._pass_on(conn):
            conn.idle_since = time.monotonic()
            self._idle.append(conn)

    def connection_closed(self, conn: Http1Connection) -> None:
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
