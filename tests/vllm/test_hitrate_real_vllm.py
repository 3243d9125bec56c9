"""`kvreuse hitrate` against real vLLM's /metrics (issue 6: tested against real vLLM)."""

from __future__ import annotations

import httpx

from kvreuse.cli.hitrate import Monitor
from kvreuse.cli.main import build_parser
from kvreuse.hitrate import cache_counters, parse_exposition

from .vllm_fleet import MODEL_NAME, Replica


def test_hitrate_window_equals_vllm_counter_deltas(replicas: list[Replica]) -> None:
    """The windowed token hit rate over real vLLM equals its own counters' deltas."""
    replica = replicas[1]
    url = replica.url + "/metrics"
    monitor = Monitor([url], build_parser().parse_args(["hitrate", url, "--window", "600"]))
    first = monitor.round(0.0)
    assert "error" not in first[-1], first
    before = cache_counters(parse_exposition(httpx.get(url).text))
    prompt = "the hit rate monitor reads real vllm counters " * 12
    for _ in range(3):
        response = httpx.post(
            replica.url + "/v1/completions",
            json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1},
            timeout=120,
        )
        assert response.status_code == 200, response.text
    after = cache_counters(parse_exposition(httpx.get(url).text))
    reading = monitor.round(1.0)[-1]
    assert before is not None and after is not None
    assert reading["source"].startswith("vllm")
    assert reading["window_queried_tokens"] == after.queries - before.queries > 0
    assert reading["window_cached_tokens"] == after.hits - before.hits > 0
    assert 0 < reading["window_hit_rate"] < 1
