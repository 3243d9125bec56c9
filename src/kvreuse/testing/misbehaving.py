"""A deliberately misbehaving OpenAI upstream, for the gateway's failure tests and the soak.

``python -m kvreuse.testing.misbehaving --port P --mode MODE`` serves ``/health`` (200),
``/v1/models`` and ``/metrics`` like an engine, and answers the generate endpoints
(``/v1/completions``, ``/v1/chat/completions``) the way ``MODE`` says:

* ``hang``: reads the request and never answers (its ``/health`` keeps passing: the replica
  whose probes say healthy while it serves nothing);
* ``huge``: a whole JSON completion of ``--bytes`` bytes (a stream asks get it too), framed by
  ``content-length`` or, with ``--chunked``, chunked;
* ``slow``: answers like ``huge`` (at its size) after ``--delay`` seconds;
* ``error``: ``500`` with a JSON error body;
* ``close``: closes the connection without a byte;
* ``midstream``: a stream that sends one SSE event and then closes the connection;
* ``silent-stream``: the headers of an SSE stream, then nothing, ever;
* ``status``: a JSON completion under the status line ``--status`` (0, 101, 999: what no proxy
  can relay);
* ``usage``: a small JSON completion whose ``usage`` object is ``--usage``'s text as given
  (``{"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 1e400}}`` is not
  expressible as a Python value, so the text is sent raw);
* ``twice``: two complete responses in answer to one request;
* ``poison``: a ``500`` for a request whose body contains ``--marker``'s bytes (a query of
  death: vLLM has had inputs that raise inside the server), a small completion for any other;
* ``killer``: as ``poison``, but the marked request also kills the server's engine: from then
  on ``/health`` answers ``503`` and every generate request ``500`` (vLLM after an
  ``EngineDeadError``);
* ``slow-health``: a small completion for every generate request, and ``/health`` answered
  after ``--delay`` seconds (a saturated vLLM, whose busy event loop answers probes late);
* ``draining``: a completion for the first generate request, which starts a drain: from then on
  ``/health`` and every generate request answer ``503`` (vLLM draining before it stops);
* ``comment-first``: an SSE stream that sends a comment (``: keep-alive``) at once, then after
  ``--delay`` seconds one completion event and ``data: [DONE]`` (a server or proxy that pings
  before its first token);
* ``error-event``: an SSE stream whose first event is an error (``data: {"error": ...}``, as
  vLLM sends when a request fails after its stream began), then ``data: [DONE]``.

Plain asyncio streams (no framework), so each misbehaviour is exactly what it says. Every
generate request is counted; ``GET /stats`` answers ``{"requests": N, "open": M, "request_ids":
[...], "marked": K}`` (M: requests whose connection is still open; the ``x-request-id``
headers received, the last 100; K: requests holding the marker), so a test can see what
reached it and what it was told to abort. Binds 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from collections.abc import Sequence

MODES = ("hang", "huge", "slow", "error", "close", "midstream", "silent-stream", "status",
         "usage", "twice", "poison", "killer", "draining", "slow-health", "comment-first",
         "error-event")
GENERATE = (b"/v1/completions", b"/v1/chat/completions")


class Misbehaving:
    """The server's state and request handling."""

    def __init__(self, mode: str, *, size: int = 2 << 20, delay_s: float = 5.0,
                 chunked: bool = False, model: str = "sim", status: int = 999,
                 usage: str = "{}", marker: str = "POISON") -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.size = size
        self.delay_s = delay_s
        self.chunked = chunked
        self.model = model
        self.status = status
        self.usage = usage
        self.marker = marker.encode()
        self.dead = False
        self.marked = 0  # generate requests holding the marker (poison and killer modes)
        self.requests = 0
        self.open = 0
        self.request_ids: list[str] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                method, path = lines[0].split(b" ")[:2]
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    name = name.strip().lower()
                    if name == b"content-length":
                        length = int(value.strip())
                    elif name == b"x-request-id" and method == b"POST":
                        self.request_ids = [*self.request_ids[-99:],
                                            value.strip().decode("latin-1")]
                body = await reader.readexactly(length) if length else b""
                if method == b"POST" and path in GENERATE:
                    if not await self._generate(reader, writer, body):
                        return
                elif path == b"/health" and self.mode == "slow-health":
                    await asyncio.sleep(self.delay_s)
                    self._answer(writer, 200, b"{}")
                elif path == b"/health" and (self.dead or (self.mode == "draining"
                                                           and self.requests > 0)):
                    self._answer(writer, 503, b'{"error": "engine dead"}')
                else:
                    self._answer(writer, 200, self._control(path))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    def _control(self, path: bytes) -> bytes:
        if path == b"/v1/models":
            return json.dumps({"object": "list", "data": [
                {"id": self.model, "object": "model", "owned_by": "misbehaving"}]}).encode()
        if path == b"/stats":
            return json.dumps({"requests": self.requests, "open": self.open,
                               "request_ids": self.request_ids,
                               "marked": self.marked}).encode()
        if path == b"/metrics":
            return b"# nothing to report\n"
        return b"{}"

    @staticmethod
    def _answer(writer: asyncio.StreamWriter, status: int, body: bytes,
                content_type: bytes = b"application/json") -> None:
        writer.write(b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
                     % (status, content_type, len(body)) + body)

    async def _generate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        body: bytes) -> bool:
        """Misbehave on one generate request; False when the connection is done."""
        self.requests += 1
        self.open += 1
        try:
            if self.mode in ("hang", "silent-stream"):
                if self.mode == "silent-stream":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n")
                await reader.read()  # until the client closes: the only way this ends
                return False
            if self.mode == "close":
                return False
            if self.mode == "draining" and self.requests > 1:
                self._answer(writer, 503, b'{"error": "draining"}')
                return True
            if self.mode in ("poison", "killer") and self.marker in body:
                self.marked += 1
                self.dead = self.dead or self.mode == "killer"
            if self.mode == "error" or self.dead or (self.mode == "poison"
                                                     and self.marker in body):
                self._answer(writer, 500, json.dumps({"error": {
                    "message": "misbehaving upstream: deliberate 500", "type": "InternalError",
                    "param": None, "code": 500}}).encode())
                return True
            if self.mode == "midstream":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                event = b'data: {"choices": [{"index": 0, "text": "partial"}]}\n\n'
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                return False
            if self.mode == "error-event":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for event in (b'data: {"error": {"message": "misbehaving upstream: '
                              b'deliberate error event", "code": 500}}\n\n',
                              b"data: [DONE]\n\n"):
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                return True
            if self.mode == "comment-first":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for event, wait in ((b": keep-alive\n\n", self.delay_s),
                                    (b'data: {"choices": [{"index": 0, "text": "ok"}]}\n\n', 0),
                                    (b"data: [DONE]\n\n", 0)):
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                    await asyncio.sleep(wait)
                writer.write(b"0\r\n\r\n")
                return True
            if self.mode in ("status", "usage", "twice", "poison", "killer", "draining",
                             "slow-health"):
                answer = (b'{"id": "cmpl-x", "object": "text_completion", "choices": [{"index": 0,'
                          b' "text": "ok", "finish_reason": "length"}], "usage": %s}'
                          % self.usage.encode())
                self._answer(writer, self.status if self.mode == "status" else 200, answer)
                if self.mode == "twice":
                    self._answer(writer, 200, b'{"second": "response"}')
                return True
            if self.mode == "slow":
                await asyncio.sleep(self.delay_s)
            await self._huge(writer)
            return True
        finally:
            self.open -= 1

    async def _huge(self, writer: asyncio.StreamWriter) -> None:
        envelope = {"id": "cmpl-huge", "object": "text_completion", "model": self.model,
                    "choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
        shell = json.dumps(envelope).encode()
        filler = max(self.size - len(shell), 0)
        before, after = shell.split(b'"text": ""')
        pieces = [before + b'"text": "', b"x" * filler, b'"' + after]
        if not self.chunked:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n" % sum(len(p) for p in pieces))
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for piece in pieces:
            for start in range(0, len(piece), 256 << 10):
                part = piece[start : start + (256 << 10)]
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
        writer.write(b"0\r\n\r\n")


async def serve(server: Misbehaving, port: int) -> None:
    listener = await asyncio.start_server(server.handle, "127.0.0.1", port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with listener:
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--bytes", type=int, default=2 << 20, help="size of huge answers")
    parser.add_argument("--delay", type=float, default=5.0, help="seconds before slow answers")
    parser.add_argument("--chunked", action="store_true", help="chunked, not content-length")
    parser.add_argument("--model", default="sim")
    parser.add_argument("--status", type=int, default=999, help="the status of 'status' mode")
    parser.add_argument("--usage", default="{}", help="the raw usage JSON of 'usage' mode")
    parser.add_argument("--marker", default="POISON",
                        help="bytes that make 'poison' mode answer a 500 ('killer': and die)")
    args = parser.parse_args(argv)
    asyncio.run(serve(Misbehaving(args.mode, size=args.bytes, delay_s=args.delay,
                                  chunked=args.chunked, model=args.model, status=args.status,
                                  usage=args.usage, marker=args.marker), args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
