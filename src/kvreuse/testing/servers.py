"""Run ASGI apps (``kvreuse engine``, ``kvreuse route``) on real sockets inside a test process.

Each app gets its own thread and event loop and a port the OS picks on 127.0.0.1, so tests can
start several engines and a gateway side by side without port clashes, and streams go through
real HTTP (an in-process transport would buffer them).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def free_listen_port() -> int:
    """A free port below Linux's ephemeral range, for an endpoint that peers keep *connecting*
    to before it listens: ZeroMQ retries such connects, and a retry from an ephemeral source
    port equal to the target port connects the socket to itself and takes the port."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20_000, 32_000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and 32000 on 127.0.0.1")


class ServerThread:
    """``with ServerThread(app) as server: httpx.get(server.url + "/health")``."""

    def __init__(self, app: Any, *, startup_timeout_s: float = 20.0, host: str = "127.0.0.1",
                 port: int = 0, **options: Any) -> None:
        """``options`` go to ``uvicorn.Config`` (e.g. the gateway's
        :func:`kvreuse.gateway.serve.uvicorn_options`); ``host`` is a loopback address
        (127.0.0.2 too: two servers on one port), ``port`` 0 picks a free one."""
        import uvicorn

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                **options)
        self._server = uvicorn.Server(config)
        self._timeout = startup_timeout_s
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"asgi-{self.port}")
        self.loop: asyncio.AbstractEventLoop | None = None

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        asyncio.set_event_loop(loop)
        loop.run_until_complete(self._server.serve(sockets=[self._sock]))
        loop.close()

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + self._timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def call(self, coro: Any, timeout_s: float = 10.0) -> Any:
        """Run a coroutine on the server's loop (to inspect or poke its state) and wait."""
        assert self.loop is not None, "server not started"
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=self._timeout)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def probe_while_posting(url: str, path: str, body: bytes, *,
                        probe: Callable[[], Any] | None = None,
                        head_start_s: float = 0.3) -> tuple[float, bool, int]:
    """POST ``body`` to ``url + path`` on a thread, then after ``head_start_s`` call ``probe``
    (default: GET ``url + "/health"``), which must answer status 200: its latency in
    seconds, whether the POST was still unanswered when it answered, and the POST's status once
    it ends. A server that blocks its event loop on the POST (tokenizing a huge prompt, say),
    or makes other requests queue behind it, answers the probe late and after the POST."""
    import httpx

    answered: list[int] = []

    def post() -> None:
        answered.append(httpx.post(url + path, content=body, timeout=120,
                                   headers={"content-type": "application/json"}).status_code)

    sender = threading.Thread(target=post, daemon=True)
    sender.start()
    time.sleep(head_start_s)
    started = time.monotonic()
    response = probe() if probe is not None else httpx.get(url + "/health", timeout=120)
    latency = time.monotonic() - started
    pending = not answered
    sender.join(timeout=120)
    assert response.status_code == 200, response.text
    assert answered, "the POST was not answered within 120 s"
    return latency, pending, answered[0]


@contextlib.contextmanager
def calling_threads(module: Any, name: str) -> Iterator[list[str]]:
    """Within the block, ``module.name`` (a function) still runs but first notes the name of
    the thread calling it in the list yielded; restored after the block."""
    real = getattr(module, name)
    names: list[str] = []

    def noting(*args: Any, **kwargs: Any) -> Any:
        names.append(threading.current_thread().name)
        return real(*args, **kwargs)

    setattr(module, name, noting)
    try:
        yield names
    finally:
        setattr(module, name, real)


def trickle(conn: socket.socket) -> None:
    """An answer for :func:`answering_server`: a status line and a header a byte every 0.1 s,
    never finished (no per-read timeout ever fires)."""
    for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10_000:
        conn.sendall(bytes([byte]))
        time.sleep(0.1)


@contextlib.contextmanager
def answering_server(answer: Callable[[socket.socket], None]) -> Iterator[str]:
    """A listener on 127.0.0.1 whose every connection gets ``answer(conn)`` once the request
    head has arrived (``conn.sendall(raw_bytes)``, :func:`trickle`, or a peer that is not
    HTTP at all); yields its ``http://127.0.0.1:PORT`` and closes it after the block."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                answer(conn)
            except OSError:
                pass

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()
