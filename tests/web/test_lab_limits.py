"""The lab's bounds on a live server (uvicorn on 127.0.0.1): oversized bodies are refused
before they are read whole, and only a configured number of simulations run at once."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from kvreuse.testing.servers import ServerThread
from kvreuse.web.adapter import SimLab
from kvreuse.web.app import MAX_BODY_BYTES, create_app
from kvreuse.web.controls import LabControls, RunCancelled
from kvreuse.web.result import LabResult


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """``app`` on a free port of 127.0.0.1 in a thread; yields the base URL, then stops."""
    with ServerThread(app) as server:
        yield server.url


class CountingLab(SimLab):
    """The real simulator, counting how many of its runs overlap."""

    def __init__(self) -> None:
        self.active = 0
        self.peak = 0
        self.lock = threading.Lock()

    def run(self, controls: LabControls, cancel: threading.Event | None = None) -> LabResult:
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            return super().run(controls, cancel)
        finally:
            with self.lock:
                self.active -= 1


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url + "/api/run", data=json.dumps(body).encode(), method="POST",
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def _send(sock: socket.socket, data: bytes) -> None:
    """Send what the server still reads; one that already answered may close early."""
    with suppress(BrokenPipeError, ConnectionResetError):
        sock.sendall(data)


def _status_line(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n", 1)[0]


def test_a_huge_declared_body_is_refused_without_reading_it() -> None:
    """300 MB announced, 100 KB sent: 413 comes back at once, the rest is never awaited."""
    with serve(create_app()) as url, socket.create_connection(
        ("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10
    ) as sock:
        _send(sock, b"POST /api/run HTTP/1.1\r\nHost: lab\r\nContent-Type: application/json\r\n"
              b"Content-Length: 300000000\r\n\r\n" + b" " * 100_000)
        assert b" 413 " in _status_line(sock)


def test_a_chunked_body_is_cut_off_at_the_limit() -> None:
    """Without a length, the server stops at the limit: 413 while the client is still sending."""
    with serve(create_app()) as url, socket.create_connection(
        ("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10
    ) as sock:
        _send(sock, b"POST /api/run HTTP/1.1\r\nHost: lab\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b" " * 16_384
        for _ in range(MAX_BODY_BYTES // len(chunk) + 2):
            _send(sock, b"%x\r\n%s\r\n" % (len(chunk), chunk))
        # no terminating chunk: a server that waited for the whole body would never answer
        assert b" 413 " in _status_line(sock)


def test_at_most_the_configured_number_of_runs_at_once() -> None:
    """Six different runs at once on a lab allowing two: all answer, never three overlap."""
    lab = CountingLab()
    with serve(create_app(lab, max_concurrent_runs=2)) as url:
        results: list[int] = []
        threads = [
            threading.Thread(
                target=lambda seed=seed: results.append(
                    _post(url, {"seed": seed, "duration_s": 60})[0]
                )
            )
            for seed in range(6)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert results == [200] * 6
    assert 1 <= lab.peak <= 2


def test_runs_beyond_the_queue_get_a_fast_503() -> None:
    """One slot, no waiting room: while a run is going, another is refused with Retry-After."""
    lab = CountingLab()
    with serve(create_app(lab, max_concurrent_runs=1, max_waiting_runs=0)) as url:
        long_run = threading.Thread(
            target=_post, args=(url, {"seed": 1, "duration_s": 240, "arrival_rate": 60})
        )
        long_run.start()
        deadline = time.monotonic() + 30
        while lab.active == 0:
            assert time.monotonic() < deadline, "the first run never started"
            time.sleep(0.01)
        request = urllib.request.Request(
            url + "/api/run", data=b'{"seed": 2}', method="POST",
            headers={"content-type": "application/json"},
        )
        try:
            urllib.request.urlopen(request, timeout=30)
            raise AssertionError("the second run was accepted")
        except urllib.error.HTTPError as exc:
            assert exc.code == 503 and exc.headers["Retry-After"]
            assert "already running 1" in json.load(exc)["error"]
        long_run.join(timeout=120)


class HangingLab(SimLab):
    """The real simulator, except that seed 1 runs until it is cancelled (or 20 s pass)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.cancelled = threading.Event()

    def run(self, controls: LabControls, cancel: threading.Event | None = None) -> LabResult:
        if controls.seed != 1:
            return super().run(controls, cancel)
        self.started.set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if cancel is not None and cancel.wait(0.01):
                self.cancelled.set()
                raise RunCancelled("cancelled")
        return super().run(controls, cancel)


def _post_and_hang_up(url: str, body: dict[str, Any]) -> socket.socket:
    """Send a run and return the open socket; the caller closes it to hang up."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10)
    sock.sendall(b"POST /api/run HTTP/1.1\r\nHost: lab\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def test_a_run_whose_client_hangs_up_is_cancelled_and_frees_its_slot() -> None:
    """One slot: the client of a running simulation leaves; the run stops and the next gets 200."""
    lab = HangingLab()
    with serve(create_app(lab, max_concurrent_runs=1, max_waiting_runs=0)) as url:
        sock = _post_and_hang_up(url, {"seed": 1, "duration_s": 5})
        assert lab.started.wait(10), "the run never started"
        sock.close()
        assert lab.cancelled.wait(5), "the abandoned run was not cancelled"
        deadline = time.monotonic() + 5
        while (status := _post(url, {"seed": 2, "duration_s": 5})[0]) == 503:
            assert time.monotonic() < deadline, "the slot was never freed"
            time.sleep(0.02)
        assert status == 200


def _status_within(url: str, body: dict[str, Any], timeout_s: float) -> int | None:
    """The run's status, or None when no answer came within ``timeout_s`` (then it hangs up)."""
    request = urllib.request.Request(url + "/api/run", data=json.dumps(body).encode(),
                                     method="POST", headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (TimeoutError, urllib.error.URLError):
        return None


def test_a_waiting_run_whose_client_hangs_up_leaves_the_queue() -> None:
    """One slot, one place in the queue: a waiter that hangs up frees its place at once."""
    lab = HangingLab()
    app = create_app(lab, max_concurrent_runs=1, max_waiting_runs=1, queue_timeout_s=60)
    with serve(app) as url:
        holder = _post_and_hang_up(url, {"seed": 1, "duration_s": 5})
        assert lab.started.wait(10), "the first run never started"
        waiter = _post_and_hang_up(url, {"seed": 3, "duration_s": 5})
        deadline = time.monotonic() + 5
        while _status_within(url, {"seed": 4, "duration_s": 5}, 0.3) != 503:
            assert time.monotonic() < deadline, "the queue never filled"
        waiter.close()
        deadline = time.monotonic() + 5
        # Queued (no answer while the slot is held) rather than refused: the place was freed.
        while _status_within(url, {"seed": 4, "duration_s": 5}, 0.3) == 503:
            assert time.monotonic() < deadline, "the gone waiter kept its place in the queue"
            time.sleep(0.02)
        holder.close()
        assert lab.cancelled.wait(5)
