"""One client request on the generate endpoints: its id, and the reply that answers it.

**Request id.** Every request gets one: the caller's ``x-request-id`` when it is a sane token
(1-128 printable ASCII characters, no spaces), else a fresh one (``gw-`` + a per-process random
prefix + a counter). It is sent upstream in ``x-request-id`` (vLLM takes it as its request id),
returned to the client in ``x-request-id`` on every answer, errors included, and it names the
request in every log line about it. This module is the one place that reads, makes and writes
it. What else travels with a request, its trace context and its access-log record, is
:mod:`kvreuse.gateway.telemetry`'s; the reply marks the record's first byte as it sends it.

**Reply.** :class:`ClientReply` wraps the ASGI ``send`` of one request: it adds the id header
and remembers how far the answer got, so that whatever goes wrong, the gateway can still give
the client a readable failure (:meth:`ClientReply.fail`): an OpenAI error body before the first
byte, an SSE error event after it.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import secrets
from collections.abc import Iterable
from typing import Any

from kvreuse.gateway.asgi import Message, Send
from kvreuse.gateway.telemetry import RequestRecord
from kvreuse.gateway.validation import error_body

REQUEST_ID_HEADER = b"x-request-id"
_SANE_ID = re.compile(rb"[\x21-\x7e]{1,128}")
_PREFIX = "gw-" + secrets.token_hex(4) + "-"
_counter = itertools.count(1)

log = logging.getLogger("kvreuse.gateway")


def request_id_of(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The caller's ``x-request-id`` when sane, else a new id unique to this process. O(headers)."""
    for name, value in headers:
        if name == REQUEST_ID_HEADER:
            if _SANE_ID.fullmatch(value):
                return value.decode("ascii")
            break
    return f"{_PREFIX}{next(_counter)}"


def sse_error_event(message: str, kind: str = "upstream_error", status: int = 502) -> bytes:
    """An SSE ``data:`` event carrying an OpenAI error, then ``data: [DONE]``: how a stream
    that already started says it failed."""
    return (b"data: " + json.dumps(error_body(message, kind, status)).encode()
            + b"\n\ndata: [DONE]\n\n")


class ClientReply:
    """The answer to one request: :meth:`send` is the ASGI send with the request id added;
    :attr:`started` and :attr:`complete` say how far it got. ``record``, when given, learns
    when the answer's first byte goes out (its TTFT), whichever path answers."""

    __slots__ = ("_headers", "_id_header", "_send", "complete", "record", "request_id",
                 "started", "status")

    def __init__(self, send: Send, request_id: str, record: RequestRecord | None = None
                 ) -> None:
        self._send = send
        self.record = record
        self.request_id = request_id
        self._id_header = (REQUEST_ID_HEADER, request_id.encode("ascii"))
        self.started = False
        self.complete = False
        self.status = 0
        self._headers: list[tuple[bytes, bytes]] = []

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            headers.append(self._id_header)
            message["headers"] = headers
            self.started = True
            self.status = message["status"]
            self._headers = headers
            if self.record is not None:
                self.record.sent_first_byte()
        elif not message.get("more_body", False):
            self.complete = True
        await self._send(message)

    @property
    def event_stream(self) -> bool:
        """Whether the answer under way is an SSE stream (its content type says so)."""
        return any(name == b"content-type" and b"event-stream" in value
                   for name, value in self._headers)

    async def json(self, status: int, value: Any,
                   headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        """A whole JSON answer."""
        body = json.dumps(value).encode()
        await self.send({"type": "http.response.start", "status": status, "headers": [
            (b"content-length", b"%d" % len(body)), (b"content-type", b"application/json"),
            *headers]})
        await self.send({"type": "http.response.body", "body": body})

    async def fail(self, status: int, message: str, kind: str) -> None:
        """Tell the client the request failed, however far the answer got: a JSON error
        before the first byte, an SSE error event inside a started stream. (A started whole
        answer cannot be amended; the server closes its connection.)"""
        if not self.started:
            await self.json(status, error_body(message, kind, status))
        elif not self.complete and self.event_stream:
            await self.send({"type": "http.response.body", "more_body": False,
                             "body": sse_error_event(message, kind, status)})
