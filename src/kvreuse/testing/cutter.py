"""A proxy that cuts streams: an engine that dies mid-answer, on demand, in front of a real one.

``CuttingProxy(target_url, cut_after=3)`` forwards every request to ``target_url`` (one request
per connection) and relays the answer; a streamed generate request's answer is cut after its
``cut_after``-th SSE event (and, with ``half=True``, the first half of the next event): the
connection is closed without the chunked body's end, as when the engine's process is killed.
Control requests (models, health, metrics) pass whole, so the gateway keeps the upstream
admitted. Every generate body it forwarded is kept in ``bodies``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any
from urllib.parse import urlsplit

GENERATE_PATHS = (b"/v1/completions", b"/v1/chat/completions")


class CuttingProxy:
    """``with CuttingProxy(engine_url, cut_after=2) as proxy: ... proxy.url ...``"""

    def __init__(self, target_url: str, *, cut_after: int, half: bool = False,
                 error_event: bool = False) -> None:
        """``error_event``: end the stream at the cut as vLLM does when its engine dies under a
        live API server (an error event, ``[DONE]``, the chunked body's proper end) instead of
        closing the connection."""
        parts = urlsplit(target_url)
        assert parts.hostname is not None and parts.port is not None, target_url
        self._target = (parts.hostname, parts.port)
        self.cut_after = cut_after
        self.half = half
        self.error_event = error_event
        self.bodies: list[dict[str, Any]] = []
        self.cuts = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="cutting-proxy")
        self.url = ""

    def __enter__(self) -> CuttingProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop).result(10)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            current = asyncio.current_task()
            # Connections still open are closed, not left pending; a connection accepted just
            # before the close starts its handler a loop turn later, so look again.
            for _ in range(10):
                await asyncio.sleep(0)
                pending = [task for task in asyncio.all_tasks() if task is not current]
                if not pending:
                    break
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            method, path = lines[0].split(b" ")[:2]
            length = 0
            kept = [lines[0]]
            for line in lines[1:]:
                name = line.partition(b":")[0].strip().lower()
                if name == b"content-length":
                    length = int(line.partition(b":")[2])
                if name not in (b"connection", b"keep-alive") and line:
                    kept.append(line)
            body = await reader.readexactly(length) if length else b""
            streamed = False
            if method == b"POST" and path.rstrip(b"/") in GENERATE_PATHS:
                decoded = json.loads(body)
                self.bodies.append(decoded)
                streamed = decoded.get("stream") is True
            up_reader, up_writer = await asyncio.open_connection(*self._target)
            up_writer.write(b"\r\n".join([*kept, b"connection: close", b"", b""]) + body)
            await up_writer.drain()
            await self._relay(up_reader, writer, streamed)
            up_writer.close()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    async def _relay(self, upstream: asyncio.StreamReader, client: asyncio.StreamWriter,
                     streamed: bool) -> None:
        """Relay everything, or cut a stream after ``cut_after`` events."""
        seen = b""
        while True:
            data = await upstream.read(65536)
            if not data:
                client.write(seen)  # a stream shorter than the cut: relayed whole
                await client.drain()
                return
            if not streamed:
                client.write(data)
                await client.drain()
                continue
            seen += data
            cut = self._cut_point(seen)
            if cut is not None:
                client.write(seen[:cut])
                if self.error_event:
                    event = (b'data: {"error": {"message": "EngineCore encountered an issue",'
                             b' "type": "BadRequestError", "param": null, "code": 400}}\n\n'
                             b"data: [DONE]\n\n")
                    client.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
                await client.drain()
                self.cuts += 1
                return
            # Hold everything until the cut is known: offsets count from the first byte.

    def _cut_point(self, seen: bytes) -> int | None:
        """Where to cut ``seen`` (the raw response so far), once it holds enough events."""
        start = seen.find(b"\r\n\r\n")
        if start < 0:
            return None
        position = start + 4
        for _ in range(self.cut_after):
            event = _next_event(seen, position)
            if event is None:
                return None
            position = event[1]
        if not self.half:
            chunk_end = seen.find(b"\r\n", position)  # the HTTP chunk's trailing CRLF
            return chunk_end + 2 if chunk_end >= 0 else None
        following = _next_event(seen, position)
        if following is None:
            return None
        return following[0] + (following[1] - following[0]) // 2


def _next_event(seen: bytes, position: int) -> tuple[int, int] | None:
    """(start, end after its blank line) of the first whole SSE event at or after
    ``position``, or None while it has not all arrived."""
    found = seen.find(b"data:", position)
    if found < 0:
        return None
    end = seen.find(b"\n\n", found)
    return None if end < 0 else (found, end + 2)
