"""The gateway's client-facing HTTP server: uvicorn, with the limits a server in front of real
traffic needs and uvicorn does not have.

* **Request heads in time**: a connection that has not sent a complete request head within
  ``head_timeout_s`` of opening (or of the first byte of its next request) gets a 408 and is
  closed; so does a request whose body stops arriving for as long. Slow-loris clients cannot
  hold connections.
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

:class:`GuardedHttpProtocol` extends uvicorn's httptools protocol (the gateway needs httptools
anyway: its upstream client parses with it); :func:`uvicorn_options` gives the keyword options
of ``uvicorn.run`` / ``uvicorn.Config`` for a gateway configuration.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvreuse.gateway.asgi import DISCONNECT_HOOK, DisconnectHook
from kvreuse.gateway.config import GatewayConfig
from kvreuse.gateway.telemetry import ThrottledLog
from kvreuse.gateway.validation import error_body

log = logging.getLogger("kvreuse.gateway.serve")

LINGER_S = 1.0  # how long a refused connection waits for the client to read its 503
MAX_DEFAULT_CONNECTIONS = 10_000
RESERVED_FILES = 128  # for upstream pools' control connections, logs, sockets of ZeroMQ


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What :class:`GuardedHttpProtocol` enforces."""

    max_connections: int
    head_timeout_s: float


def _raw_response(status: int, reason: str, message: str, kind: str) -> bytes:
    body = json.dumps(error_body(message, kind, status)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


# Floods of refused or too-slow clients cost a line per 10 s each, with the count held back.
_over_limit = ThrottledLog(log, burst=1, interval_s=10.0)
_too_slow = ThrottledLog(log, burst=1, interval_s=10.0)


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol plus a head/body timeout and a connection limit (see the
    module docstring). Subclassed per server by :func:`protocol_class` to carry its limits."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits(MAX_DEFAULT_CONNECTIONS, 10.0)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        # What the client is late with while a request is incomplete ("its request head",
        # "its request body"; None between requests), and since when: one timer per
        # connection checks it, re-armed only when it fires, so that a request arriving
        # whole costs no timer at all.
        self._phase: str | None = None
        self._since = 0.0
        self._hook: DisconnectHook | None = None  # the current request's
        self._refused = False  # over the connection limit: never served
        self._draining = False  # answered 408: reading and dropping until the close

    # ------------------------------------------------------------------ connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self._refuse(transport)
            return
        super().connection_made(transport)
        self._start("its request head")
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
        transport.write(_raw_response(
            503, "Service Unavailable",
            f"the gateway has its maximum of {limit} client connections open; retry later",
            "ServiceUnavailable"))
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if self._refused or self._draining:
            return  # read and dropped, so that the close is a clean one
        super().data_received(data)
        if self._phase is not None and self._timer is None:
            self._arm(self.limits.head_timeout_s)

    def eof_received(self) -> bool | None:  # type: ignore[override]
        if self._refused or self._draining:
            self.transport.close()
            return None
        super().eof_received()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._refused:
            return
        super().connection_lost(exc)
        if self._hook is not None:
            self._hook.fire()

    # ------------------------------------------------------------------ the request's pace

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._phase is None:  # (a first request's head is timed from the connection)
            cycle = self.cycle
            if cycle is None or cycle.response_complete:  # not behind an answer under way
                self._start("its request head")

    def on_headers_complete(self) -> None:
        # The request's disconnect hook: spares the app a task per request watching receive.
        hook = self._hook = DisconnectHook()
        extensions = self.scope.setdefault("extensions", {})
        extensions[DISCONNECT_HOOK] = {"hook": hook}  # ASGI extensions are dicts
        super().on_headers_complete()
        if self.parser.should_upgrade():
            self._phase = None
        else:
            self._start("its request body")

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._since = self.loop.time()  # progress: the body's clock restarts

    def on_message_complete(self) -> None:
        self._phase = None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._phase = None  # answered before its body was all read (a 413): no 408 after
        super().on_response_complete()

    def _start(self, phase: str) -> None:
        self._phase = phase
        self._since = self.loop.time()

    def _arm(self, delay_s: float) -> None:
        self._timer = self.loop.call_later(delay_s, self._check)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        """The timer fired: 408 when the current phase has outlasted the timeout, else wait
        for what is left of it (or for nothing, between requests)."""
        self._timer = None
        if self._phase is None:
            return
        left = self._since + self.limits.head_timeout_s - self.loop.time()
        if left > 0.001:
            self._arm(left)
            return
        self._too_slow(self._phase)

    def _too_slow(self, what: str) -> None:
        self._phase = None
        if self.transport is None or self.transport.is_closing():
            return
        seconds = f"{self.limits.head_timeout_s:g}"
        _too_slow.warning("closed a client connection that did not send %s within %s s",
                          what, seconds)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and cycle.response_started:
            self.transport.close()  # an answer is under way: nothing else can be said
            return
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app sees the client gone; its answer is dropped
            cycle.message_event.set()
        # As for a refused connection: answer, half-close, drop what still comes, close when
        # the client has read it, so that no reset destroys the answer.
        self._draining = True
        self.transport.write(_raw_response(
            408, "Request Timeout",
            f"the request did not arrive in time: no complete {what.split()[-1]} within "
            f"{seconds} s", "RequestTimeout"))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)


def protocol_class(limits: ConnectionLimits) -> type[GuardedHttpProtocol]:
    """A :class:`GuardedHttpProtocol` enforcing ``limits`` (uvicorn takes a class)."""
    return type("GatewayHttpProtocol", (GuardedHttpProtocol,), {"limits": limits})


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


def uvicorn_options(config: GatewayConfig, open_files: int | None = None) -> dict[str, Any]:
    """``uvicorn.Config`` keyword options enforcing ``config``'s client-side limits."""
    files = open_files if open_files is not None else resource.getrlimit(
        resource.RLIMIT_NOFILE)[0]
    limits = ConnectionLimits(connection_limit(config, files), config.head_timeout_s)
    return {"http": protocol_class(limits), "timeout_keep_alive": config.idle_timeout_s,
            "backlog": max(2048, min(limits.max_connections, 65535))}
