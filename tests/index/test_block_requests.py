"""vLLM's per-request block flow on the block index: allocate, cache as computed, free."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvreuse.errors import ConfigError, IndexStateError
from kvreuse.identity import CacheIdentity
from kvreuse.index import BlockIndex
from kvreuse.index.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvreuse.index.hashing import DEFAULT_NONE_HASH_SEED, block_hashes


def seq(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def test_admission_takes_hit_and_new_blocks() -> None:
    """A 70-token prompt with 64 cached holds the 4 hit blocks and gets 1 new one."""
    index = BlockIndex(num_blocks=16)
    index.insert(seq(0, 64))
    hit = index.match(seq(0, 70), touch=False)
    new = index.allocate_slots("r1", 70, match=hit)
    assert new is not None and len(new) == 1
    assert index.request_block_ids("r1") == (*hit.block_ids, *new)
    assert index.protected_tokens == 80 and index.evictable_tokens == 0
    index.check_invariants()


def test_backpressure_returns_none_and_changes_nothing() -> None:
    """Too few free blocks: None, and the request is not admitted."""
    index = BlockIndex(num_blocks=4)
    assert index.allocate_slots("r1", 64) is None
    assert not index.requests and index.pool.num_free_blocks == 3
    index.check_invariants()


def test_free_hit_blocks_count_against_free_space() -> None:
    """Touching free cached hit blocks uses free space, as vLLM's allocate_slots counts it."""
    index = BlockIndex(num_blocks=5)
    index.insert(seq(0, 48))
    hit = index.match(seq(0, 49), touch=False)
    assert index.allocate_slots("r1", 80, match=hit) is None
    assert index.allocate_slots("r1", 64, match=hit) is not None
    index.check_invariants()


def test_cache_blocks_emits_chained_block_stored() -> None:
    """Blocks cached during decode extend the chain with the right parent and tokens."""
    events: list[KVCacheEvent] = []
    index = BlockIndex(num_blocks=16, on_event=events.append)
    prompt = seq(0, 40)
    index.allocate_slots("r1", 40)
    assert index.cache_blocks("r1", prompt) == 32
    tokens = [*prompt, *seq(900, 10)]
    index.allocate_slots("r1", len(tokens))
    assert index.cache_blocks("r1", tokens) == 16
    hashes = block_hashes(tokens)
    assert events[-1] == BlockStored(
        (hashes[2],), hashes[1], tuple(tokens[32:48]), 16, None, (None,)
    )
    assert index.requests["r1"].hashes == hashes
    index.check_invariants()


def test_only_computed_tokens_are_cached() -> None:
    """num_computed_tokens limits caching to blocks whose KV exists (chunked prefill)."""
    index = BlockIndex(num_blocks=16)
    index.allocate_slots("r1", 64)
    assert index.cache_blocks("r1", seq(0, 64), num_computed_tokens=20) == 16
    assert index.cache_blocks("r1", seq(0, 64), num_computed_tokens=64) == 48


def test_recomputed_last_block_is_cached_again() -> None:
    """A fully cached 64-token prompt recomputes its last block, which vLLM caches as a
    duplicate under the same hash."""
    index = BlockIndex(num_blocks=16)
    index.insert(seq(0, 64))
    hit = index.match(seq(0, 64), touch=False)
    assert hit.length == 48
    index.allocate_slots("r1", 64, match=hit)
    assert index.cache_blocks("r1", seq(0, 64)) == 16
    assert index.pool.num_cached_blocks == 5
    index.free_request("r1")
    index.check_invariants()


def test_running_blocks_are_not_evictable() -> None:
    """A running request's cached blocks stay until it is freed."""
    index = BlockIndex(num_blocks=8)
    index.allocate_slots("r1", 32)
    index.cache_blocks("r1", seq(0, 32))
    assert index.evict(100) == 0
    index.free_request("r1")
    assert index.evict(100) == 32
    index.check_invariants()


def test_free_request_frees_tail_first() -> None:
    """After a request finishes, its last block is the first evicted."""
    index = BlockIndex(num_blocks=8)
    index.allocate_slots("r1", 48)
    index.cache_blocks("r1", seq(0, 48))
    index.free_request("r1")
    index.evict(1)
    assert index.match(seq(0, 49)).length == 32


def test_identity_from_match_is_kept() -> None:
    """A salted request caches salted hashes."""
    salted = CacheIdentity(cache_salt="t")
    index = BlockIndex(num_blocks=8)
    hit = index.match(seq(0, 33), salted, touch=False)
    index.allocate_slots("r1", 33, match=hit)
    index.cache_blocks("r1", seq(0, 33))
    assert index.requests["r1"].hashes == block_hashes(seq(0, 33), cache_salt="t")


def test_request_errors_name_the_fix() -> None:
    """Unknown requests, a second match and bad counts are rejected with the fix named."""
    index = BlockIndex(num_blocks=8)
    with pytest.raises(IndexStateError, match="allocate_slots first"):
        index.cache_blocks("nope", seq(0, 16))
    hit = index.match(seq(0, 16), touch=False)
    index.allocate_slots("r1", 16)
    with pytest.raises(IndexStateError, match="first call"):
        index.allocate_slots("r1", 32, match=hit)
    with pytest.raises(ConfigError, match="num_computed_tokens"):
        index.cache_blocks("r1", seq(0, 16), num_computed_tokens=17)
    with pytest.raises(ConfigError, match="identity"):
        index.allocate_slots("r2", 16, match=hit, identity=CacheIdentity(cache_salt="x"))


@pytest.mark.parametrize("seed", range(5))
def test_stress_engine_flow_keeps_invariants(seed: int) -> None:
    """A random engine loop (admit, decode, finish, probe, evict) keeps every invariant."""
    rng = random.Random(seed)
    index = BlockIndex(num_blocks=20, block_size=4)
    systems = [[rng.randrange(30) for _ in range(rng.randint(0, 16))] for _ in range(3)]
    running: dict[int, list[int]] = {}
    for step in range(400):
        op = rng.randrange(4)
        if op == 0:
            prompt = [*rng.choice(systems), *(rng.randrange(30) for _ in range(rng.randint(1, 9)))]
            hit = index.match(prompt, touch=False)
            if index.allocate_slots(step, len(prompt), match=hit) is not None:
                index.cache_blocks(step, prompt, num_computed_tokens=len(prompt))
                running[step] = prompt
        elif op == 1 and running:
            rid = rng.choice(list(running))
            tokens = running[rid]
            if index.allocate_slots(rid, len(tokens) + 1) is not None:
                tokens.append(rng.randrange(30))
                index.cache_blocks(rid, tokens)
        elif op == 2 and running:
            rid = rng.choice(list(running))
            assert index.requests[rid].hashes == index.block_hashes(running.pop(rid))
            index.free_request(rid)
        else:
            index.evict(rng.randint(0, 12))
        index.check_invariants()


TRACES = json.loads((Path(__file__).parent / "vectors" / "vllm_pool_trace.json").read_text())


def event_json(event: KVCacheEvent) -> dict[str, Any]:
    """Our event in the trace's form (the 64-bit hashes vLLM publishes)."""
    if isinstance(event, BlockStored):
        return {
            "type": "stored",
            "hashes": list(event.int_block_hashes),
            "parent": event.int_parent_block_hash,
            "tokens": list(event.token_ids),
            "block_size": event.block_size,
            "lora_name": event.lora_name,
            "extra_keys": [None if k is None else list(k) for k in event.extra_keys or ()],
        }
    if isinstance(event, BlockRemoved):
        return {"type": "removed", "hashes": list(event.int_block_hashes)}
    assert isinstance(event, AllBlocksCleared)
    return {"type": "cleared"}


@pytest.mark.parametrize("trace", TRACES["traces"], ids=lambda t: f"seed{t['seed']}")
def test_replays_vllm_block_pool_trace(trace: dict[str, Any]) -> None:
    """Admissions, decode steps, frees, connector evictions and resets recorded from vLLM's own
    BlockPool give the same hits, block ids, free-queue order and KV events here."""
    assert TRACES["vllm_version"] == "0.32.0"
    events: list[KVCacheEvent] = []
    index = BlockIndex(
        num_blocks=trace["num_blocks"],
        block_size=trace["block_size"],
        none_hash_seed=DEFAULT_NONE_HASH_SEED,
        lora_paths=trace["lora_paths"],
        on_event=events.append,
    )
    tokens_of: dict[int, list[int]] = {}
    for number, step in enumerate(trace["steps"]):
        where = f"step {number}: {step['op']}"
        op = step["op"]
        if op == "admit":
            ident = step["identity"]
            identity = CacheIdentity(adapter=ident.get("lora"), cache_salt=ident.get("cache_salt"))
            hit = index.match(step["tokens"], identity, touch=False)
            assert list(hit.block_ids) == step["hit_blocks"], where
            new = index.allocate_slots(step["rid"], len(step["tokens"]), match=hit)
            assert (None if new is None else list(new)) == step["new_blocks"], where
            if new is not None:
                index.cache_blocks(step["rid"], step["tokens"])
                tokens_of[step["rid"]] = list(step["tokens"])
        elif op == "append":
            tokens = tokens_of[step["rid"]]
            new = index.allocate_slots(step["rid"], len(tokens) + 1)
            assert (None if new is None else list(new)) == step["new_blocks"], where
            if new is not None:
                tokens.append(step["token"])
                index.cache_blocks(step["rid"], tokens)
        elif op == "free":
            index.free_request(step["rid"])
        elif op == "evict_blocks":
            index.pool.evict_blocks([step["block_id"]])
        else:
            assert index.pool.reset_prefix_cache() == step["ok"], where
        assert [b.block_id for b in index.pool.free_queue()] == step["queue"], where
        assert [event_json(e) for e in events] == step["events"], where
        events.clear()
        index.check_invariants()
