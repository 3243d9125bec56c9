"""The client-facing server's limits on request heads (size: 431) and bodies (time: 408), over
real sockets against a gateway started as ``kvreuse route`` starts it
(:func:`kvreuse.gateway.serve.uvicorn_options`)."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import httpx
import pytest

from kvreuse.gateway import serve
from kvreuse.gateway.serve import MAX_HEAD_BYTES
from kvreuse.gateway.telemetry import ThrottledLog

from .fleet import Engine, RunningGateway, start_engine

Factory = Callable[..., RunningGateway]
BODY = json.dumps({"model": "sim", "prompt": "hello there", "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    one = start_engine("e0", events=False)
    yield one
    one.server.stop()


def request(body: bytes = BODY, *, head_bytes: int = 0, extra: bytes = b"") -> bytes:
    """A POST /v1/completions whose head is exactly ``head_bytes`` long (padded with one
    ``x-pad`` header) when given, else as short as it comes."""
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n%s" % (len(body), extra))
    if head_bytes:
        pad = head_bytes - len(head) - len(b"x-pad: \r\n\r\n")
        assert pad >= 0
        head += b"x-pad: " + b"a" * pad + b"\r\n"
    head += b"\r\n"
    assert not head_bytes or len(head) == head_bytes
    return head + body


class Reader:
    """Reads HTTP/1.1 responses one after another off a socket (keep-alive, pipelined)."""

    def __init__(self, sock: socket.socket) -> None:
        self.file: BinaryIO = sock.makefile("rb")

    def response(self) -> tuple[int, dict[str, str], bytes]:
        status = int(self.file.readline().split()[1])
        headers: dict[str, str] = {}
        while (line := self.file.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            return status, headers, self.file.read(int(headers["content-length"]))
        chunks = []
        while size := int(self.file.readline().split(b";")[0], 16):
            chunks.append(self.file.read(size))
            self.file.readline()
        self.file.readline()
        return status, headers, b"".join(chunks)

    def at_eof(self) -> bool:
        return self.file.read() == b""


def connect(gateway: RunningGateway) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gateway.server.port), timeout=10)


def error_of(body: bytes) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(body)["error"]
    return error


# ------------------------------------------------------------------ head size


def test_a_head_over_the_cap_is_a_431_with_an_error_body_and_closed(
        engine: Engine, gateway_factory: Factory) -> None:
    """A head one byte over MAX_HEAD_BYTES gets a 431 (OpenAI error body), then EOF."""
    gateway = gateway_factory([engine.upstream])
    with connect(gateway) as sock:
        sock.sendall(request(head_bytes=MAX_HEAD_BYTES + 1))
        reader = Reader(sock)
        status, headers, body = reader.response()
        assert status == 431 and headers["connection"] == "close"
        error = error_of(body)
        assert error["code"] == 431 and error["type"] == "RequestHeaderFieldsTooLarge"
        assert str(MAX_HEAD_BYTES) in error["message"]
        assert reader.at_eof()


def test_an_endless_head_is_refused_once_past_the_cap(engine: Engine,
                                                      gateway_factory: Factory) -> None:
    """The 431 comes as soon as the head passes the cap, without waiting for its end."""
    gateway = gateway_factory([engine.upstream], head_timeout_s=20)
    with connect(gateway) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-junk: ")
        sock.sendall(b"a" * MAX_HEAD_BYTES)  # and never a blank line
        started = time.monotonic()
        status, _, body = Reader(sock).response()
        assert status == 431 and error_of(body)["code"] == 431
        assert time.monotonic() - started < 2


@pytest.mark.parametrize("size", [MAX_HEAD_BYTES - 100, MAX_HEAD_BYTES])
def test_a_head_up_to_the_cap_is_served(engine: Engine, gateway_factory: Factory,
                                        size: int) -> None:
    """Heads just under and exactly at MAX_HEAD_BYTES are served as usual."""
    gateway = gateway_factory([engine.upstream])
    with connect(gateway) as sock:
        sock.sendall(request(head_bytes=size))
        status, _, body = Reader(sock).response()
        assert status == 200, body[:300]


def test_each_keep_alive_request_head_is_counted_afresh(engine: Engine,
                                                        gateway_factory: Factory) -> None:
    """Requests on one connection whose heads together pass the cap are all served."""
    gateway = gateway_factory([engine.upstream])
    with connect(gateway) as sock:
        reader = Reader(sock)
        for _ in range(3):
            sock.sendall(request(head_bytes=MAX_HEAD_BYTES * 3 // 4))
            status, headers, _ = reader.response()
            assert status == 200 and headers.get("connection") != "close"


def test_pipelined_heads_are_counted_apart(engine: Engine, gateway_factory: Factory) -> None:
    """Three requests sent at once (heads of 3/4 of the cap each, one with a chunked body)
    are all answered, in order."""
    gateway = gateway_factory([engine.upstream])
    chunked = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
               b"x-pad: " + b"c" * (MAX_HEAD_BYTES * 3 // 4) + b"\r\n\r\n"
               b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY))
    with connect(gateway) as sock:
        sock.sendall(request(head_bytes=MAX_HEAD_BYTES * 3 // 4) + chunked
                     + request(head_bytes=MAX_HEAD_BYTES * 3 // 4))
        reader = Reader(sock)
        assert [reader.response()[0] for _ in range(3)] == [200, 200, 200]


def test_a_later_request_over_the_cap_is_refused_after_the_answers_before_it(
        engine: Engine, gateway_factory: Factory) -> None:
    """Behind a served request on the same connection (sent at once), an oversized head
    gets its 431 after that request's 200, then EOF."""
    gateway = gateway_factory([engine.upstream])
    with connect(gateway) as sock:
        sock.sendall(request() + request(head_bytes=MAX_HEAD_BYTES * 2))
        reader = Reader(sock)
        assert reader.response()[0] == 200
        status, _, body = reader.response()
        assert status == 431 and error_of(body)["code"] == 431
        assert reader.at_eof()


def test_refused_heads_are_logged_throttled(engine: Engine, gateway_factory: Factory,
                                            caplog: pytest.LogCaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Three oversized heads in a row make one warning naming the cap, not three."""
    monkeypatch.setattr(serve, "_too_large", ThrottledLog(serve.log, burst=1, interval_s=10))
    gateway = gateway_factory([engine.upstream])
    with caplog.at_level(logging.WARNING, logger="kvreuse.gateway.serve"):
        for _ in range(3):
            with connect(gateway) as sock:
                sock.sendall(request(head_bytes=MAX_HEAD_BYTES + 1))
                assert Reader(sock).response()[0] == 431
    lines = [r.getMessage() for r in caplog.records if "431" in r.getMessage()]
    assert len(lines) == 1 and str(MAX_HEAD_BYTES) in lines[0], lines


# ------------------------------------------------------------------ body time


def test_a_trickling_body_gets_a_408_at_its_deadline(engine: Engine,
                                                     gateway_factory: Factory) -> None:
    """A body sent a byte every 0.2 s (never silent for a whole head timeout) is answered
    408 about head_timeout_s after its head, and the connection is closed."""
    gateway = gateway_factory([engine.upstream], head_timeout_s=0.8)
    with connect(gateway) as sock:
        message = request()
        head_end = message.index(b"\r\n\r\n") + 4
        sock.sendall(message[:head_end])
        started = time.monotonic()
        for byte in range(len(BODY) - 1):  # never the last one
            sock.sendall(message[head_end + byte:head_end + byte + 1])
            time.sleep(0.2)
            sock.setblocking(False)
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    break
            except BlockingIOError:
                pass
            finally:
                sock.setblocking(True)
        elapsed = time.monotonic() - started
        reader = Reader(sock)
        status, headers, body = reader.response()
        assert status == 408 and headers["connection"] == "close"
        error = error_of(body)
        assert error["code"] == 408 and "body" in error["message"]
        assert 0.7 < elapsed < 1.8, elapsed
        assert reader.at_eof()


def test_a_body_in_time_is_served_though_the_connection_is_older(
        engine: Engine, gateway_factory: Factory) -> None:
    """A head sent after 0.6 s, then its body in pieces over 0.6 s more, is served: the
    body's deadline runs from the end of its head."""
    gateway = gateway_factory([engine.upstream], head_timeout_s=1.2)
    with connect(gateway) as sock:
        message = request()
        head_end = message.index(b"\r\n\r\n") + 4
        time.sleep(0.6)
        sock.sendall(message[:head_end])
        step = len(BODY) // 4 + 1
        for at in range(head_end, len(message), step):
            time.sleep(0.15)
            sock.sendall(message[at:at + step])
        status, _, body = Reader(sock).response()
        assert status == 200, body[:300]


def test_a_large_body_sent_at_once_is_served(engine: Engine,
                                             gateway_factory: Factory) -> None:
    """A 4 MiB body (JSON padded with whitespace) arrives in many reads and is served."""
    gateway = gateway_factory([engine.upstream], head_timeout_s=2)
    body = BODY[:-1] + b" " * (4 << 20) + b"}"
    response = httpx.post(gateway.url + "/v1/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 200, response.text[:300]


def test_a_streamed_answer_is_never_cut_by_the_deadline(gateway_factory: Factory) -> None:
    """A stream that lasts several head timeouts arrives whole."""
    slow = start_engine("slow", events=False, time_per_output_token_s=0.05)
    try:
        gateway = gateway_factory([slow.upstream], head_timeout_s=0.4)
        started = time.monotonic()
        with httpx.stream("POST", gateway.url + "/v1/completions", timeout=30,
                          json={"model": "sim", "prompt": "hi", "max_tokens": 30,
                                "stream": True}) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line]
        assert time.monotonic() - started > 1.2
        assert lines[-1] == "data: [DONE]" and len(lines) > 30
    finally:
        slow.server.stop()


def test_an_idle_keep_alive_connection_is_timed_by_the_idle_timeout_not_the_head_timeout(
        engine: Engine, gateway_factory: Factory) -> None:
    """After an answer, a keep-alive connection left idle for three head timeouts gets no
    unsolicited 408 and serves its next request (a pooled client's next request would race
    such a 408 and be lost); the head timeout runs from the next request's first byte."""
    gateway = gateway_factory([engine.upstream], head_timeout_s=0.4, idle_timeout_s=5.0)
    with connect(gateway) as sock:
        reader = Reader(sock)
        sock.sendall(request())
        assert reader.response()[0] == 200
        time.sleep(1.2)
        sock.setblocking(False)
        try:
            unsolicited = sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            unsolicited = b""
        finally:
            sock.setblocking(True)
        assert unsolicited == b""
        sock.sendall(request())
        status, _, body = reader.response()
        assert status == 200, body[:300]
