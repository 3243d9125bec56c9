"""fetch_page and the parser against hostile peers on real 127.0.0.1 sockets."""

from __future__ import annotations

import socket
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from kvreuse.errors import InputFormatError
from kvreuse.hitrate.prometheus import cache_counters, fetch_page, parse_exposition
from kvreuse.testing.servers import answering_server, trickle


@contextmanager
def raw_server(answer: Callable[[socket.socket], None]) -> Iterator[str]:
    """:func:`answering_server`, yielding the URL of its /metrics."""
    with answering_server(answer) as url:
        yield url + "/metrics"


def endless(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
    while True:
        conn.sendall(b"# padding " + b"y" * 65000 + b"\n")


@pytest.mark.timeout(30)
def test_a_trickling_server_is_cut_at_the_timeout() -> None:
    """A server sending a byte every 0.1 s never trips a per-read timeout; the whole fetch
    still ends at its timeout."""
    with raw_server(trickle) as url:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="within 1 s"):
            fetch_page(url, 1.0)
        assert time.monotonic() - started < 3.0


@pytest.mark.timeout(30)
def test_an_endless_body_is_refused_at_the_byte_limit() -> None:
    """A body without end is read up to max_bytes, then refused with a message."""
    with raw_server(endless) as url, pytest.raises(OSError, match="1,048,576-byte limit"):
        fetch_page(url, 10.0, max_bytes=1 << 20)


def test_a_non_http_peer_is_an_os_error() -> None:
    """A peer that answers with an SSH banner gives a one-line OSError, not HTTPException."""
    with raw_server(lambda conn: conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")) as url, \
            pytest.raises(OSError, match=r"not a valid HTTP answer: BadStatusLine: SSH-2\.0"):
        fetch_page(url, 5.0)


def test_a_body_cut_short_is_an_error_not_a_page() -> None:
    """A body that ends before its Content-Length is an error, not a shorter page."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nvllm:prefix_cache_hits 1\n"
    with raw_server(lambda conn: conn.sendall(answer)) as url, \
            pytest.raises(OSError, match="broke off"):
        fetch_page(url, 5.0)


def test_a_label_value_of_millions_of_escapes_parses_in_bounded_memory() -> None:
    """One 2 MB label value of escaped quotes costs the parser a few MB, not hundreds."""
    line = 'm{a="' + '\\"' * (1 << 20) + '"} 1\n'
    tracemalloc.start()
    try:
        samples = parse_exposition(line)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert samples[0].label("a") == '"' * (1 << 20)
    assert peak < 40 << 20


@pytest.mark.parametrize("value", ["+Inf", "1e400", "-1"])
def test_an_infinite_or_negative_counter_is_an_input_error(value: str) -> None:
    """A counter of +Inf, 1e400 or -1 has no rate: an error naming it, not inf or NaN rates."""
    page = f"vllm:prefix_cache_queries_total {value}\nvllm:prefix_cache_hits_total 1\n"
    with pytest.raises(InputFormatError, match="vllm:prefix_cache_queries_total is"):
        cache_counters(parse_exposition(page))
