"""Replica memory models: vLLM's block pool against the radix tree, and its KV events."""

from __future__ import annotations

import random

import pytest

from kvreuse.errors import ConfigError
from kvreuse.identity import CacheIdentity
from kvreuse.routing import CacheMirror, RequestView
from kvreuse.sim import ReplicaConfig, SimRequest
from kvreuse.sim.block_memory import BlockMemory
from kvreuse.sim.config import CACHE_KINDS
from kvreuse.sim.memory import Job
from kvreuse.sim.runner import run_scenario
from kvreuse.sim.scenarios import RunSpec, get_scenario
from kvreuse.tokens import TOKEN_BYTES, pack


def test_block_granularity_costs_tokens_on_six_turn() -> None:
    """vLLM blocks recompute each cached prefix's partial last block; the radix tree does not."""
    scenario = get_scenario("six-turn")
    radix, block = run_scenario(
        scenario, specs=[RunSpec("round_robin", 1), RunSpec("round_robin", 1, "block")]
    )
    size = scenario.fleet(1, "block").replica.block_size
    # Each turn's cached prefix under radix, rounded down to whole blocks, is what vLLM keeps.
    lost = sum(r.cached_tokens % size for r in radix.run.records)
    assert lost > 0
    prefilled = {
        kind: row.summary.prompt_tokens - row.summary.cached_tokens
        for kind, row in (("radix", radix), ("block", block))
    }
    assert prefilled["block"] == prefilled["radix"] + lost


def test_block_memory_rejects_a_pool_without_one_block() -> None:
    """A pool smaller than one block names the fix."""
    config = ReplicaConfig(pool_tokens=8, cache_kind="block", block_size=16)
    with pytest.raises(ConfigError, match="holds no 16-token block"):
        BlockMemory("r0", config, None)


def test_unknown_cache_kind_is_a_config_error() -> None:
    """cache_kind must name a memory model."""
    with pytest.raises(ConfigError, match="cache_kind must be one of"):
        ReplicaConfig(cache_kind="paged")


@pytest.mark.parametrize(("seed", "models"), [(1, ("",)), (2, ("",)), (3, ("",)),
                                             (4, ("a", "b")), (5, ("a", "b", "c"))])
def test_block_events_keep_an_exact_mirror(seed: int, models: tuple[str, ...]) -> None:
    """Seeded stress: the router's mirror, fed only by a block replica's translated events,
    predicts exactly what the block pool would hit for every prompt seen, through reuse, copies,
    eviction and sibling blocks sharing first tokens, also when the replica serves several
    models whose prompts share tokens (and so block hashes)."""
    rng = random.Random(seed)
    identities = [CacheIdentity(model=model) for model in models]
    mirror = CacheMirror(block_size=4)
    config = ReplicaConfig(pool_tokens=480, cache_kind="block", block_size=4)
    memory = BlockMemory("r0", config, mirror.apply)
    stems = [list(range(k * 1000, k * 1000 + rng.randint(8, 120))) for k in range(5)]
    running: list[Job] = []
    fresh = 10**7
    prompts = [stems[0]]
    for step in range(500):
        now = float(step)
        if running and (rng.random() < 0.45 or len(running) > 4):
            job = running.pop(rng.randrange(len(running)))
            if not job.prompt_cached and rng.random() < 0.5:
                memory.prefilled(job, now)
            memory.release(job, now)
        else:
            # A small alphabet half the time: blocks at one position then share first tokens.
            alphabet = rng.choice((3, 10**6))
            prompt = rng.choice(stems) + [rng.randrange(alphabet)
                                          for _ in range(rng.randint(1, 40))]
            prompts.append(prompt)
            output_len = rng.randint(0, 30)
            output = pack(list(range(fresh, fresh + output_len))) if rng.random() < 0.7 else None
            fresh += output_len
            request = SimRequest(step, now, pack(prompt), len(prompt), output_len, output,
                                 identity=rng.choice(identities))
            job = Job(request, "test", 0)
            if memory.admit(job, now):
                if rng.random() < 0.6:
                    memory.prefilled(job, now)
                running.append(job)
        memory.check_invariants()
        # A fresh last token keeps vLLM's "at most prompt - 1" rule from biting.
        probe = pack([*rng.choice(prompts), fresh + 10**6])
        for identity in identities:
            view = RequestView("p", probe, len(probe) // TOKEN_BYTES, identity)
            expected = memory.cache.match(probe, identity, touch=False).length
            assert mirror.predict(view, ["r0"], now)["r0"] == expected, f"step {step}"
    assert memory.evicted_tokens > 0, "the stress never evicted: make the pool smaller"
    mirror.check_invariants()


@pytest.mark.parametrize("kind", ["radix", "block"])
def test_cached_prefix_is_peek_without_touching(kind: str) -> None:
    """cached_prefix finds what peek finds, for either memory, and reading it leaves the cache
    as it was (the same tokens held and used)."""
    memory = CACHE_KINDS[kind]("r0", ReplicaConfig(pool_tokens=4096, cache_kind=kind,
                                                   block_size=16), None)
    rng = random.Random(7)
    shared = [rng.randrange(50) for _ in range(100)]
    served = [SimRequest(i, float(i), pack([*shared[: 40 + 20 * i], 1000 + i]), 41 + 20 * i, 1)
              for i in range(4)]
    for when, request in enumerate(served):
        job = Job(request, "test", 0)
        assert memory.admit(job, float(when))
        memory.prefilled(job, float(when))
        memory.release(job, float(when))
    queries = [*served, SimRequest(9, 9.0, pack([*shared[:70], 7, 7]), 72, 1),
               SimRequest(10, 9.0, pack([49 - t for t in shared[:30]]), 30, 1)]
    held = (memory.used_tokens, memory.evicted_tokens)
    found = [memory.cached_prefix(q) for q in queries]
    assert held == (memory.used_tokens, memory.evicted_tokens)
    assert found == [memory.peek(q, 99.0) for q in queries]
    assert max(found) > 0
