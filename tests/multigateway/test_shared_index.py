"""The shared approximate index: its pure part, its Redis encoding, two syncs over real Redis,
and its wiring into a gateway's policy (``--shared-index``)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.gateway.app import Gateway
from kvreuse.gateway.config import GatewayConfig, UpstreamConfig
from kvreuse.gateway.prompts import TextApproximation
from kvreuse.gateway.shared_index import (
    MAX_STREAM_ID,
    RedisIndexSync,
    RoutedRecord,
    SharedPrefixIndex,
    SyncStats,
    attach,
    decode_record,
    encode_record,
)
from kvreuse.identity import CacheIdentity
from kvreuse.routing import RequestView, block_chain
from kvreuse.testing.processes import Fleet, Process, wait_http
from kvreuse.tokens import pack

from .conftest import running


def view(tokens: list[int], salt: str | None = None) -> RequestView:
    buf = pack(tokens)
    return RequestView("r", buf, len(tokens), CacheIdentity(cache_salt=salt))


def test_predict_counts_whole_recorded_blocks() -> None:
    """A prompt routed to a replica predicts its full blocks there and nothing elsewhere."""
    index = SharedPrefixIndex(block_size=4)
    index.record(view(list(range(10))), "a", 0.0)
    assert index.predict(view(list(range(12))), ["a", "b"], 0.0) == {"a": 8, "b": 0}


def test_prediction_stops_at_the_first_divergent_block() -> None:
    """A prompt that differs inside block 2 matches only block 1."""
    index = SharedPrefixIndex(block_size=4)
    index.record(view(list(range(12))), "a", 0.0)
    assert index.predict(view([0, 1, 2, 3, 4, 99, 6, 7]), ["a"], 0.0) == {"a": 4}


def test_identity_namespaces_the_blocks() -> None:
    """Another salt never matches a salted tenant's prefix."""
    index = SharedPrefixIndex(block_size=4)
    index.record(view(list(range(8)), salt="tenant-a"), "a", 0.0)
    assert index.predict(view(list(range(8)), salt="tenant-b"), ["a"], 0.0) == {"a": 0}
    assert index.predict(view(list(range(8)), salt="tenant-a"), ["a"], 0.0) == {"a": 8}


def test_capacity_bounds_blocks_and_evicts_tails_before_roots() -> None:
    """Over capacity, the least recently used tail blocks go first; roots survive."""
    index = SharedPrefixIndex(block_size=2, capacity_blocks=5)
    shared = list(range(4))
    for conv in range(4):
        index.record(view([*shared, 100 + conv * 2, 101 + conv * 2]), "a", float(conv))
    index.check_invariants()
    assert index.cached_blocks("a") == 5
    assert index.predict(view(shared), ["a"], 9.0) == {"a": 4}
    assert index.evicted_blocks == 1


def test_seeded_stress_keeps_capacity_and_prefix_answers() -> None:
    """Random records keep the bound; a just-recorded prompt always fully matches."""
    rng = random.Random(5)
    index = SharedPrefixIndex(block_size=4, capacity_blocks=64)
    for step in range(500):
        tokens = [rng.randrange(20) for _ in range(rng.randrange(4, 40))]
        replica = f"r{rng.randrange(3)}"
        index.record(view(tokens), replica, float(step))
        full = len(tokens) // 4 * 4
        assert index.predict(view(tokens), [replica], float(step))[replica] == full
        index.check_invariants()


def test_record_round_trips_through_the_stream_encoding() -> None:
    """encode_record and decode_record are inverses."""
    record = RoutedRecord("u1", tuple(block_chain(pack(range(64)), CacheIdentity(), 16)), "gw1")
    assert decode_record("u1", {k.encode(): v for k, v in encode_record(record).items()}) == record


def test_malformed_stream_entry_names_the_problem() -> None:
    """A chain that is not whole uint64s is refused with the upstream named."""
    with pytest.raises(InputFormatError, match="upstream u1"):
        decode_record("u1", {b"o": b"gw", b"c": b"\x01\x02\x03"})


@contextlib.asynccontextmanager
async def two_syncs(redis_url: str, upstreams: list[str]
                    ) -> AsyncIterator[tuple[list[SharedPrefixIndex], list[RedisIndexSync], str]]:
    """Two gateways' indexes syncing through real Redis under a fresh key prefix, running
    (and bootstrapped) when the block starts; stopped and disconnected after it."""
    import redis.asyncio as aioredis

    indexes = [SharedPrefixIndex(block_size=4), SharedPrefixIndex(block_size=4)]
    prefix = f"test{random.randrange(1 << 30)}"
    syncs = [RedisIndexSync(index, aioredis.from_url(redis_url), upstreams, prefix=prefix,
                            block_ms=50) for index in indexes]
    async with running(syncs):
        yield indexes, syncs, prefix


def test_two_gateways_share_records_through_redis(redis: Process) -> None:
    """A record made on one gateway's index reaches the other's within a second."""

    async def scenario() -> tuple[dict[str, int], int]:
        async with two_syncs(redis.url, ["u1", "u2"]) as ((first, second), syncs, _):
            first.record(view(list(range(32))), "u2", 0.0)
            predicted: dict[str, int] = {}
            for _ in range(50):
                await asyncio.sleep(0.02)
                predicted = second.predict(view(list(range(32))), ["u1", "u2"], 0.0)
                if predicted["u2"]:
                    break
            return predicted, syncs[1].stats.received

    predicted, received = asyncio.run(scenario())
    assert predicted == {"u1": 0, "u2": 32}
    assert received == 1


def test_a_forged_entry_at_the_largest_id_stops_sharing_only_briefly(redis: Process) -> None:
    """An entry XADDed at Redis's largest id makes Redis refuse every later record to that
    stream; a writer deletes the stream, readers start it over, and sharing resumes."""
    import redis.asyncio as aioredis

    async def scenario() -> tuple[dict[str, int], list[SyncStats]]:
        async with two_syncs(redis.url, ["u1"]) as ((first, second), syncs, prefix):
            forger = aioredis.from_url(redis.url)
            await forger.xadd(f"{prefix}:routed:u1", {"forged": "1"}, id=MAX_STREAM_ID)
            await forger.aclose()
            await asyncio.sleep(0.2)  # both readers have read the forged entry
            predicted: dict[str, int] = {}
            for attempt in range(100):
                first.record(view(list(range(32))), "u1", float(attempt))
                await asyncio.sleep(0.05)
                predicted = second.predict(view(list(range(32))), ["u1"], 0.0)
                if predicted["u1"]:
                    break
            return predicted, [sync.stats for sync in syncs]

    predicted, stats = asyncio.run(scenario())
    assert predicted == {"u1": 32}
    assert stats[0].streams_reset == 1 and stats[0].dropped >= 1
    assert stats[1].malformed == 1 and stats[1].received >= 1


def test_models_never_share_records_through_redis(redis: Process) -> None:
    """A prompt routed for one model, shared through real Redis, predicts a hit on the other
    gateway for that model only: the model is part of every shared block hash."""

    def for_model(model: str) -> RequestView:
        return RequestView("r", pack(list(range(32))), 32, CacheIdentity(model=model))

    async def scenario() -> dict[str, dict[str, int]]:
        async with two_syncs(redis.url, ["u1"]) as ((first, second), syncs, _):
            first.record(for_model("model-a"), "u1", 0.0)
            for _ in range(50):
                await asyncio.sleep(0.02)
                if syncs[1].stats.received:
                    break
            return {model: second.predict(for_model(model), ["u1"], 0.0)
                    for model in ("model-a", "model-b", "")}

    predicted = asyncio.run(scenario())
    assert predicted == {"model-a": {"u1": 32}, "model-b": {"u1": 0}, "": {"u1": 0}}


def gateway(policy: str, **options: object) -> Gateway:
    """An in-process gateway (not served) in front of one upstream that publishes events."""
    upstreams = (UpstreamConfig("http://127.0.0.1:9", name="u0", events="tcp://127.0.0.1:9"),)
    return Gateway(GatewayConfig(upstreams=upstreams, policy=policy, policy_options=options),
                   tokenizer=TextApproximation())


@pytest.mark.parametrize("policy", ["cache_aware", "cache_aware_sglang", "cost",
                                    "relative_spill", "llm_d"])
def test_attach_shares_any_approximate_estimator(policy: str) -> None:
    """Every policy with an approximate estimator routes on the shared index once attached."""
    shared = gateway(policy)
    sync = attach(shared, "redis://127.0.0.1:9/0")
    assert shared.router.estimating is not None
    assert shared.router.estimating.estimator is sync.index


@pytest.mark.parametrize(("policy", "options"), [("round_robin", {}), ("exact", {}),
                                                 ("cost", {"estimator": "exact"})])
def test_attach_refuses_a_policy_with_nothing_to_share(policy: str,
                                                        options: dict[str, object]) -> None:
    """A cache-blind policy, or one on KV events, has no index to share: refused, named."""
    with pytest.raises(ConfigError, match=f"--shared-index .* {policy!r} has none"):
        attach(gateway(policy, **options), "redis://127.0.0.1:9/0")


def received(gateway: Process) -> float:
    text = httpx.get(gateway.url + "/metrics", timeout=5).text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == "kvreuse_gateway_shared_index_received_total")


def test_cost_gateways_share_their_index_through_redis(
        fleet: Fleet, engines: list[Process], redis: Process) -> None:
    """Two `kvreuse route --policy cost --shared-index` processes: a prompt routed by the
    first is predicted cached, on the same engine, by the second."""
    first, second = (fleet.start_gateway(f"gw-cost-{i}", engines, policy="cost",
                                         shared_index=redis.url, wait=False) for i in range(2))
    try:
        for started in (first, second):
            wait_http(started)
        prompt = f"{uuid.uuid4().hex} cost routing on a shared index " * 20
        body = {"model": "sim", "prompt": prompt, "max_tokens": 1}
        sent = httpx.post(first.url + "/v1/completions", json=body, timeout=10)
        assert sent.status_code == 200
        deadline = time.monotonic() + 15
        while received(second) < 1:
            assert time.monotonic() < deadline, "the second gateway never heard the record"
            time.sleep(0.1)
        body["prompt"] = prompt + " and a question after it"
        follow = httpx.post(second.url + "/v1/completions", json=body, timeout=10)
        assert follow.status_code == 200
        assert follow.headers["x-kvreuse-upstream"] == sent.headers["x-kvreuse-upstream"]
        assert int(follow.headers["x-kvreuse-predicted-cached-tokens"]) >= 16
    finally:
        fleet.forget(first)
        fleet.forget(second)
