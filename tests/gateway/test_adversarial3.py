"""A third adversarial pass over the gateway, over real sockets: request framing at the client
front (malformed and smuggling-shaped requests, upgrade requests), the shared index against a
hostile Redis (a real ``redis-server``), and the trace recorder's memory under a flood."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvreuse.gateway import serve, shared_index
from kvreuse.gateway.recorder import RecorderSettings, TraceRecorder
from kvreuse.gateway.shared_index import (
    MAX_SHARED_CHAIN_BLOCKS,
    RedisIndexSync,
    SharedPrefixIndex,
)
from kvreuse.gateway.telemetry import RequestRecord, ThrottledLog
from kvreuse.identity import CacheIdentity
from kvreuse.routing import RequestView
from kvreuse.testing.processes import Fleet
from kvreuse.testing.servers import free_port
from kvreuse.tokens import pack

from .fleet import Engine, RunningGateway
from .test_serve_limits import Reader, connect, error_of

Factory = Callable[..., RunningGateway]
BODY = json.dumps({"model": "sim", "prompt": "hello there", "max_tokens": 2}).encode()
NEXT = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"  # what a smuggler hides behind a body
H2C = (b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\n"
       b"http2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n")  # as curl --http2 sends on http://


@pytest.fixture(autouse=True)
def fresh_throttles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the first refusal it causes logged, whatever earlier tests logged."""
    for module, names in ((serve, ("_malformed",)),
                          (shared_index, ("_redis_errors", "_skipped"))):
        for name in names:
            old = getattr(module, name)
            monkeypatch.setattr(module, name, ThrottledLog(old.logger, burst=1,
                                                           interval_s=10.0))


def post(headers: bytes, body: bytes) -> bytes:
    return b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n" + headers + b"\r\n" + body


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


# ---------------------------------------------------------------------- framing


@pytest.mark.parametrize("request_bytes", [
    post(b"content-length: %d\r\ntransfer-encoding: chunked\r\n" % len(BODY), chunked(BODY)),
    post(b"transfer-encoding: chunked\r\ncontent-length: 4\r\n", chunked(BODY)),
    post(b"content-length: %d\r\ncontent-length: %d\r\n" % (len(BODY), len(BODY) + len(NEXT)),
         BODY),
    post(b"content-length: +%d\r\n" % len(BODY), BODY),
    post(b"content-length: 0x%x\r\n" % len(BODY), BODY),
    post(b"content-length: 18446744073709551616\r\n", BODY),
    post(b"transfer-encoding: chunked, identity\r\n", chunked(BODY)),
    post(b"transfer-encoding: chunked\r\n", b"F" * 40 + b"\r\n" + BODY + b"\r\n0\r\n\r\n"),
    post(b"transfer-encoding: chunked\r\n", b"%x\n%s\n0\n\n" % (len(BODY), BODY)),
    post(b"content-length: %d\r\nx-a: 1\r\n folded\r\n" % len(BODY), BODY),
    post(b"content-length: %d\r\nx-a: a\x00b\r\n" % len(BODY), BODY),
], ids=["cl-te", "te-cl", "two-cl", "signed-cl", "hex-cl", "cl-2^64", "te-chunked-identity",
        "chunk-size-overflow", "bare-lf-chunks", "obs-fold", "nul-in-value"])
def test_ambiguous_framing_is_a_json_400_and_nothing_behind_it_is_served(
        engine: Engine, gateway_factory: Factory, request_bytes: bytes) -> None:
    """Framing llhttp refuses gets an OpenAI-shaped 400 naming why, then a close: never a
    second answer to the request smuggled behind it."""
    gateway = gateway_factory([engine])
    with connect(gateway) as sock:
        sock.sendall(request_bytes + NEXT)
        reader = Reader(sock)
        status, headers, body = reader.response()
        assert status == 400 and headers["connection"] == "close"
        assert error_of(body)["message"].startswith("malformed HTTP/1.1 request: ")
        assert reader.at_eof()


def test_malformed_requests_are_logged_throttled(engine: Engine, gateway_factory: Factory,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A flood of malformed requests costs one log line per 10 s, not one each."""
    gateway = gateway_factory([engine])
    caplog.set_level(logging.WARNING)
    for _ in range(5):
        with connect(gateway) as sock:
            sock.sendall(post(b"content-length: 1\r\ncontent-length: 2\r\n", b"xx"))
            assert Reader(sock).response()[0] == 400
    lines = [r for r in caplog.records if "malformed" in r.getMessage()
             or "Invalid HTTP request" in r.getMessage()]
    assert len(lines) == 1 and "Duplicate Content-Length" in lines[0].getMessage()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_upgrade_request_is_served_as_plain_http_body_and_all(
        engine: Engine, gateway_factory: Factory, framing: str) -> None:
    """An h2c upgrade POST (curl --http2 on http://) keeps its body, and the next request on
    its connection is served too."""
    gateway = gateway_factory([engine])
    body = (b"content-length: %d\r\n\r\n" % len(BODY) + BODY if framing == "content-length"
            else b"transfer-encoding: chunked\r\n\r\n" + chunked(BODY))
    with connect(gateway) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n" + H2C + body + NEXT)
        reader = Reader(sock)
        status, _, answer = reader.response()
        assert status == 200, answer
        assert json.loads(answer)["object"] == "text_completion"
        assert reader.response()[0] == 200


def test_an_upgrade_requests_body_sent_later_is_read(engine: Engine,
                                                     gateway_factory: Factory) -> None:
    """The body of an upgrade request may follow its head in later packets."""
    gateway = gateway_factory([engine])
    with connect(gateway) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n" + H2C
                     + b"content-length: %d\r\n\r\n" % len(BODY))
        time.sleep(0.05)
        sock.sendall(BODY)
        status, _, answer = Reader(sock).response()
        assert status == 200, answer


def test_a_malformed_pipelined_request_is_answered_after_the_one_before_it(
        engine: Engine, gateway_factory: Factory) -> None:
    """A malformed request behind one being served never cuts into its answer: that answer
    first, then the 400, then the close."""
    gateway = gateway_factory([engine])
    with connect(gateway) as sock:
        sock.sendall(post(b"content-length: %d\r\n" % len(BODY), BODY)
                     + post(b"transfer-encoding: chunked\r\n", b"5\nhello\r\n"))
        reader = Reader(sock)
        assert reader.response()[0] == 200
        status, _, body = reader.response()
        assert status == 400 and "chunk" in error_of(body)["message"]
        assert reader.at_eof()


@pytest.mark.parametrize("request_line", [
    b"CONNECT example.com:443 HTTP/1.1", b"GET http://[::1 HTTP/1.1",
], ids=["connect", "broken-absolute-url"])
def test_an_unservable_request_target_is_refused_in_words(
        engine: Engine, gateway_factory: Factory, request_line: bytes) -> None:
    """A CONNECT or a broken absolute URL gets a 400 saying the target is the problem, not
    llhttp's "User callback error"."""
    gateway = gateway_factory([engine])
    with connect(gateway) as sock:
        sock.sendall(request_line + b"\r\nhost: example.com:443\r\n\r\n")
        reader = Reader(sock)
        status, _, body = reader.response()
        message = error_of(body)["message"]
        assert status == 400 and "request target" in message and "callback" not in message
        assert reader.at_eof()


@pytest.mark.parametrize(("header", "status", "kind"), [
    (b"content-encoding: gzip\r\ncontent-length: %d\r\n", 415, "UnsupportedMediaTypeError"),
    (b"transfer-encoding: gzip, chunked\r\n", 501, "NotImplementedError"),
], ids=["content-encoding", "transfer-encoding"])
def test_a_compressed_body_is_refused_by_name_and_the_connection_goes_on(
        engine: Engine, gateway_factory: Factory, header: bytes, status: int,
        kind: str) -> None:
    """A gzipped body gets a 415 or 501 naming the coding, not "not valid UTF-8", and the
    next request on its connection is served."""
    gateway = gateway_factory([engine])
    packed = gzip.compress(BODY)
    body = chunked(packed) if b"chunked" in header else packed
    with connect(gateway) as sock:
        sock.sendall(post(header.replace(b"%d", b"%d" % len(packed)), body) + NEXT)
        reader = Reader(sock)
        got, _, answer = reader.response()
        error = error_of(answer)
        assert got == status and error["type"] == kind and "gzip" in error["message"]
        assert reader.response()[0] == 200


def test_identity_codings_are_served(engine: Engine, gateway_factory: Factory) -> None:
    """Content-Encoding: identity and Transfer-Encoding: chunked are plain bodies."""
    gateway = gateway_factory([engine])
    with connect(gateway) as sock:
        sock.sendall(post(b"content-encoding: identity\r\ntransfer-encoding: chunked\r\n",
                          chunked(BODY)))
        status, _, answer = Reader(sock).response()
        assert status == 200, answer


# ---------------------------------------------------------------------- shared index, Redis


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free port, as tests/multigateway starts it: skipped where none
    is installed, unless ``KVREUSE_REQUIRE_REDIS=1`` (``make test``) makes that a failure."""
    if shutil.which("redis-server") is None:
        if os.environ.get("KVREUSE_REQUIRE_REDIS") == "1":
            pytest.fail("KVREUSE_REQUIRE_REDIS=1 but redis-server is missing: `make redis`")
        pytest.skip("redis-server is not installed (make redis)")
    with Fleet(tmp_path_factory.mktemp("redis")) as fleet:
        yield fleet.start_redis().url


async def _sync_for(url: str, seconds: float, prepare: Callable[..., object] | None = None,
                    ) -> RedisIndexSync:
    import redis.asyncio as aioredis

    client = aioredis.from_url(url)
    try:
        if prepare is not None:
            await prepare(client)  # type: ignore[misc]
        sync = RedisIndexSync(SharedPrefixIndex(block_size=4), client, ["e0"],
                              prefix=f"t{free_port()}", block_ms=20)
        task = asyncio.get_running_loop().create_task(sync.run())
        await asyncio.sleep(seconds)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return sync
    finally:
        await client.aclose()


def test_a_redis_outage_is_logged_throttled(caplog: pytest.LogCaptureFixture) -> None:
    """Redis down: the retries (two a second) log one line, with the count held back."""
    caplog.set_level(logging.WARNING, "kvreuse.gateway.shared_index")
    sync = asyncio.run(_sync_for(f"redis://127.0.0.1:{free_port()}/0", 1.2))
    assert sync.stats.redis_errors >= 3 and not sync.stats.connected
    assert len([r for r in caplog.records if "redis error" in r.getMessage()]) == 1


def test_garbage_entries_are_skipped_and_logged_throttled(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Hundreds of undecodable entries in a shared stream: all counted, one log line."""
    caplog.set_level(logging.WARNING, "kvreuse.gateway.shared_index")
    state: dict[str, RedisIndexSync] = {}

    async def run() -> None:
        import redis.asyncio as aioredis

        client = aioredis.from_url(redis_url)
        sync = RedisIndexSync(SharedPrefixIndex(block_size=4), client, ["e0"],
                              prefix="garbage", block_ms=20)
        state["sync"] = sync
        pipe = client.pipeline(transaction=False)
        for _ in range(300):
            pipe.xadd("garbage:routed:e0", {"o": "evil", "c": "abc"})
        await pipe.execute()
        task = asyncio.get_running_loop().create_task(sync.run())
        await asyncio.sleep(0.5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.delete("garbage:routed:e0")
        await client.aclose()

    asyncio.run(run())
    assert state["sync"].stats.malformed == 300
    assert len([r for r in caplog.records if "malformed" in r.getMessage()]) == 1


def test_a_forged_endless_chain_is_read_only_as_far_as_a_context_goes(redis_url: str) -> None:
    """A forged entry of a million blocks is read to MAX_SHARED_CHAIN_BLOCKS, so decoding and
    merging it cannot stall the event loop (and every request) for seconds."""
    state: dict[str, object] = {}

    async def run() -> None:
        import redis.asyncio as aioredis

        client = aioredis.from_url(redis_url)
        index = SharedPrefixIndex(block_size=4, capacity_blocks=1 << 21)
        sync = RedisIndexSync(index, client, ["e0"], prefix="forged", block_ms=20)
        await client.xadd("forged:routed:e0",
                          {"o": "evil", "c": bytes(range(256)) * (1 << 15)})  # 1M blocks
        task = asyncio.get_running_loop().create_task(sync.run())
        loop = asyncio.get_running_loop()
        worst, last = 0.0, loop.time()
        while sync.stats.received == 0 and loop.time() - last < 10:
            await asyncio.sleep(0.001)  # how long the loop stays away is how long requests wait
            now = loop.time()
            worst, last = max(worst, now - last), now
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.delete("forged:routed:e0")
        await client.aclose()
        state["blocks"], state["worst"] = index.cached_blocks("e0"), worst

    asyncio.run(run())
    assert state["blocks"] <= MAX_SHARED_CHAIN_BLOCKS
    assert isinstance(state["worst"], float) and state["worst"] < 1.0


# ---------------------------------------------------------------------- recorder


def test_the_recorders_reorder_window_holds_no_more_than_its_queue(tmp_path: Path) -> None:
    """A flood of requests within the reorder window is written once more than queue_size are
    held, not kept in memory for the whole window."""
    recorder = TraceRecorder(RecorderSettings(tmp_path, b"s" * 16, queue_size=20,
                                              reorder_s=30.0))
    recorder.start()
    try:
        identity = CacheIdentity()
        for i in range(200):
            record = RequestRecord(f"r{i}", "/v1/completions", time.perf_counter())
            record.status, record.model, record.upstream = 200, "m", "u"
            record.view = RequestView(f"r{i}", pack([i] * 64), 64, identity)
            while not recorder.submit(record):  # (the queue is full: the writer is behind)
                time.sleep(0.01)
        deadline = time.monotonic() + 2.0
        while recorder.written < 200 - 20 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert recorder.written >= 200 - 20
    finally:
        recorder.close()
    assert recorder.written == 200
