"""A minimal HTTP/1.1 client on asyncio streams, for load generation only.

Why not httpx here: on this project's two-core machines httpx costs about 5 ms of CPU per
streamed request (its connection pool scans every connection per request), so a Python client
at 200 req/s would take a whole core from the very servers it measures. This client does one
thing: POST a body with keep-alive, read a chunked, sized or close-delimited answer, note when
the first body byte arrived. About 0.3 ms of CPU per request. Not a general HTTP client: no TLS,
redirects, proxies, or compression.

A target may be anything (``kvreuse replay`` points it at whatever the user names), so whatever
comes back is read in pieces: at most ``tail_bytes`` of a body and ``MAX_HEAD_BYTES`` of headers
are held, and a peer that does not speak HTTP is an error on that request, not a traceback.
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


MAX_HEAD_BYTES = 256 * 1024
"""An answer's status line and headers together; more is refused (as the gateway refuses an
upstream's)."""

READ_BYTES = 1 << 16
"""Largest piece of a body read at once."""


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
            reply.status = _status(status_line)
            head_bytes = len(status_line)
            while True:
                line = await reader.readline()
                head_bytes += len(line)
                if head_bytes > MAX_HEAD_BYTES:
                    raise ConnectionError(f"the answer's headers exceed {MAX_HEAD_BYTES:,} bytes")
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                reply.headers[name.strip().lower()] = value.strip()
            keep = reply.headers.get("connection", "").lower() != "close"
            if reply.headers.get("transfer-encoding", "").lower() == "chunked":
                await self._chunked(reader, reply)
            elif "content-length" in reply.headers:
                await self._sized(reader, reply, _length(reply.headers["content-length"]))
            elif reply.status in (204, 304) or reply.status < 200:
                pass  # no body by definition (RFC 9112 6.3)
            else:  # neither length nor chunks: the body ends when the server closes
                keep = False
                await self._sized(reader, reply, None)
        finally:
            if keep:
                pool.append((reader, writer))
            else:
                writer.close()

    async def _sized(self, reader: asyncio.StreamReader, reply: Reply,
                     length: int | None) -> None:
        """A body of ``length`` bytes (None: until the server closes), read in pieces; the
        first piece's arrival is the first byte's."""
        tail = b""
        left = length
        while left is None or left > 0:
            data = await reader.read(READ_BYTES if left is None else min(left, READ_BYTES))
            if not data:
                if left is None:
                    break
                raise ConnectionError(f"the answer broke off {left:,} bytes short of its "
                                      "Content-Length")
            if reply.first_byte_at is None:
                reply.first_byte_at = time.perf_counter()
            if left is not None:
                left -= len(data)
            reply.tail = tail = (tail + data)[-self.tail_bytes :]

    async def _chunked(self, reader: asyncio.StreamReader, reply: Reply) -> None:
        tail = b""
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise ConnectionError("the stream ended inside a chunked body")
            size = _length(size_line.split(b";")[0].strip() or b"0", base=16)
            if size == 0:
                await reader.readline()  # the empty trailer line
                break
            while size > 0:  # in pieces: a chunk may claim any size
                data = await reader.read(min(size, READ_BYTES))
                if not data:
                    raise ConnectionError("the stream ended inside a chunk")
                size -= len(data)
                if reply.first_byte_at is None:
                    reply.first_byte_at = time.perf_counter()
                if b'"error"' in data:
                    reply.saw_error_event = True
                # Kept as it comes: what arrived before a timeout or a break stays readable.
                reply.tail = tail = (tail + data)[-self.tail_bytes :]
            if await reader.readexactly(2) != b"\r\n":
                raise ConnectionError("a chunk does not end with CRLF")


def _status(line: bytes) -> int:
    """The status code of an HTTP/1.x status line; ConnectionError naming what came instead."""
    fields = line.split(None, 2)
    if len(fields) < 2 or not fields[0].startswith(b"HTTP/") or not fields[1].isdigit() \
            or not 100 <= int(fields[1]) <= 999:
        shown = line[:80].decode("latin-1").strip()
        raise ConnectionError(f"not an HTTP answer: {shown!r}")
    return int(fields[1])


def _length(text: str | bytes, base: int = 10) -> int:
    """A Content-Length (decimal) or chunk size (hex); ConnectionError when it is not one, or
    is more than 16 digits (no body a test sends or reads is that large)."""
    raw = (text.decode("latin-1") if isinstance(text, bytes) else text).strip()
    allowed = "0123456789abcdefABCDEF" if base == 16 else "0123456789"
    if not raw or len(raw) > 16 or any(c not in allowed for c in raw):
        raise ConnectionError(f"not a body length: {raw[:40]!r}")
    return int(raw, base)
