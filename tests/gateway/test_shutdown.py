"""Stopping a gateway without losing a request: real `kvreuse route` processes in front of a
real `kvreuse engine`, sent real signals while clients are mid-request."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvreuse.errors import ConfigError
from kvreuse.gateway.config import GatewayConfig, UpstreamConfig
from kvreuse.gateway.serve import SHUTDOWN_MESSAGE
from kvreuse.testing.processes import EngineSpec, Fleet, Process

BODY = {"model": "sim", "prompt": "hello there", "max_tokens": 2}


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with Fleet(tmp_path) as started:
        yield started


def slow_engine(fleet: Fleet) -> Process:
    """One engine at 50 ms per token: a 60-token answer takes 3 s."""
    return fleet.start_engine("engine", EngineSpec(events=False, tpot_ms=50))


def gateway(fleet: Fleet, engine: Process, *flags: str) -> Process:
    return fleet.start_gateway("gw", [engine], policy="round_robin", extra_args=list(flags))


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``work`` in a thread; its result (or exception) lands in the returned dict."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = work()
        except Exception as exc:  # the test asserts on it
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def stream(url: str, tokens: int) -> str:
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={**BODY, "max_tokens": tokens, "stream": True}) as response:
        return response.read().decode()


def refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
    except httpx.ConnectError:
        return True
    return False


def exit_within(proc: Process, timeout_s: float) -> int:
    code = proc.popen.wait(timeout_s)
    assert code in (0, -signal.SIGTERM, -signal.SIGINT), (code, proc.log_tail())
    return code


def test_sigterm_drains_serving_new_requests_then_closes(fleet: Fleet) -> None:
    """After SIGTERM, for the drain delay: new requests are still served, each answer says
    connection: close (a keep-alive client's too), /ready is 503; a stream under way ends
    whole; then new connections are refused and the process exits."""
    proc = gateway(fleet, slow_engine(fleet), "--drain-delay", "1.5", "--shutdown-grace", "10")
    assert "\nkvreuse_gateway_draining 0.0\n" in httpx.get(proc.url + "/metrics").text
    with httpx.Client(base_url=proc.url, timeout=10) as keepalive:
        assert keepalive.post("/v1/completions", json=BODY).headers.get("connection") != "close"
        thread, outcome = in_thread(lambda: stream(proc.url, 60))
        time.sleep(0.3)
        proc.popen.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        time.sleep(0.1)
        ready = httpx.get(proc.url + "/ready", timeout=5)
        assert ready.status_code == 503 and "shutting down" in ready.json()["reason"]
        metrics = httpx.get(proc.url + "/metrics", timeout=5).text
        assert "\nkvreuse_gateway_draining 1.0\n" in metrics
        late = keepalive.post("/v1/completions", json=BODY)
        assert late.status_code == 200 and late.headers["connection"] == "close"
        while time.monotonic() - sent < 1.2:
            fresh = httpx.post(proc.url + "/v1/completions", json=BODY, timeout=10)
            assert fresh.status_code == 200 and fresh.headers["connection"] == "close"
            time.sleep(0.1)
    deadline = sent + 3.0
    while not refused(proc.url):
        assert time.monotonic() < deadline, "the listener stayed open after the drain"
        time.sleep(0.05)
    assert time.monotonic() - sent >= 1.4, "the listener closed before the drain ended"
    thread.join(30)
    body = outcome["result"]
    assert body.count("data: ") == 61 and body.endswith("data: [DONE]\n\n")
    assert "error" not in body
    exit_within(proc, 10)
    assert "SIGTERM: draining for 1.5 s" in proc.log_path.read_text()


def test_requests_past_the_grace_period_end_readably(fleet: Fleet) -> None:
    """When the grace period ends first, a stream under way gets an SSE error event saying
    the gateway is shutting down, and a request not yet answered a 503 saying so; the
    process then exits."""
    proc = gateway(fleet, slow_engine(fleet), "--drain-delay", "0", "--shutdown-grace", "1")
    streaming, streamed = in_thread(lambda: stream(proc.url, 200))
    whole, answered = in_thread(lambda: httpx.post(
        proc.url + "/v1/completions", json={**BODY, "max_tokens": 200}, timeout=60))
    time.sleep(0.5)
    proc.popen.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    streaming.join(30)
    whole.join(30)
    body = streamed["result"]
    assert 3 < body.count("data: ") < 100, body[-300:]
    last = body.split("data: ")[-2]  # the event before [DONE]
    assert '"error"' in last and "shutting down" in last and body.endswith("data: [DONE]\n\n")
    response = answered["result"]
    assert response.status_code == 503
    assert "shutting down" in response.json()["error"]["message"]
    assert time.monotonic() - sent < 5
    exit_within(proc, 10)
    assert "grace period of 1 s over: ending 2 requests" in proc.log_path.read_text()


def test_a_second_sigterm_ends_the_drain_at_once(fleet: Fleet) -> None:
    """A second SIGTERM during a 30 s drain closes the listener at once."""
    proc = gateway(fleet, slow_engine(fleet), "--drain-delay", "30")
    proc.popen.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert not refused(proc.url)
    proc.popen.send_signal(signal.SIGTERM)
    exit_within(proc, 5)


def test_ctrl_c_skips_the_drain(fleet: Fleet) -> None:
    """SIGINT (Ctrl-C at a terminal) stops at once whatever the drain delay, exiting 130
    with one line and no traceback, as a shell expects of an interrupted command."""
    proc = gateway(fleet, slow_engine(fleet), "--drain-delay", "30")
    proc.popen.send_signal(signal.SIGINT)
    assert proc.popen.wait(5) == 128 + signal.SIGINT, proc.log_tail()
    assert "kvreuse route: interrupted" in proc.log_tail()
    assert "Traceback" not in proc.log_tail()


@pytest.mark.parametrize(("option", "value"), [("drain_delay_s", -1.0),
                                               ("shutdown_grace_s", float("inf")),
                                               ("drain_delay_s", True)])
def test_drain_settings_are_checked(option: str, value: object) -> None:
    """A negative, infinite or boolean drain setting is a ConfigError naming it."""
    with pytest.raises(ConfigError, match=option):
        GatewayConfig(upstreams=(UpstreamConfig("http://127.0.0.1:1"),),
                      **{option: value})  # type: ignore[arg-type]


def raw_request(body: dict[str, object]) -> bytes:
    payload = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n" % len(payload)) + payload


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset reads as what came before it)."""
    received = b""
    sock.settimeout(15)
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
    return received


def listener_closed(port: int) -> bool:
    """Whether a connection is refused (a probe that connects is closed at once, unused)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_connections_made_before_the_listener_closes_are_served(fleet: Fleet) -> None:
    """A connection accepted before the drain ends that sends its request only after the
    listener closed, and one still queued in the kernel's backlog when it closed, are both
    answered (200, connection: close), never dropped unanswered."""
    proc = gateway(fleet, slow_engine(fleet), "--drain-delay", "1", "--shutdown-grace", "10")
    early = socket.create_connection(("127.0.0.1", proc.port))
    httpx.get(proc.url + "/health", timeout=5)  # the early connection is accepted by now
    proc.popen.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    proc.popen.send_signal(signal.SIGSTOP)  # frozen: a new connection waits in the backlog
    try:
        time.sleep(0.8)  # the drain is over while the gateway is frozen
        queued = socket.create_connection(("127.0.0.1", proc.port))
        queued.sendall(raw_request(BODY))
    finally:
        proc.popen.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 5
    while not listener_closed(proc.port):
        assert time.monotonic() < deadline, "the listener stayed open after the drain"
        time.sleep(0.05)
    early.sendall(raw_request(BODY))
    for name, sock in (("accepted early", early), ("queued", queued)):
        with sock:
            answer = read_to_close(sock)
        head = answer.partition(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 200"), (name, answer[:300], proc.log_tail())
        assert b"connection: close" in head
    exit_within(proc, 10)


def test_a_connection_silent_past_the_grace_period_gets_a_503(fleet: Fleet) -> None:
    """A connection accepted before the close that never sends its request is answered 503
    (shutting down) when the grace period ends, and the process exits then."""
    proc = gateway(fleet, slow_engine(fleet), "--drain-delay", "0", "--shutdown-grace", "1")
    silent = socket.create_connection(("127.0.0.1", proc.port))
    httpx.get(proc.url + "/health", timeout=5)  # the silent connection is accepted by now
    proc.popen.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    with silent:
        answer = read_to_close(silent)
    assert answer.startswith(b"HTTP/1.1 503"), answer[:300]
    assert SHUTDOWN_MESSAGE.encode() in answer
    exit_within(proc, 10)
    assert time.monotonic() - sent < 8
