"""``kvreuse engine`` over HTTP: vLLM's response shapes, metrics names, KV events on the wire."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvreuse.engine.replica import EngineConfig
from kvreuse.engine.server import build_engine
from kvreuse.gateway.prompts import TextApproximation
from kvreuse.gateway.subscriber import EventSubscriber
from kvreuse.gateway.upstreams import parse_prometheus
from kvreuse.index.events import AllBlocksCleared, BlockStored
from kvreuse.kv_event_codec import EventBatch
from kvreuse.testing.servers import ServerThread, free_port

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
    endpoint = f"tcp://127.0.0.1:{free_port()}"
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
