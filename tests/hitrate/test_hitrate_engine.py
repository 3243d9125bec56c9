"""`kvreuse hitrate` scraping a running `kvreuse engine` over real HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from kvreuse.cli.hitrate import Monitor
from kvreuse.cli.main import build_parser, main
from kvreuse.engine.replica import EngineConfig
from kvreuse.engine.server import build_engine
from kvreuse.gateway.prompts import TextApproximation
from kvreuse.hitrate import cache_counters, parse_exposition
from kvreuse.testing.servers import ServerThread

FAST = {
    "block_size": 4,
    "prefill_tokens_per_s": 1e6,
    "overhead_s": 0.0,
    "time_per_output_token_s": 0.0,
}


@pytest.fixture()
def engine_url() -> Iterator[str]:
    app = build_engine(EngineConfig(model="sim", **FAST), TextApproximation())  # type: ignore[arg-type]
    server = ServerThread(app.app).start()
    yield server.url
    server.stop()


def send(url: str, prompt: str) -> None:
    response = httpx.post(
        url + "/v1/completions", json={"model": "sim", "prompt": prompt, "max_tokens": 1}
    )
    assert response.status_code == 200, response.text


def test_parses_the_engines_counters(engine_url: str) -> None:
    """The engine's /metrics page yields vLLM's query and hit counters."""
    send(engine_url, "a" * 200)
    send(engine_url, "a" * 200)
    counters = cache_counters(parse_exposition(httpx.get(engine_url + "/metrics").text))
    assert counters is not None
    assert counters.hits > 0
    assert counters.queries > counters.hits


def test_window_rate_equals_engine_counter_deltas(engine_url: str) -> None:
    """The windowed rate between two scrapes equals the engine's own counter deltas."""
    url = engine_url + "/metrics"
    args = build_parser().parse_args(["hitrate", url, "--window", "60"])
    monitor = Monitor([url], args)
    send(engine_url, "warm-up prompt " * 10)
    first = monitor.round(0.0)
    before = cache_counters(parse_exposition(httpx.get(url).text))
    for prompt in ("cold " * 30, "shared " * 30, "shared " * 30):
        send(engine_url, prompt)
    after = cache_counters(parse_exposition(httpx.get(url).text))
    second = monitor.round(1.0)
    assert before is not None and after is not None
    assert "error" not in first[0] and "error" not in second[0]
    reading = second[-1]
    assert reading["window_queried_tokens"] == after.queries - before.queries
    assert reading["window_cached_tokens"] == after.hits - before.hits
    assert reading["window_cached_tokens"] > 0
    assert reading["window_hit_rate"] == pytest.approx(
        (after.hits - before.hits) / (after.queries - before.queries)
    )


def test_hitrate_cli_prints_json_lines(engine_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvreuse hitrate --json --count 2` prints one reading per scrape round."""
    send(engine_url, "z " * 40)
    code = main(["hitrate", engine_url + "/metrics", "--json", "--count", "2", "--interval", "0.1"])
    assert code == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.strip()]
    readings = [x for x in lines if "window_hit_rate" in x]
    assert len(readings) == 2
    assert all(x["instance"] == engine_url + "/metrics" for x in readings)
