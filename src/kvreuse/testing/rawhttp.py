"""A minimal HTTP/1.1 client on asyncio streams, for load generation only.

Why not httpx here: on this project's two-core machines httpx costs about 5 ms of CPU per
streamed request (its connection pool scans every connection per request), so a Python client
at 200 req/s would take a whole core from the very servers it measures. This client does one
thing: POST a body with keep-alive, read a chunked or sized answer, note when the first body
byte arrived. About 0.3 ms of CPU per request. Not a general HTTP client: no TLS, redirects,
proxies, or compression.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass(slots=True)
class Reply:
    """What came back: status, headers (lower-case names), the first-body-byte time (perf
    counter seconds) and the body's last ``tail_bytes`` bytes; ``error`` when it broke."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    first_byte_at: float | None = None
    tail: bytes = b""
    saw_error_event: bool = False
    error: str = ""


class _Stale(Exception):
    """A reused keep-alive connection was closed by the server before answering."""


class RawClient:
    """Keep-alive connections per host, reused across requests; one event loop only."""

    def __init__(self, *, timeout_s: float = 120.0, tail_bytes: int = 4096) -> None:
        self.timeout_s = timeout_s
        self.tail_bytes = tail_bytes
        self._idle: dict[tuple[str, int], list[tuple[asyncio.StreamReader,
                                                     asyncio.StreamWriter]]] = {}

    async def close(self) -> None:
        for pool in self._idle.values():
            for _, writer in pool:
                writer.close()
        self._idle.clear()

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        path = parts.path or "/"
        head = [f"POST {path} HTTP/1.1", f"host: {host}:{port}",
                f"content-length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        request = ("\r\n".join(head) + "\r\n\r\n").encode() + body
        reply = Reply()
        try:
            async with asyncio.timeout(self.timeout_s):
                try:
                    await self._exchange(host, port, request, reply, reuse=True)
                except _Stale:
                    reply = Reply()
                    await self._exchange(host, port, request, reply, reuse=False)
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as exc:
            reply.error = f"{type(exc).__name__}: {exc}"
        return reply

    async def _exchange(self, host: str, port: int, request: bytes, reply: Reply,
                        reuse: bool) -> None:
        pool = self._idle.setdefault((host, port), [])
        reused = reuse and bool(pool)
        if reused:
            reader, writer = pool.pop()
        else:
            reader, writer = await asyncio.open_connection(host, port)
        keep = False
        try:
            try:
                writer.write(request)
                status_line = await reader.readline()
            except ConnectionError:
                if reused:
                    raise _Stale() from None
                raise
            if not status_line:
                if reused:
                    raise _Stale()
                raise ConnectionError("the server closed the connection without answering")
            reply.status = int(status_line.split()[1])
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                reply.headers[name.strip().lower()] = value.strip()
            if reply.headers.get("transfer-encoding", "").lower() == "chunked":
                await self._chunked(reader, reply)
            else:
                length = int(reply.headers.get("content-length", "0"))
                data = await reader.readexactly(length) if length else b""
                if data:
                    reply.first_byte_at = time.perf_counter()
                reply.tail = data[-self.tail_bytes :]
            keep = reply.headers.get("connection", "").lower() != "close"
        finally:
            if keep:
                pool.append((reader, writer))
            else:
                writer.close()

    async def _chunked(self, reader: asyncio.StreamReader, reply: Reply) -> None:
        tail = b""
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise ConnectionError("the stream ended inside a chunked body")
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()  # the empty trailer line
                break
            data = (await reader.readexactly(size + 2))[:-2]
            if reply.first_byte_at is None:
                reply.first_byte_at = time.perf_counter()
            if b'"error"' in data:
                reply.saw_error_event = True
            tail = (tail + data)[-self.tail_bytes :]
        reply.tail = tail
