"""``kvreuse engine`` over HTTP: vLLM's response shapes, metrics names, KV events on the wire."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Iterator

import httpx
import pytest

from kvreuse.engine.publisher import EventPublisher
from kvreuse.engine.replica import EngineConfig
from kvreuse.engine.server import build_engine
from kvreuse.gateway.prompts import HFPromptTokenizer, TextApproximation
from kvreuse.gateway.subscriber import EventSubscriber
from kvreuse.gateway.upstreams import parse_prometheus
from kvreuse.index.events import AllBlocksCleared, BlockStored
from kvreuse.kv_event_codec import EventBatch
from kvreuse.testing.servers import (
    ServerThread,
    calling_threads,
    free_listen_port,
    free_port,
    probe_while_posting,
)
from kvreuse.testing.tiny_tokenizer import build_tokenizer_dir

FAST = {"block_size": 4, "prefill_tokens_per_s": 1e6, "overhead_s": 0.0,
        "time_per_output_token_s": 0.0}


@pytest.fixture(scope="module")
def engine_url() -> str:
    app = build_engine(EngineConfig(model="sim", **FAST), TextApproximation())  # type: ignore[arg-type]
    server = ServerThread(app.app).start()
    yield server.url  # type: ignore[misc]
    server.stop()


def test_usage_reports_cached_tokens(engine_url: str) -> None:
    """A repeated prompt reports vLLM's cached_tokens in usage.prompt_tokens_details."""
    body = {"model": "sim", "prompt": "x" * 64, "max_tokens": 2}
    first = httpx.post(engine_url + "/v1/completions", json=body).json()
    second = httpx.post(engine_url + "/v1/completions", json=body).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 12  # (16 - 1) // 4 * 4
    assert second["usage"]["completion_tokens"] == 2


def test_metrics_carry_vllm_names(engine_url: str) -> None:
    """/metrics exposes the counters and gauges under vLLM's names."""
    httpx.post(engine_url + "/v1/completions", json={"model": "sim", "prompt": "y" * 40})
    text = httpx.get(engine_url + "/metrics").text
    parsed = parse_prometheus(text)
    assert set(parsed) == {"vllm:num_requests_waiting", "vllm:num_requests_running",
                           "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                           "vllm:prefix_cache_hits_total"}
    assert parsed["vllm:prefix_cache_queries_total"] >= 10


def test_chat_stream_has_vllm_chunks(engine_url: str) -> None:
    """A streamed chat opens with the assistant role and ends with usage and [DONE]."""
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True}}
    lines = [line[6:] for line in httpx.post(engine_url + "/v1/chat/completions",
                                             json=body).text.split("\n") if line]
    chunks = [json.loads(line) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 3 and lines[-1] == "[DONE]"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [({"model": "other", "prompt": "x"}, 404, "model"),
     ({"model": "sim", "prompt": "x", "cache_salt": "a\\b"}, 400, "cache_salt"),
     ({"model": "sim", "prompt": "x", "max_tokens": 40_000}, 400, "max_tokens")],
)
def test_refusals_name_the_field(engine_url: str, body: dict[str, object], status: int,
                                 param: str) -> None:
    """Unknown models, invalid salts and oversized requests are refused like vLLM does."""
    response = httpx.post(engine_url + "/v1/completions", json=body)
    assert response.status_code == status and response.json()["error"]["param"] == param


@pytest.mark.parametrize("shape", ["map", "array"])
def test_kv_events_reach_a_subscriber(shape: str) -> None:
    """Stored blocks and a cache reset arrive in vLLM's wire format, either shape."""
    endpoint = f"tcp://127.0.0.1:{free_listen_port()}"
    app = build_engine(EngineConfig(model="sim", **FAST), TextApproximation(),  # type: ignore[arg-type]
                       events_endpoint=endpoint, topic="kv", shape=shape)
    received: list[EventBatch] = []

    async def listen() -> None:
        subscriber = EventSubscriber("e", endpoint, on_batch=received.append,
                                     on_cold=lambda reason: None, topic="kv")
        subscriber.open()
        task = asyncio.get_running_loop().create_task(subscriber.run())
        with ServerThread(app.app) as server:
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient() as client:
                await client.post(server.url + "/v1/completions",
                                  json={"model": "sim", "prompt": "z" * 32, "max_tokens": 1})
                await client.post(server.url + "/reset_prefix_cache")
            for _ in range(100):
                if any(AllBlocksCleared() in b.events for b in received):
                    break
                await asyncio.sleep(0.02)
        subscriber.close()
        task.cancel()

    asyncio.run(listen())
    events = [e for batch in received for e in batch.events]
    assert isinstance(events[0], BlockStored) and events[0].token_ids[:1] == (
        int.from_bytes(b"zzzz", "little"),)
    assert events[-1] == AllBlocksCleared()


def test_ttft_histogram_counts_each_request_in_vllms_buckets() -> None:
    """vllm:time_to_first_token_seconds: one observation per request, in the bucket of its
    queue plus prefill (here 0.05 s of prefill: above 0.04, within 0.06), sum in seconds."""
    from kvreuse.hitrate.prometheus import parse_exposition

    slow = {**FAST, "prefill_tokens_per_s": 400.0}  # 20 tokens: 0.05 s
    app = build_engine(EngineConfig(model="sim", **slow), TextApproximation())  # type: ignore[arg-type]
    server = ServerThread(app.app).start()
    try:
        httpx.post(server.url + "/v1/completions",
                   json={"model": "sim", "prompt": "z" * 80, "max_tokens": 1})
        text = httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
    samples = parse_exposition(text, only=("vllm:time_to_first_token_seconds_bucket",
                                           "vllm:time_to_first_token_seconds_count",
                                           "vllm:time_to_first_token_seconds_sum"))
    buckets = {s.label("le"): s.value for s in samples if s.name.endswith("_bucket")}
    totals = {s.name.rsplit("_", 1)[1]: s.value for s in samples
              if not s.name.endswith("_bucket")}
    assert buckets["0.04"] == 0 and buckets["0.06"] == 1 and buckets["+Inf"] == 1
    assert totals["count"] == 1 and 0.05 <= totals["sum"] < 0.06


@pytest.fixture(scope="module")
def hf_engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An engine with a real (tiny) Hugging Face tokenizer whose chat template was removed."""
    directory = build_tokenizer_dir(tmp_path_factory.mktemp("tok"), vocab_size=2000,
                                    corpus_lines=3000)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    app = build_engine(EngineConfig(model="sim", **FAST),  # type: ignore[arg-type]
                       HFPromptTokenizer(directory))
    with ServerThread(app.app) as server:
        yield server.url


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/render"])
def test_a_chat_without_a_template_is_a_400_not_a_500(hf_engine_url: str, path: str) -> None:
    """A tokenizer with no chat template refuses chats with a readable 400, as the gateway."""
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    response = httpx.post(hf_engine_url + path, json=body)
    assert response.status_code == 400, response.text
    assert "chat_template" in response.json()["error"]["message"]


def test_token_ids_beyond_the_vocabulary_are_refused(hf_engine_url: str) -> None:
    """With a tokenizer, an id past its vocabulary is vLLM's 400 naming the prompt."""
    ok = httpx.post(hf_engine_url + "/v1/completions",
                    json={"model": "sim", "prompt": [1, 2, 1999], "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    for prompt in ([1, 2, 2000], [[5, 2**32 - 1]]):
        response = httpx.post(hf_engine_url + "/v1/completions",
                              json={"model": "sim", "prompt": prompt, "max_tokens": 1})
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
        assert "out of vocabulary" in response.json()["error"]["message"]


def test_refusals_are_logged_as_throttled_warnings(
    engine_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A refused request shows in the log at the default level; a flood is throttled."""
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvreuse.engine"), httpx.Client() as client:
        for _ in range(30):
            response = client.post(engine_url + "/v1/completions",
                                   json={"model": "nope", "prompt": "x"})
            assert response.status_code == 404
    windows = math.ceil(time.monotonic() - started) + 1  # the throttle: 10 lines a second
    lines = [r for r in caplog.records if r.name == "kvreuse.engine"]
    assert lines and "nope" in lines[0].getMessage()
    assert len(lines) <= 10 * windows


def test_the_replay_buffer_is_bounded_in_bytes() -> None:
    """Large batches (long prompts' token ids) are dropped oldest first past buffer_bytes."""
    publisher = EventPublisher(f"inproc://replay-bytes-{free_port()}", buffer_bytes=100_000)

    async def publish_many() -> None:
        publisher.start()
        try:
            for n in range(50):
                stored = BlockStored((bytes([n % 256]) * 32,), None, tuple(range(4096)), 4096)
                await publisher.publish([stored], float(n))
        finally:
            publisher.close()

    asyncio.run(publish_many())
    assert publisher.seq == 50
    assert 0 < publisher.buffered_bytes <= 100_000


def test_a_huge_prompt_is_tokenized_off_the_event_loop(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A 3 MB prompt through a real HF tokenizer (~2.5 s of encode) leaves /health answering."""
    directory = build_tokenizer_dir(tmp_path_factory.mktemp("tok"), vocab_size=2000,
                                    corpus_lines=3000)
    app = build_engine(EngineConfig(model="sim", **FAST),  # type: ignore[arg-type]
                       HFPromptTokenizer(directory))
    text = "hello world the quick brown fox jumps over " * 70_000
    body = json.dumps({"model": "sim", "prompt": text, "max_tokens": 1}).encode()
    with ServerThread(app.app) as server:
        latency, pending, status = probe_while_posting(server.url, "/v1/completions", body)
    assert pending and latency < 1.0, (latency, pending)
    assert status == 400  # millions of tokens: past the model's context, as vLLM answers


def test_a_body_over_the_inline_size_is_decoded_off_the_event_loop() -> None:
    """Past INLINE_BODY_BYTES, decoding and checking run on the tokenizing thread (a 34 MB chat
    of a million messages held the loop for 2.3 s); smaller bodies stay on the loop."""
    import kvreuse.engine.server as server_module

    app = build_engine(EngineConfig(model="sim", **FAST), TextApproximation())  # type: ignore[arg-type]
    padding = "x" * server_module.INLINE_BODY_BYTES
    with ServerThread(app.app) as server, calling_threads(server_module,
                                                          "decode_body") as threads:
        for user in ("me", padding):  # OpenAI's end-user id: a field engines ignore
            response = httpx.post(server.url + "/v1/completions", timeout=30,
                                  json={"model": "sim", "prompt": "hi", "max_tokens": 1,
                                        "user": user})
            assert response.status_code == 200, response.text
    assert threads[0].startswith("asgi-") and threads[1].startswith("kvreuse-tokenize"), threads
