"""The Redis sync counters of a shared index, on the /metrics of real gateway processes."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvreuse.testing.processes import Fleet, Process, wait_http


def sync_counters(gateway: Process) -> dict[str, float]:
    text = httpx.get(gateway.url + "/metrics", timeout=5).text
    prefix = "kvreuse_gateway_shared_index_"
    return {s.name.removeprefix(prefix): s.value for family in
            text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith(prefix)}


def test_sync_counters_show_what_each_gateway_shared(
        fleet: Fleet, engines: list[Process], redis: Process) -> None:
    """Requests through one gateway: it counts records published, the other counts them
    received; both report Redis connected and no errors."""
    first, second = (fleet.start_gateway(f"gw-sync-{i}", engines, policy="cache_aware",
                                         shared_index=redis.url, wait=False) for i in range(2))
    try:
        for gateway in (first, second):
            wait_http(gateway)
        for i in range(5):
            body = {"model": "sim", "prompt": f"shared prefix {i} " * 40, "max_tokens": 1}
            assert httpx.post(first.url + "/v1/completions", json=body,
                              timeout=10).status_code == 200
        deadline = time.monotonic() + 15
        while sync_counters(second).get("received_total", 0) < 5:
            assert time.monotonic() < deadline, sync_counters(second)
            time.sleep(0.1)
        published, received = sync_counters(first), sync_counters(second)
        assert published["published_total"] >= 5 and published["connected"] == 1.0
        assert received["connected"] == 1.0
        assert published["redis_errors_total"] == received["redis_errors_total"] == 0
        assert published["malformed_total"] == received["malformed_total"] == 0
    finally:
        fleet.forget(first)
        fleet.forget(second)
