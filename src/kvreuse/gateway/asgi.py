"""Bare ASGI for the gateway's hot path (``POST /v1/completions`` and ``/v1/chat/completions``).

Every proxied request passes here, so these endpoints skip Starlette's request and response
objects and middleware stack (URL parsing, header multidicts, exception wrappers: about a tenth
of the gateway's CPU per request, measured in benchmarks/gateway_throughput.py) and speak ASGI
messages directly. The other endpoints (/health, /ready, /metrics, /v1/models) stay on Starlette.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvreuse.gateway.validation import RequestError

__all__ = ["DISCONNECT_HOOK", "ASGIApp", "ClientGone", "DisconnectHook", "Message", "RawHeaders",
           "Receive", "Scope", "Send", "ServerStack", "disconnect_hook", "read_body",
           "send_bytes", "send_error", "send_json", "server_stack", "until_disconnect"]

RawHeaders = list[tuple[bytes, bytes]]
T = TypeVar("T")

JSON_TYPE = (b"content-type", b"application/json")


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


async def read_body(receive: Receive, limit: int, declared: bytes | None) -> bytes:
    """The request body; :class:`RequestError` (413) past ``limit`` bytes, :class:`ClientGone`
    when the client leaves first. O(body)."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"the body is larger than {limit} bytes", "body", 413)
    message = await receive()
    if message["type"] != "http.request":
        raise ClientGone
    body: bytes = message.get("body", b"")
    if len(body) > limit:
        raise RequestError(f"the body is larger than {limit} bytes", "body", 413)
    if not message.get("more_body", False):  # the usual case: one message holds it all
        return body
    chunks, size = [body], len(body)
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RequestError(f"the body is larger than {limit} bytes", "body", 413)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_bytes(send: Send, status: int, body: bytes,
                     headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """A whole response: status, ``headers`` plus content-length, then the body."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-length", b"%d" % len(body)), *headers]})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, value: Any,
                    headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    await send_bytes(send, status, json.dumps(value).encode(), (JSON_TYPE, *headers))


async def send_error(send: Send, error: RequestError) -> None:
    """OpenAI's error shape, as vLLM answers. A body refused as too large (413) also closes
    the connection, so that the rest of it is never read."""
    await send_json(send, error.status, error.body(),
                    [(b"connection", b"close")] if error.status == 413 else [])


DISCONNECT_HOOK = "kvreuse.disconnect"
"""Key of ``{"hook": DisconnectHook}`` in a request scope's ``extensions``, set by servers that can
tell when a client has gone without a task waiting on ``receive`` (the gateway's own uvicorn
protocol, :mod:`kvreuse.gateway.serve`)."""


class DisconnectHook:
    """Told by the server when the client of one request has gone (its connection closed)."""

    __slots__ = ("gone", "on_disconnect")

    def __init__(self) -> None:
        self.gone = False
        self.on_disconnect: Callable[[], None] | None = None

    def fire(self) -> None:
        """Called by the server once the connection is lost."""
        self.gone = True
        callback, self.on_disconnect = self.on_disconnect, None
        if callback is not None:
            callback()


def disconnect_hook(scope: Scope) -> DisconnectHook | None:
    """The request's :class:`DisconnectHook`, when its server provides one."""
    extensions = scope.get("extensions")
    entry = extensions.get(DISCONNECT_HOOK) if extensions else None
    hook = entry.get("hook") if isinstance(entry, dict) else None
    return hook if isinstance(hook, DisconnectHook) else None


async def until_disconnect(receive: Receive, work: Coroutine[Any, Any, T],
                           hook: DisconnectHook | None = None) -> T | None:
    """Run ``work`` (which answers the client) to its end, unless the client disconnects
    first: then ``work`` is cancelled where it waits (closing an upstream connection there is
    how the upstream learns to abort) and None returned.

    uvicorn (ASGI spec 2.3) drops messages sent to a gone client without telling the sender, so
    a request would run on for nobody; the signal is ``http.disconnect`` on ``receive``, which
    costs a watcher task per request (about 20 us), or, cheaper, the server's ``hook``.
    ``work`` runs in the calling task."""
    task = asyncio.current_task()
    assert task is not None, "until_disconnect runs inside a task"
    state = {"gone": False, "over": False}

    def client_left() -> None:
        if not state["over"]:
            state["gone"] = True
            task.cancel()

    watcher: asyncio.Task[None] | None = None
    if hook is not None:
        if hook.gone:
            work.close()
            return None
        hook.on_disconnect = client_left
    else:
        def watcher_done(done: asyncio.Task[None]) -> None:
            if not done.cancelled() and done.exception() is None:
                client_left()

        watcher = asyncio.get_running_loop().create_task(_disconnected(receive))
        watcher.add_done_callback(watcher_done)
    try:
        return await work
    except asyncio.CancelledError:
        # Ours (the client left) unless the task was also cancelled from outside (shutdown).
        if state["gone"] and task.uncancel() == 0:
            return None
        raise
    finally:
        state["over"] = True
        if watcher is not None:
            watcher.cancel()
        elif hook is not None:
            hook.on_disconnect = None


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


@dataclass(frozen=True, slots=True)
class ServerStack:
    """uvicorn's ``loop`` and ``http`` options."""

    loop: Literal["uvloop", "asyncio"]
    http: Literal["httptools", "h11"]


def server_stack() -> ServerStack:
    """uvloop and httptools when installed (the gateway extra installs both; together they
    about double a process's requests per second against asyncio and h11), else the
    pure-Python pair."""
    import importlib.util

    fast_loop = importlib.util.find_spec("uvloop") is not None
    fast_http = importlib.util.find_spec("httptools") is not None
    return ServerStack("uvloop" if fast_loop else "asyncio", "httptools" if fast_http else "h11")
