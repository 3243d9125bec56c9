"""The gateway measures its engines' prefill speed and routes on it (kvreuse.routing.cost_fit,
gateway/router.py "Prefill speed"), in front of simulated engines on real sockets.

The engines here prefill ``ENGINE_RATE`` tokens a second after ``ENGINE_OVERHEAD_S``: five
times slower than the 10,000 tokens a second the policies assume until they are told or have
measured otherwise.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvreuse.gateway.config import UpstreamConfig
from kvreuse.hitrate.prometheus import parse_exposition
from kvreuse.testing.processes import Fleet
from kvreuse.testing.tiny_tokenizer import corpus_words

from .fleet import Engine, RunningGateway, slow_engines, start_engine
from .test_hot_prefix_copies import decisions, send_stream, text_of

Factory = Callable[..., RunningGateway]

ENGINE_RATE = 2_000.0
ENGINE_OVERHEAD_S = 0.02
WARMUP = 48
PREFIX_TOKENS = 2000
SUFFIX_TOKENS = 100
BURST = 60
ADMIN_KEY = "admin-key-for-speed-tests-0123"
BURST_RATE = 20.0  # requests a second: 1.4 engines' worth of hits (0.07 s each)


@pytest.fixture
def slow_pair() -> Iterator[list[Engine]]:
    yield from slow_engines(ENGINE_RATE, ENGINE_OVERHEAD_S)


def unique_prompt(tokens: int) -> str:
    """A prompt of ``tokens`` tokens sharing nothing with any other prompt of any run."""
    return text_of(tokens, [uuid.uuid4().hex[:11]], 0)


async def warm_up(url: str, *, stream: bool = True, requests: int = WARMUP,
                  models: tuple[str, ...] = ("sim",)) -> None:
    """``requests`` completions of 100 to 800 unique tokens, four at a time, naming
    ``models`` in turn."""
    sizes = [100 + (i * 137) % 700 for i in range(requests)]
    turn = iter(range(requests))
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        async def one(size: int) -> None:
            body = {"model": models[next(turn) % len(models)], "prompt": unique_prompt(size),
                    "max_tokens": 2, "stream": stream}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                await response.aread()

        for start in range(0, requests, 4):
            await asyncio.gather(*(one(size) for size in sizes[start:start + 4]))


def prefill_metrics(gateway: RunningGateway) -> dict[str, float]:
    """The gateway's prefill-speed series for model ``sim``, by metric name less its prefix."""
    text = httpx.get(gateway.url + "/metrics", timeout=5).text
    names = [f"kvreuse_gateway_prefill_{name}"
             for name in ("tokens_per_second", "overhead_seconds", "samples_total")]
    return {sample.name.removeprefix("kvreuse_gateway_prefill_"): sample.value
            for sample in parse_exposition(text, only=names) if sample.label("model") == "sim"}


def test_streamed_first_chunks_measure_the_engines_prefill_speed(
        slow_pair: list[Engine], gateway_factory: Factory) -> None:
    """After 48 streamed answers /metrics shows the engines' rate within 25 %."""
    gateway = gateway_factory(slow_pair)
    asyncio.run(warm_up(gateway.url))
    measured = prefill_metrics(gateway)
    assert measured["samples_total"] == WARMUP, measured
    assert measured["tokens_per_second"] == pytest.approx(ENGINE_RATE, rel=0.25), measured
    # The policy routes on what was measured.
    cost = gateway.gateway.router.cost_for("sim")
    assert cost.prefill_tokens_per_s == measured["tokens_per_second"]


def test_whole_answers_are_not_timed(slow_pair: list[Engine], gateway_factory: Factory) -> None:
    """A non-streamed answer's first byte is its last: no sample, the configured speed."""
    gateway = gateway_factory(slow_pair)
    asyncio.run(warm_up(gateway.url, stream=False, requests=8))
    assert prefill_metrics(gateway) == {}
    assert gateway.gateway.router.cost_for("sim") == gateway.gateway.router.cost


def test_fixed_prefill_routes_on_the_configured_speed(
        slow_pair: list[Engine], gateway_factory: Factory) -> None:
    """With learn_prefill off nothing is measured and the policy keeps the given speed."""
    gateway = gateway_factory(slow_pair, learn_prefill=False, prefill_tokens_per_s=3000.0,
                              prefill_overhead_s=0.01)
    asyncio.run(warm_up(gateway.url, requests=8))
    assert prefill_metrics(gateway) == {}
    policy_cost = gateway.gateway.policy.cost  # type: ignore[attr-defined]
    assert (policy_cost.prefill_tokens_per_s, policy_cost.overhead_s) == (3000.0, 0.01)


async def hot_burst(url: str) -> list[tuple[int, str]]:
    """``BURST`` completions at ``BURST_RATE`` a second sharing a ``PREFIX_TOKENS`` prefix."""
    words = corpus_words()
    run = uuid.uuid4().hex
    prefix = text_of(PREFIX_TOKENS, [run, *words], 0)
    prompts = [prefix + text_of(SUFFIX_TOKENS, [f"{i:04d}", run, *words], 0)
               for i in range(BURST)]
    return await send_stream(url, prompts, rate=BURST_RATE, max_tokens=2)


@pytest.mark.parametrize("learn", [True, False])
def test_a_hot_prefix_on_slow_engines_is_copied_once_their_speed_is_known(
        slow_pair: list[Engine], gateway_factory: Factory, learn: bool) -> None:
    """Measured, the prefix's demand (1.4 engines) gets a copy; assumed 5x faster, none."""
    gateway = gateway_factory(slow_pair, learn_prefill=learn)
    asyncio.run(warm_up(gateway.url))
    made = decisions(gateway)
    results = asyncio.run(hot_burst(gateway.url))
    assert [status for status, _ in results] == [200] * BURST
    routed = Counter(upstream for upstream, _ in made)
    misses = [upstream for upstream, branch in made if branch == "miss"]
    if learn:
        # 20 hits a second of 0.07 s each: the holder's share and one copy elsewhere.
        assert len(routed) == 2 and min(routed.values()) >= BURST // 4, (routed, made)
        assert len(misses) == 2, made
    else:
        # Assumed at 10,000 tokens a second a hit costs 0.025 s: 0.5 engines' worth.
        assert len(routed) == 1 and misses == [made[0][0]], made


def test_a_comment_sent_before_the_first_token_is_not_timed(
        fleet: Fleet, gateway_factory: Factory) -> None:
    """An upstream that pings (': keep-alive') before its first event gives no sample."""
    pinger = fleet.start_misbehaving("pinger", "comment-first", "--delay", "0.2")
    gateway = gateway_factory([UpstreamConfig(pinger.url, name="pinger", models=("sim",))])
    with httpx.stream("POST", gateway.url + "/v1/completions", timeout=10, json={
            "model": "sim", "prompt": "hello", "max_tokens": 2, "stream": True}) as response:
        assert response.status_code == 200
        assert b"data: [DONE]" in response.read()
    assert prefill_metrics(gateway) == {}


def test_a_stream_that_opens_with_an_error_event_is_not_timed(
        fleet: Fleet, gateway_factory: Factory) -> None:
    """An instant error event is no first token: the client reads the error, no sample."""
    failing = fleet.start_misbehaving("error-event", "error-event")
    gateway = gateway_factory([UpstreamConfig(failing.url, name="error-event",
                                              models=("sim",))], retries=0)
    with httpx.stream("POST", gateway.url + "/v1/completions", timeout=10, json={
            "model": "sim", "prompt": "hello", "max_tokens": 2, "stream": True}) as response:
        assert response.status_code == 200
        assert b"deliberate error event" in response.read()
    assert prefill_metrics(gateway) == {}


def test_each_model_is_timed_on_its_own(gateway_factory: Factory) -> None:
    """Engines of two models at different speeds: each model's fit finds its own rate."""
    engines = [start_engine("fast", events=False, model="fast", prefill_tokens_per_s=40_000.0,
                            overhead_s=0.005, num_blocks=16_384),
               start_engine("slow", events=False, model="slow", prefill_tokens_per_s=2_000.0,
                            overhead_s=0.005, num_blocks=16_384)]
    try:
        gateway = gateway_factory(engines)
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            for i in range(24):
                for model in ("fast", "slow"):
                    body = {"model": model, "prompt": unique_prompt(200 + 50 * (i % 8)),
                            "max_tokens": 2, "stream": True}
                    with client.stream("POST", "/v1/completions", json=body) as response:
                        assert response.status_code == 200
                        response.read()
        router = gateway.gateway.router
        assert sorted(router.fits) == ["fast", "slow"]
        fast, slow = router.cost_for("fast"), router.cost_for("slow")
        # 24 answers with no queue: the anchor still weighs, the rates are far apart anyway.
        assert slow.prefill_tokens_per_s == pytest.approx(2_000.0, rel=0.5), slow
        assert fast.prefill_tokens_per_s > 4 * slow.prefill_tokens_per_s, (fast, slow)
        # A model no upstream lists gets a 404 and no fit.
        assert httpx.post(gateway.url + "/v1/completions", timeout=10, json={
            "model": "nobody", "prompt": "x", "max_tokens": 1}).status_code == 404
        assert sorted(router.fits) == ["fast", "slow"]
    finally:
        for engine in engines:
            engine.server.stop()


def upstream_speeds(gateway: RunningGateway) -> dict[str, float]:
    """``kvreuse_gateway_upstream_prefill_speed`` by upstream."""
    text = httpx.get(gateway.url + "/metrics", timeout=5).text
    return {sample.label("upstream"): sample.value for sample in parse_exposition(
        text, only=["kvreuse_gateway_upstream_prefill_speed"])}


@pytest.fixture
def one_slow_of_three() -> Iterator[list[Engine]]:
    """Engines f0 and f1 at 8,000 tokens a second, s2 at 2,000 (a degraded replica)."""
    engines = [start_engine(name, events=False, prefill_tokens_per_s=rate, overhead_s=0.005,
                            time_per_output_token_s=0.001, num_blocks=16_384)
               for name, rate in (("f0", 8_000.0), ("f1", 8_000.0), ("s2", 2_000.0))]
    yield engines
    for engine in engines:
        engine.server.stop()


def test_a_replica_slower_than_the_others_is_measured_and_weighed(
        one_slow_of_three: list[Engine], gateway_factory: Factory) -> None:
    """After 96 streamed answers the slow engine's measured speed is under half the others',
    /metrics and the admin API's listing say so, and its queue and own prefill are divided by
    it."""
    gateway = gateway_factory(one_slow_of_three)
    asyncio.run(warm_up(gateway.url, requests=96))
    speeds = upstream_speeds(gateway)
    assert set(speeds) == {"f0", "f1", "s2"}, speeds
    assert speeds["s2"] < 0.5 * min(speeds["f0"], speeds["f1"]), speeds
    listed = {u["name"]: u["prefill_speed"] for u in gateway.gateway.describe_upstreams()}
    assert listed == speeds
    slow = gateway.gateway.router.upstreams["s2"]
    slow.queued_prefill_tokens += 1000  # as if a request of 1,000 uncached tokens waited
    try:
        load = slow.load()
        assert load.queued_prefill_tokens == int(1000 / slow.speed)
        assert load.prefill_speed == slow.speed  # its own requests' prefill too
    finally:
        slow.queued_prefill_tokens -= 1000


def test_an_upstream_added_after_the_speeds_are_measured_is_weighed_at_the_fastest(
        one_slow_of_three: list[Engine], gateway_factory: Factory, tmp_path: Path) -> None:
    """f1, added through the admin API once f0 and the slow s2 are timed, is weighed at f0's
    speed until its own first tokens (not at the fleet's mean, half its true speed, which sent
    it too little to be timed), is sent requests, and is then measured alike with f0."""
    fast, added, slow = one_slow_of_three
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN_KEY)
    gateway = gateway_factory([fast, slow], admin_key_file=str(key_file))
    asyncio.run(warm_up(gateway.url, requests=64))
    router = gateway.gateway.router
    timed_fast, timed_slow = router.upstreams["f0"], router.upstreams["s2"]
    assert timed_slow.weight("sim") < 0.5 * timed_fast.weight("sim"), router.assumed_speeds
    answer = httpx.post(gateway.url + "/admin/upstreams", params={"wait": "10"}, timeout=30,
                        json={"url": added.server.url, "name": "f1"},
                        headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert answer.status_code == 201 and answer.json()["healthy"] is True, answer.text
    untimed = router.upstreams["f1"]
    assert "sim" not in untimed.model_speeds
    assert untimed.weight("sim") == timed_fast.weight("sim")
    assert untimed.load("sim").prefill_speed == timed_fast.weight("sim")
    asyncio.run(warm_up(gateway.url, requests=64))
    speeds = upstream_speeds(gateway)
    assert 0.6 < speeds["f1"] / speeds["f0"] < 1.6, speeds
    assert speeds["s2"] < 0.5 * min(speeds["f0"], speeds["f1"]), speeds


def test_fixed_prefill_measures_no_replicas_speed(
        one_slow_of_three: list[Engine], gateway_factory: Factory) -> None:
    """With learn_prefill off every upstream keeps speed 1: its configured weight alone."""
    gateway = gateway_factory(one_slow_of_three, learn_prefill=False)
    asyncio.run(warm_up(gateway.url, requests=24))
    assert upstream_speeds(gateway) == {"f0": 1.0, "f1": 1.0, "s2": 1.0}


def test_an_upstream_of_two_models_is_weighed_by_each_model_s_fleet(
        gateway_factory: Factory) -> None:
    """m1 (8,000 tokens/s) serves model a beside s0 (2,000) and model b beside f2 (8,000):
    a's requests see it faster than a's fleet, b's see it average, and its load is divided by
    the speed of the requesting model's fleet."""
    rates = (("s0", 2_000.0, ("a",)), ("m1", 8_000.0, ("a", "b")), ("f2", 8_000.0, ("b",)))
    engines = [start_engine(name, events=False, model=models[0], served_names=models,
                            prefill_tokens_per_s=rate, overhead_s=0.005,
                            time_per_output_token_s=0.001, num_blocks=16_384)
               for name, rate, models in rates]
    try:
        gateway = gateway_factory(engines)
        asyncio.run(warm_up(gateway.url, requests=160, models=("a", "b")))
        shared = gateway.gateway.router.upstreams["m1"]
        assert shared.model_speeds["a"] > 1.4, shared.model_speeds
        assert 0.7 < shared.model_speeds["b"] < 1.4, shared.model_speeds
        assert shared.load("a").prefill_speed == shared.model_speeds["a"]
        assert shared.load("b").prefill_speed == shared.model_speeds["b"]
        # People see one figure: the geometric mean over its models.
        assert upstream_speeds(gateway)["m1"] == pytest.approx(
            (shared.model_speeds["a"] * shared.model_speeds["b"]) ** 0.5)
        listed = {u["name"]: u for u in gateway.gateway.describe_upstreams()}
        assert listed["m1"]["prefill_speed_by_model"] == shared.model_speeds
        assert set(listed["s0"]["prefill_speed_by_model"]) == {"a"}
    finally:
        for engine in engines:
            engine.server.stop()
