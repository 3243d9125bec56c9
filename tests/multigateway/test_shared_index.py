"""The shared approximate index: its pure part, its Redis encoding, two syncs over real Redis."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvreuse.errors import InputFormatError
from kvreuse.gateway.shared_index import (
    RedisIndexSync,
    RoutedRecord,
    SharedPrefixIndex,
    block_chain,
    decode_record,
    encode_record,
)
from kvreuse.identity import CacheIdentity
from kvreuse.routing import RequestView
from kvreuse.testing.processes import Process
from kvreuse.tokens import pack


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
    assert index.size_blocks("a") == 5
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


def test_two_gateways_share_records_through_redis(redis: Process) -> None:
    """A record made on one gateway's index reaches the other's within a second."""
    import redis.asyncio as aioredis

    async def scenario() -> tuple[dict[str, int], int]:
        first, second = SharedPrefixIndex(block_size=4), SharedPrefixIndex(block_size=4)
        prefix = f"test{random.randrange(1 << 30)}"
        syncs = [RedisIndexSync(index, aioredis.from_url(redis.url), ["u1", "u2"],
                                prefix=prefix, block_ms=50) for index in (first, second)]
        tasks = [asyncio.create_task(sync.run()) for sync in syncs]
        await asyncio.sleep(0.2)
        first.record(view(list(range(32))), "u2", 0.0)
        predicted: dict[str, int] = {}
        for _ in range(50):
            await asyncio.sleep(0.02)
            predicted = second.predict(view(list(range(32))), ["u1", "u2"], 0.0)
            if predicted["u2"]:
                break
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sync in syncs:
            await sync.client.aclose()
        return predicted, syncs[1].stats.received

    predicted, received = asyncio.run(scenario())
    assert predicted == {"u1": 0, "u2": 32}
    assert received == 1


def test_models_never_share_records_through_redis(redis: Process) -> None:
    """A prompt routed for one model, shared through real Redis, predicts a hit on the other
    gateway for that model only: the model is part of every shared block hash."""
    import redis.asyncio as aioredis

    def for_model(model: str) -> RequestView:
        return RequestView("r", pack(list(range(32))), 32, CacheIdentity(model=model))

    async def scenario() -> dict[str, dict[str, int]]:
        first, second = SharedPrefixIndex(block_size=4), SharedPrefixIndex(block_size=4)
        prefix = f"test{random.randrange(1 << 30)}"
        syncs = [RedisIndexSync(index, aioredis.from_url(redis.url), ["u1"], prefix=prefix,
                                block_ms=50) for index in (first, second)]
        tasks = [asyncio.create_task(sync.run()) for sync in syncs]
        await asyncio.sleep(0.2)
        first.record(for_model("model-a"), "u1", 0.0)
        for _ in range(50):
            await asyncio.sleep(0.02)
            if syncs[1].stats.received:
                break
        out = {model: second.predict(for_model(model), ["u1"], 0.0)
               for model in ("model-a", "model-b", "")}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sync in syncs:
            await sync.client.aclose()
        return out

    predicted = asyncio.run(scenario())
    assert predicted == {"model-a": {"u1": 32}, "model-b": {"u1": 0}, "": {"u1": 0}}
