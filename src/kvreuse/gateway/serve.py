"""The gateway's client-facing HTTP server: uvicorn, with the limits a server in front of real
traffic needs and uvicorn does not have.

* **Request heads in time**: a connection that has not sent a complete request head within
  ``head_timeout_s`` of opening (or of the first byte of its next request) gets a 408 and is
  closed. Between requests a keep-alive connection is idle, timed by ``idle_timeout_s`` alone,
  however its last body ended (chunk markers and the empty lines RFC 9112 lets a client send
  begin no request); bytes there that begin none are timed as a head, since any byte stops
  uvicorn's idle timer.
* **Request bodies in time**: a body must arrive whole within ``head_timeout_s`` of the end of
  its head, plus one second per MiB of it received (:data:`MIN_BODY_BYTES_PER_S`): a deadline
  for the whole body, not a timer that each byte restarts, so a client trickling a byte now
  and then is closed as surely as a silent one. The allowance per MiB is there because the
  largest body a gateway takes (``max_body_bytes``, 8 MiB by default) needs 10 s at
  6.7 Mbit/s, less than some real uplinks give; a client holding a connection by sending just
  fast enough holds it at most ``head_timeout_s + max_body_bytes / 1 MiB/s`` (18 s by
  default), since a larger body is refused (413). Past the deadline: a 408 (or, if the request
  was already answered, a plain close) and the connection is closed. Only the reading of a
  request is timed: an answer, however long it streams, never is. A request received while an
  earlier answer on its connection is under way (pipelined) is timed from that answer's end.
  Slow-loris clients therefore hold a connection for a bounded time; they still hold one
  while they do, which ``max_connections`` bounds.
* **Request heads of bounded size**: a request head (request line and headers, from its first
  byte to its blank line, counted afresh for each request of a keep-alive connection) larger
  than :data:`MAX_HEAD_BYTES` (64 KiB) gets a 431 and the connection is closed; the parser is
  never given more than that much of a head, so no head costs more memory or parsing time
  than one of 64 KiB. Real clients send well under 8 KiB (an OpenAI SDK about 1 KiB); 64 KiB
  is four times Node.js's default limit (16 KiB) and twice the total nginx allows by
  default (4 x 8 KiB), room for long bearer tokens and tracing headers. Without a cap,
  httptools joins the pieces of a header as they arrive (time quadratic in its size), on the
  event loop, which every other client waits for.
* **Idle keep-alive connections** are closed after ``idle_timeout_s`` (uvicorn's
  ``timeout_keep_alive``).
* **A connection limit** (``max_connections``): a client over it gets an immediate
  ``503`` with an OpenAI error body and ``connection: close``, and its connection is closed
  once the client has read it (never a reset, never a file-table exhaustion that makes every
  new client's accept fail).
* **Client disconnects** are reported to the request through a
  :class:`~kvreuse.gateway.asgi.DisconnectHook` in its scope, so that the gateway need not keep
  a task per request waiting on ``receive`` to learn of it.
* **The open-file limit** is raised to its hard limit at start
  (:func:`raise_open_file_limit`); the default connection limit is derived from it.

* **Malformed requests** (what the parser, llhttp, refuses: a Content-Length next to a
  Transfer-Encoding, two differing Content-Lengths, a signed or hexadecimal one, a chunk size
  past 64 bits, bare LF line endings, obs-fold, control bytes in a header, ...) get a 400 naming
  llhttp's reason, and the connection is closed: its framing can no longer be trusted, so
  nothing after the error is parsed as a next request (no smuggling). uvicorn answered these in
  ``text/plain``, logged each one (a flood of them, a line each) and closed at once, which can
  reset the connection before the client reads the answer.
* **Upgrade requests** (``Connection: upgrade``, e.g. ``Upgrade: h2c`` as ``curl --http2``
  sends on ``http://``) are served as plain HTTP/1.1, ignoring the upgrade as RFC 9110 (7.8)
  allows: the gateway switches to no other protocol. llhttp stops parsing HTTP at the end of
  such a request's head, so a body it has would have been lost (the request answered as if it
  had none) and the next request on the connection refused; the parser is replaced by a fresh
  one told the body's framing, and the connection goes on as any other.

Every refusal here (400, 408, 431, 503) has an OpenAI error body and ``connection: close``, and
is logged at most once per 10 s per kind, with the count of those held back.

**Stopping without losing a request** (:class:`GatewayServer`, :class:`Drain`). On SIGTERM
(what Kubernetes, Docker and systemd send) the gateway first *drains*: for
``drain_delay_s`` it keeps accepting and serving, ``/ready`` answers 503 ("shutting down")
and every answer carries ``connection: close``, so that load balancers and kube-proxy stop
sending it new work and keep-alive clients reconnect elsewhere, while requests that still
arrive (endpoint updates take seconds to propagate) are served instead of refused. Then the
listeners close and the requests in flight get up to ``shutdown_grace_s`` to finish. A
connection accepted before the close is one of them even while its request has not arrived
(it has the usual head and body deadlines to send it), and the connections the kernel holds in
the listeners' backlog are accepted before they close: uvicorn closed the first unanswered and
the second with a reset, the lost requests of a connection made in the drain's last moment.
Whatever still runs after that is ended readably: a stream with an SSE error event saying
the gateway is shutting down, a request not yet answered with a 503; never a connection
cut mid-answer. SIGINT (Ctrl-C) skips the drain; a second signal ends the drain at once,
a third stops waiting for requests in flight. uvicorn alone closed the listener at the
first signal (a request a moment later was refused) and waited for requests without bound.

:class:`GuardedHttpProtocol` extends uvicorn's httptools protocol (the gateway needs httptools
anyway: its upstream client parses with it); :func:`uvicorn_options` gives the keyword options
of ``uvicorn.run`` / ``uvicorn.Config`` for a gateway configuration.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import select
import signal
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any, ClassVar

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvreuse.gateway.asgi import DISCONNECT_HOOK, DisconnectHook
from kvreuse.gateway.config import GatewayConfig
from kvreuse.gateway.telemetry import ThrottledLog
from kvreuse.gateway.validation import error_body

log = logging.getLogger("kvreuse.gateway.serve")

LINGER_S = 1.0  # how long a refused connection waits for the client to read its 503
MAX_DEFAULT_CONNECTIONS = 10_000
RESERVED_FILES = 128  # for upstream pools' control connections, logs, sockets of ZeroMQ
MAX_HEAD_BYTES = 64 * 1024  # a larger request head is a 431 (see the module docstring)
MIN_BODY_BYTES_PER_S = 1 << 20  # each MiB of a body received adds 1 s to its deadline
ACCEPT_TURNS = 1000  # at most this many turns of the loop accept a backlog at the close

_HEAD_END = b"\r\n\r\n"
_HEAD = "its request head"  # (the phases a client can be late with, as the log names them)
_BODY = "its request body"


class Drain:
    """Where a gateway is in stopping: serving (``started_at`` None), draining (since
    ``started_at``, monotonic seconds), or past its grace period (``expired``: requests still
    in flight are being ended). Shared by the server, the connections' protocol and the
    gateway's ``/ready`` and forwarder."""

    __slots__ = ("expired", "started_at")

    def __init__(self) -> None:
        self.started_at: float | None = None
        self.expired = False

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def begin(self, now: float) -> None:
        if self.started_at is None:
            self.started_at = now


SHUTDOWN_MESSAGE = "the gateway is shutting down"


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What :class:`GuardedHttpProtocol` enforces."""

    max_connections: int
    head_timeout_s: float


def _raw_response(status: int, reason: str, message: str, kind: str) -> bytes:
    body = json.dumps(error_body(message, kind, status)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


# Floods of refused, too-slow or too-large clients cost a line per 10 s each, with the count
# held back.
_over_limit = ThrottledLog(log, burst=1, interval_s=10.0)
_too_slow = ThrottledLog(log, burst=1, interval_s=10.0)
_too_large = ThrottledLog(log, burst=1, interval_s=10.0)
_malformed = ThrottledLog(log, burst=1, interval_s=10.0)
_shut_out = ThrottledLog(log, burst=1, interval_s=10.0)

# A refusal waiting for the answers before it (status, reason, message, error type).
_Refusal = tuple[int, str, str, str]


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol plus head and body deadlines, a cap on the size of request
    heads and a connection limit (see the module docstring). Subclassed per server by
    :func:`protocol_class` to carry its limits."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits(MAX_DEFAULT_CONNECTIONS, 10.0)
    drain: ClassVar[Drain] = Drain()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        # What the client is late with while a request is incomplete (_HEAD, _BODY; None
        # between requests and behind an answer under way), and since when: one timer per
        # connection checks it, re-armed only when it fires, so that a request arriving
        # whole costs no timer at all.
        self._phase: str | None = None
        self._since = 0.0
        self._hook: DisconnectHook | None = None  # the current request's
        self._refused = False  # over the connection limit: never served
        self._draining = False  # answered 400, 408 or 431: reading and dropping until the close
        self._pending: _Refusal | None = None  # ... the 400 or 431 waiting for answers before it
        # An upgrade request being served as plain HTTP/1.1 (see the module docstring): its
        # body's framing, told to the fresh parser that replaces llhttp's upgraded one.
        self._unupgraded_body: bytes | None = None
        self._replaying = False  # a fresh parser reads that framing: it begins no request
        self._callback_problem: str | None = None  # what a callback refused, in words
        # What the parser is reading, whatever the answers are doing: "head" (from the end of
        # the last request, before its next one's first byte too, to on_headers_complete),
        # "body" (to on_message_complete) or "upgrade" (nothing is counted any more).
        self._reading = "head"
        self._head_bytes = 0  # of the head being read, fed to the parser
        self._head_tail = b""  # its last bytes, to find a blank line split between reads
        self._body_left: int | None = None  # of a body of declared length, not yet parsed
        self._body_bytes = 0  # of the current request's body, received
        self._body_fed = 0  # of every body on this connection (see data_received)
        self._messages = 0  # requests completely read on this connection
        self._begun = 0  # requests whose first byte was parsed (one more while one is read)

    # ------------------------------------------------------------------ connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self._refuse(transport)
            return
        super().connection_made(transport)
        self._start(_HEAD)
        self._arm(self.limits.head_timeout_s)

    def _refuse(self, transport: asyncio.Transport) -> None:
        """Answer 503 at once, half-close, and close when the client has read it (its EOF)
        or after :data:`LINGER_S`: closing with its request unread would reset the
        connection and could destroy the answer before the client reads it."""
        self._refused = True
        self.transport = transport
        limit = self.limits.max_connections
        _over_limit.warning("refused a connection: %d client connections are open "
                            "(--max-connections)", limit)
        self._say_last(transport, _raw_response(
            503, "Service Unavailable",
            f"the gateway has its maximum of {limit} client connections open; retry later",
            "ServiceUnavailable"))

    def data_received(self, data: bytes) -> None:
        """Feed ``data`` to the parser in pieces that end where a head or a body of declared
        length ends (see :meth:`_cut`), so that the bytes of each head are counted exactly
        and the parser never holds more than :data:`MAX_HEAD_BYTES` of one."""
        if self._refused or self._draining:
            return  # read and dropped, so that the close is a clean one
        start, end = 0, len(data)
        while start < end:
            stop = self._cut(data, start, end)
            piece = data if stop - start == end else data[start:stop]
            in_body, body_fed, messages = self._reading == "body", self._body_fed, self._messages
            self._feed(piece)
            if self.transport.is_closing() or self._reading == "upgrade" or self._draining:
                return  # refused as malformed (400), or upgraded (the rest is not HTTP)
            start = stop
            if self._reading == "body":
                continue
            if self._messages == messages:  # no request ended: the piece was all head
                self._head_bytes += len(piece)
            elif self._begun == self._messages:  # a request ended it: no next head yet
                self._head_bytes = 0
            elif in_body:  # a body ended in it: what followed it is the next head
                # (exact for a declared length; a chunked body's framing in this piece is
                # counted too when the next request began in it)
                self._head_bytes = len(piece) - (self._body_fed - body_fed)
            else:  # the piece ended where the head of a request without a body ends
                self._head_bytes = 0
            self._head_tail = piece[-3:] if self._head_bytes else b""
            if self._head_bytes >= MAX_HEAD_BYTES:
                self._head_too_large()
                return
        if (self._phase is None and self._reading == "head" and self._begun == self._messages
                and (self.cycle is None or self.cycle.response_complete)):
            # Bytes on an idle connection that begin no request (empty lines): uvicorn's idle
            # timer stops at any byte, so they are timed as a head, or a client sending one
            # now and then would hold the connection for ever.
            self._start(_HEAD)
        if self._phase is not None and self._timer is None:
            self._arm(self.limits.head_timeout_s)

    def _feed(self, piece: bytes) -> None:
        """uvicorn's ``data_received`` for one piece, but with malformed requests refused as
        :meth:`_refuse_malformed` says and upgrades other than uvicorn's WebSocket ignored."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(piece)
        except httptools.HttpParserUpgrade as upgrade:
            if self._reading == "upgrade":  # a WebSocket, which uvicorn serves itself
                self.handle_websocket_upgrade()
                return
            self._resume_plain_http(piece[int(upgrade.args[0]):])
        except httptools.HttpParserError as exc:
            problem, self._callback_problem = self._callback_problem, None
            self._refuse_malformed(problem or str(exc) or type(exc).__name__)

    def _resume_plain_http(self, rest: bytes) -> None:
        """llhttp has stopped at the end of an upgrade request's head, its body (if any) skipped
        as the start of another protocol: parse on with a fresh parser, first told the body's
        framing by a head that begins no request, then given what followed."""
        self.parser = parser = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # (as uvicorn: httptools >= 0.6.3)
            parser.set_dangerous_leniencies(lenient_data_after_close=True)
        framing, self._unupgraded_body = self._unupgraded_body, None
        if framing is not None:
            url, headers = self.url, self.headers  # the request's, which the replay must keep
            self._replaying, self.headers = True, []
            try:
                parser.feed_data(b"POST / HTTP/1.1\r\n%s\r\n\r\n" % framing)
            finally:
                self._replaying, self.url, self.headers = False, url, headers
        if rest:
            self._feed(rest)

    def _refuse_malformed(self, reason: str) -> None:
        """llhttp refused what the client sent (``reason``): answer 400 and close, at once or,
        behind answers under way (pipelined), after them; nothing more is parsed."""
        self._phase = None
        self._disarm()
        self._draining = True
        _malformed.warning("refused a malformed request (400) and closed the connection: %s",
                           reason)
        answer = (400, "Bad Request", f"malformed HTTP/1.1 request: {reason}; the connection "
                  "is closed", "BadRequestError")
        cycle = self.cycle
        if self._reading == "body" and cycle is not None and not cycle.response_complete:
            # Its own body is malformed: the request is never served.
            queued = next((entry for entry in self.pipeline if entry[0] is cycle), None)
            if queued is not None:
                self.pipeline.remove(queued)
            elif cycle.response_started:
                self.transport.close()  # answered early already: nothing else can be said
                return
            else:
                cycle.disconnected = True  # the app sees the client gone; its answer dropped
                cycle.message_event.set()
        if self.pipeline or (cycle is not None and not cycle.response_complete
                             and not cycle.disconnected):
            self._pending = answer
            return
        self._answer_and_close(*answer)

    def _cut(self, data: bytes, start: int, end: int) -> int:
        """Where the next piece of ``data[start:end]`` for the parser ends: at the blank line
        that ends a head, at the end of a body of declared length, and never past what the
        head being read may still take."""
        if self._reading == "upgrade":
            return end
        if self._reading == "body":
            if self._body_left is not None and self._body_left > 0:
                return min(end, start + self._body_left)
            return min(end, start + MAX_HEAD_BYTES)  # chunked: the next head may follow
        limit = min(end, start + MAX_HEAD_BYTES - self._head_bytes)
        if self._head_tail:
            found = (self._head_tail + data[start:start + 3]).find(_HEAD_END)
            if found >= 0:
                return min(limit, start + found + len(_HEAD_END) - len(self._head_tail))
        found = data.find(_HEAD_END, start, limit)
        return limit if found < 0 else found + len(_HEAD_END)

    def eof_received(self) -> bool | None:  # type: ignore[override]
        if self._refused or self._draining:
            self.transport.close()
            return None
        super().eof_received()
        return None

    def shutdown(self) -> None:
        """Called by uvicorn on each open connection when the listeners close, and by
        :class:`GatewayServer` again when the grace period is over. A connection accepted
        before the close whose request has not arrived, or arrived only in part, is a request
        in flight like any other: it is left open to be served (its answer says connection:
        close) within the usual head and body deadlines, where uvicorn closed it unanswered.
        Past the grace period it is answered 503 instead. An idle keep-alive connection that
        has been served is closed, as HTTP allows any server to."""
        if self._refused or self._draining:
            return  # answering and closing already
        if self._begun > self._messages or (self.cycle is None and self._begun == 0):
            if self.drain.expired:
                self._phase = None
                self._disarm()
                _shut_out.warning("closed a client connection whose request had not arrived "
                                  "by the end of the grace period (503)")
                self._answer_and_close(503, "Service Unavailable", SHUTDOWN_MESSAGE,
                                       "ServiceUnavailable")
            return
        super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._refused:
            return
        super().connection_lost(exc)
        if self._hook is not None:
            self._hook.fire()

    # ------------------------------------------------------------------ the request's pace

    def on_message_begin(self) -> None:
        if self._replaying:
            return
        super().on_message_begin()
        self._begun += 1
        if self._phase is None:  # (a first request's head is timed from the connection)
            self._retime()

    def on_headers_complete(self) -> None:
        if self._replaying:
            return
        # The request's disconnect hook: spares the app a task per request watching receive.
        hook = self._hook = DisconnectHook()
        extensions = self.scope.setdefault("extensions", {})
        extensions[DISCONNECT_HOOK] = {"hook": hook}  # ASGI extensions are dicts
        try:
            super().on_headers_complete()
        except httptools.HttpParserInvalidURLError:
            # llhttp reports an exception in a callback as "User callback error": name it.
            self._callback_problem = ("the request target is not a URL this server serves "
                                      "(an origin-form path such as /v1/completions; CONNECT "
                                      "and malformed absolute URLs are refused)")
            raise
        self._head_bytes, self._head_tail, self._body_bytes = 0, b"", 0
        if self.drain.draining:  # the answer says connection: close; the client goes elsewhere
            self.cycle.keep_alive = False
        if self.parser.should_upgrade() and self._should_upgrade():
            self._reading, self._phase = "upgrade", None
            return
        self._reading = "body"
        self._body_left = self._declared_length()
        if self.parser.should_upgrade():  # served as plain HTTP/1.1 (see _resume_plain_http)
            self._unupgraded_body = (
                b"transfer-encoding: chunked" if self._body_left is None else
                b"content-length: %d" % self._body_left if self._body_left else None)
        self._retime()

    def _declared_length(self) -> int | None:
        """The request's content-length (0 without one); None for a chunked body."""
        length = 0
        for name, value in self.headers:
            if name == b"transfer-encoding":
                return None
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    return None
        return length

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        size = len(body)
        self._body_bytes += size
        self._body_fed += size
        if self._body_left is not None:
            self._body_left -= size

    def on_message_complete(self) -> None:
        if self._unupgraded_body is not None:
            return  # llhttp skipping an upgrade request's body: it is still to be read
        self._reading, self._phase = "head", None
        self._messages += 1
        super().on_message_complete()

    def on_response_complete(self) -> None:
        started_next = bool(self.pipeline)
        super().on_response_complete()  # (starts the next pipelined request, if any)
        if self.transport.is_closing():
            return
        if self._pending is not None:
            if not started_next:  # the answer that just ended was the last one under way
                answer, self._pending = self._pending, None
                self._answer_and_close(*answer)
            return
        if self._draining:
            return
        # What arrived behind this answer (the start of the next request, or the rest of
        # this request's body, answered early) is timed from now. Nothing of a next head yet:
        # the connection is idle, which the idle timeout governs; the head timer starts at
        # its first byte (on_message_begin). Timing the idle wait as a head sent pooled
        # clients an unsolicited 408 that raced their next request, which was lost. Whether
        # a next request has begun is the parser's word, not a count of bytes: a chunked
        # body's last chunk markers and the empty lines a client may send between requests
        # are no request.
        self._phase = None
        if self._begun > self._messages:
            self._retime()
        if self._phase is not None and self._timer is None:
            self._arm(self.limits.head_timeout_s)

    def _retime(self) -> None:
        """Time what the parser is reading, unless it waits behind an answer under way
        (pipelined): a head when every answer is complete, a body when its own request is
        being served (none queued before it)."""
        if self._reading == "head" and (self.cycle is None or self.cycle.response_complete):
            self._start(_HEAD)
        elif self._reading == "body" and not self.pipeline:
            self._start(_BODY)
        else:
            self._phase = None

    def _start(self, phase: str) -> None:
        self._phase = phase
        self._since = self.loop.time()

    def _arm(self, delay_s: float) -> None:
        self._timer = self.loop.call_later(delay_s, self._check)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _allowed_s(self) -> float:
        """How long the current phase may take: ``head_timeout_s``, and for a body not yet
        answered one second more per :data:`MIN_BODY_BYTES_PER_S` received."""
        allowed = self.limits.head_timeout_s
        if self._phase == _BODY and not (self.cycle is not None and self.cycle.response_started):
            allowed += self._body_bytes / MIN_BODY_BYTES_PER_S
        return allowed

    def _check(self) -> None:
        """The timer fired: 408 when the current phase has outlasted its deadline, else wait
        for what is left of it (or for nothing, between requests)."""
        self._timer = None
        if self._phase is None:
            return
        left = self._since + self._allowed_s() - self.loop.time()
        if left > 0.001:
            self._arm(left)
            return
        self._too_slow(self._phase)

    def _too_slow(self, phase: str) -> None:
        allowed = self._allowed_s()
        self._phase = None
        if self.transport is None or self.transport.is_closing():
            return
        seconds = f"{allowed:.3g}"
        _too_slow.warning("closed a client connection that did not send %s within %s s",
                          phase, seconds)
        cycle = self.cycle
        if cycle is not None and cycle.response_started and (
                phase == _BODY or not cycle.response_complete):
            # Its request already has an answer (or one is under way): nothing else can be
            # said on this connection.
            self.transport.close()
            return
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app sees the client gone; its answer is dropped
            cycle.message_event.set()
        what = "body" if phase == _BODY else "head"
        self._answer_and_close(408, "Request Timeout",
                               f"the request did not arrive in time: no complete {what} "
                               f"within {seconds} s", "RequestTimeout")

    def _head_too_large(self) -> None:
        """The head being read is over :data:`MAX_HEAD_BYTES`: stop reading the connection
        and answer 431, at once or, behind answers under way (pipelined), after them."""
        self._phase = None
        self._disarm()
        self._draining = True  # what else the client sends is dropped, never parsed
        _too_large.warning("refused a request head over %d bytes (431) and closed the "
                           "connection", MAX_HEAD_BYTES)
        answer = (431, "Request Header Fields Too Large",
                  f"the request head (request line and headers) is larger than "
                  f"{MAX_HEAD_BYTES} bytes", "RequestHeaderFieldsTooLarge")
        if self.pipeline or (self.cycle is not None and not self.cycle.response_complete):
            self._pending = answer
            return
        self._answer_and_close(*answer)

    def _answer_and_close(self, status: int, reason: str, message: str, kind: str) -> None:
        """As for a refused connection: answer, half-close, drop what still comes, close when
        the client has read it, so that no reset destroys the answer."""
        self._draining = True
        self._say_last(self.transport, _raw_response(status, reason, message, kind))

    def _say_last(self, transport: asyncio.Transport, answer: bytes) -> None:
        """Write ``answer``, half-close, and close when the client has read it (its EOF) or
        after :data:`LINGER_S`; at once if the client is gone already (ENOTCONN)."""
        transport.write(answer)
        try:
            if transport.can_write_eof():
                transport.write_eof()
        except OSError:  # nobody left to answer
            transport.close()
            return
        self.loop.call_later(LINGER_S, transport.close)


def protocol_class(limits: ConnectionLimits, drain: Drain | None = None
                   ) -> type[GuardedHttpProtocol]:
    """A :class:`GuardedHttpProtocol` enforcing ``limits`` and closing each connection after
    its answer once ``drain`` has begun (uvicorn takes a class)."""
    return type("GatewayHttpProtocol", (GuardedHttpProtocol,),
                {"limits": limits, "drain": drain if drain is not None else Drain()})


class GatewayServer(uvicorn.Server):
    """uvicorn's server with the gateway's way of stopping (the module docstring): a drain of
    ``drain_delay_s`` on SIGTERM, then up to ``shutdown_grace_s`` for requests in flight,
    then ``drain.expired`` and the requests still running cancelled, which the forwarder
    turns into readable endings."""

    def __init__(self, config: uvicorn.Config, drain: Drain, *, drain_delay_s: float,
                 shutdown_grace_s: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.drain_delay_s = drain_delay_s
        self.shutdown_grace_s = shutdown_grace_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:  # a signal while requests in flight are waited for: stop waiting
            self._captured_signals.append(sig)
            self.force_exit = True
            return
        if self.drain.draining or sig != signal.SIGTERM or self.drain_delay_s <= 0:
            super().handle_exit(sig, frame)  # closes the listeners at the next tick
            self.drain.begin(time.monotonic())
            return
        self._captured_signals.append(sig)
        self.drain.begin(time.monotonic())
        log.warning("SIGTERM: draining for %g s (/ready answers 503, every answer closes its "
                    "connection), then the listeners close and requests in flight get %g s",
                    self.drain_delay_s, self.shutdown_grace_s)

    async def on_tick(self, counter: int) -> bool:
        started = self.drain.started_at
        if (started is not None and not self.should_exit
                and time.monotonic() - started >= self.drain_delay_s):
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        """Accept what the kernel has queued on the listeners, then close them as uvicorn
        does (see :meth:`_accept_queued`)."""
        await self._accept_queued()
        await super().shutdown(sockets)

    async def _accept_queued(self) -> None:
        """Let the event loop accept the connections the kernel completed before the
        listeners close: closing a listener resets every connection still in its backlog,
        and a client that connected during the drain (its request sent, maybe) would read a
        reset. Each connection the loop accepts becomes one of the connections
        :meth:`GuardedHttpProtocol.shutdown` keeps open for its request. A connection made
        between the last accept and the close is still reset: that window is one turn of the
        event loop, where it was everything that waited for the loop before."""
        listeners = [sock.fileno() for server in self.servers for sock in server.sockets]
        poller = select.poll()
        for fd in listeners:
            poller.register(fd, select.POLLIN)
        for _ in range(ACCEPT_TURNS):
            if not poller.poll(0):
                break
            await asyncio.sleep(0)  # a turn of the loop: it polls the listeners and accepts
        for _ in range(3):  # accepted -> transport made -> connection_made: a turn each
            await asyncio.sleep(0)

    async def _wait_tasks_to_complete(self) -> None:
        in_flight = len(self.server_state.tasks)
        if in_flight:
            log.warning("listeners closed: waiting up to %g s for %d requests in flight",
                        self.shutdown_grace_s, in_flight)
        try:
            async with asyncio.timeout(self.shutdown_grace_s):
                await super()._wait_tasks_to_complete()
            return
        except TimeoutError:
            pass
        tasks = list(self.server_state.tasks)
        log.warning("grace period of %g s over: ending %d requests still in flight (streams "
                    "get an SSE error event, requests not yet answered a 503)",
                    self.shutdown_grace_s, len(tasks))
        self.drain.expired = True
        for task in tasks:
            task.cancel(msg=SHUTDOWN_MESSAGE)
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        for connection in list(self.server_state.connections):
            connection.shutdown()


def raise_open_file_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit (every client and upstream
    connection is a file); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target,
                        exc)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_limit(config: GatewayConfig, open_files: int) -> int:
    """``config.max_connections``, or (unset) half the open files left after a reserve, the
    other half being for upstream connections; at most :data:`MAX_DEFAULT_CONNECTIONS`."""
    if config.max_connections is not None:
        if config.max_connections > open_files - RESERVED_FILES:
            log.warning("--max-connections %d is over what the open-file limit (%d) allows; "
                        "clients past it will see failed accepts", config.max_connections,
                        open_files)
        return config.max_connections
    return max(16, min(MAX_DEFAULT_CONNECTIONS, (open_files - RESERVED_FILES) // 2))


def uvicorn_options(config: GatewayConfig, open_files: int | None = None,
                    drain: Drain | None = None) -> dict[str, Any]:
    """``uvicorn.Config`` keyword options enforcing ``config``'s client-side limits (and,
    with the gateway's ``drain``, closing connections while it drains)."""
    files = open_files if open_files is not None else resource.getrlimit(
        resource.RLIMIT_NOFILE)[0]
    limits = ConnectionLimits(connection_limit(config, files), config.head_timeout_s)
    return {"http": protocol_class(limits, drain), "timeout_keep_alive": config.idle_timeout_s,
            "backlog": max(2048, min(limits.max_connections, 65535))}
