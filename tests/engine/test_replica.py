"""The simulated replica: vLLM hit rules, the TTFT model, salts, KV capacity, events."""

from __future__ import annotations

import asyncio

import pytest

from kvreuse.engine.replica import EngineConfig, SimulatedReplica
from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.identity import CacheIdentity
from kvreuse.index.events import BlockStored, KVCacheEvent
from kvreuse.tokens import TokenBuffer, pack

PLAIN = CacheIdentity()


def config(**overrides: object) -> EngineConfig:
    fields: dict[str, object] = {"block_size": 16, "num_blocks": 64, "prefill_tokens_per_s": 1e5,
                                 "overhead_s": 0.001, "time_per_output_token_s": 0.0}
    fields.update(overrides)
    return EngineConfig(**fields)  # type: ignore[arg-type]


async def serve(replica: SimulatedReplica, tokens: TokenBuffer, identity: CacheIdentity = PLAIN,
                max_tokens: int = 4) -> int:
    request_id = replica.new_request_id()
    prefilled = await replica.prefill(request_id, tokens, identity, max_tokens)
    output = [t async for t in replica.decode(max_tokens, [9])]
    await replica.finish(request_id, tokens, output)
    return prefilled.cached_tokens


def test_repeat_prompt_hits_whole_blocks_but_the_last_token() -> None:
    """A repeated 200-token prompt reuses 192 tokens (vLLM: num_tokens - 1, whole blocks)."""
    replica = SimulatedReplica(config())
    prompt = pack(range(200))

    async def run() -> list[int]:
        return [await serve(replica, prompt), await serve(replica, prompt)]

    assert asyncio.run(run()) == [0, 192]
    assert replica.counters.queries == 400 and replica.counters.hits == 192


def test_next_turn_matches_through_the_cached_answer() -> None:
    """At finish prompt and output are cached, so a follow-up hits past the old prompt."""
    replica = SimulatedReplica(config())
    first = list(range(40))

    async def run() -> int:
        await serve(replica, pack(first), max_tokens=24)  # 40 + 24 = 64 tokens = 4 blocks
        return await serve(replica, pack(first + [9] * 24 + [1, 2, 3]))

    assert asyncio.run(run()) == 64


def test_cache_salt_isolates() -> None:
    """Only a request with the same salt reuses a salted prefix."""
    replica = SimulatedReplica(config())
    prompt = pack(range(100))
    a, b = CacheIdentity(cache_salt="a"), CacheIdentity(cache_salt="b")

    async def run() -> list[int]:
        await serve(replica, prompt, a)
        return [await serve(replica, prompt, b), await serve(replica, prompt, a)]

    assert asyncio.run(run()) == [0, 96]


def test_prefill_time_is_overhead_plus_uncached_over_rate() -> None:
    """prefill_s = overhead + uncached / rate; a queued request waits for the one ahead."""
    replica = SimulatedReplica(config(prefill_tokens_per_s=2000.0, overhead_s=0.01))
    prompt = pack(range(100))

    async def run() -> tuple[float, float, float]:
        first = asyncio.create_task(replica.prefill("a", prompt, PLAIN, 1))
        await asyncio.sleep(0)
        second = await replica.prefill("b", pack(range(1000, 1100)), PLAIN, 1)
        done = await first
        return done.prefill_s, second.prefill_s, second.queued_s

    first_s, second_s, queued_s = asyncio.run(run())
    assert first_s == pytest.approx(0.01 + 100 / 2000)
    assert second_s == pytest.approx(first_s)
    assert queued_s >= first_s * 0.9


def test_a_request_waits_for_blocks_and_one_too_big_is_refused() -> None:
    """When running requests hold every block a new one waits; one that can never fit is a
    caller error naming max_tokens."""
    replica = SimulatedReplica(config(num_blocks=5))  # 4 usable blocks of 16

    async def run() -> str:
        await replica.prefill("a", pack(range(40)), PLAIN, 8)  # 3 blocks held
        waiter = asyncio.create_task(replica.prefill("b", pack(range(100, 130)), PLAIN, 2))
        await asyncio.sleep(0.05)
        state = f"waiting={replica.waiting}"
        await replica.finish("a", pack(range(40)), [0] * 8)
        await waiter
        return state

    assert asyncio.run(run()) == "waiting=1"
    with pytest.raises(InputFormatError, match="max_tokens"):
        asyncio.run(replica.prefill("c", pack(range(60)), PLAIN, 20))


def test_events_are_published_after_prefill_and_finish() -> None:
    """Full blocks are announced as BlockStored with the prompt's token ids."""
    published: list[list[KVCacheEvent]] = []

    async def sink(events: list[KVCacheEvent], now: float) -> None:
        published.append(events)

    replica = SimulatedReplica(config(), on_events=sink)
    asyncio.run(serve(replica, pack(range(40)), max_tokens=8))
    stored = [e for batch in published for e in batch if isinstance(e, BlockStored)]
    assert stored[0].token_ids == tuple(range(32)) and stored[0].parent_block_hash is None
    assert sum(len(e.block_hashes) for e in stored) == 3  # 48 tokens after the answer


@pytest.mark.parametrize(
    ("options", "needle"),
    [({"prefill_tokens_per_s": float("nan")}, "prefill_tokens_per_s"),
     ({"prefill_tokens_per_s": float("inf")}, "prefill_tokens_per_s"),
     ({"overhead_s": float("inf")}, "finite"),
     ({"time_per_output_token_s": float("nan")}, "finite"),
     ({"max_model_len": 0}, "max_model_len"),
     ({"served_names": ("a", " ")}, "must not be empty"),
     ({"model": ""}, "must not be empty")],
)
def test_engine_config_refuses_values_no_replica_could_run_with(
    options: dict[str, object], needle: str,
) -> None:
    """NaN or infinite rates and times, a zero context and empty model names are refused."""
    with pytest.raises(ConfigError, match=needle):
        EngineConfig(**options)  # type: ignore[arg-type]
