"""Behaviour of the vLLM-compatible block index, one behaviour per test."""

from __future__ import annotations

import random

import pytest

from kvreuse.errors import ConfigError, IndexStateError
from kvreuse.identity import CacheIdentity
from kvreuse.index import BlockIndex, BlockMatch
from kvreuse.index.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvreuse.index.hashing import block_hash_to_int, block_hashes
from kvreuse.tokens import pack


def checked(index: BlockIndex) -> BlockIndex:
    index.check_invariants()
    return index


def seq(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def test_seed_004_seventy_shared_tokens_reuse_64() -> None:
    """A prompt sharing 70 leading tokens with a cached one reuses 4 full blocks (seed 004)."""
    index = BlockIndex(num_blocks=32)
    shared = seq(0, 70)
    index.insert([*shared, *seq(1000, 30)])
    assert index.match([*shared, *seq(5000, 20)]).length == 64
    checked(index)


def test_fully_cached_prompt_recomputes_last_block() -> None:
    """A 64-token prompt that is fully cached reuses 48: the last token must be recomputed."""
    index = BlockIndex(num_blocks=32)
    index.insert(seq(0, 64))
    assert index.match(seq(0, 64)).length == 48
    assert index.match(seq(0, 65)).length == 64
    checked(index)


def test_partial_block_is_not_cached() -> None:
    """Only full blocks are stored: 15 tokens store nothing, 40 store 32."""
    index = BlockIndex(num_blocks=8)
    assert index.insert(seq(0, 15)) == 0
    assert index.insert(seq(0, 40)) == 32
    assert checked(index).total_tokens == 32


def test_insert_returns_new_tokens_only() -> None:
    """A second insert of a cached prefix stores only its new blocks."""
    index = BlockIndex(num_blocks=16)
    assert index.insert(seq(0, 64)) == 64
    assert index.insert(seq(0, 96)) == 32
    assert index.insert(seq(0, 96)) == 0
    checked(index)


def test_match_requires_first_block() -> None:
    """A prompt differing at token 0 reuses nothing, however much follows."""
    index = BlockIndex(num_blocks=16)
    index.insert(seq(0, 80))
    assert index.match([999, *seq(1, 79)]).length == 0


def test_match_stops_at_first_missing_block() -> None:
    """With block 1 evicted, later cached blocks are unreachable."""
    index = BlockIndex(num_blocks=16)
    index.insert(seq(0, 64))
    hit = index.match(seq(0, 65))
    index.pool.evict_blocks([hit.block_ids[1]])
    assert index.match(seq(0, 65)).length == 16
    checked(index)


def test_match_reports_blocks_and_vllm_hashes() -> None:
    """The match names its blocks and their hashes, which are vLLM's hashes of the prompt."""
    index = BlockIndex(num_blocks=16)
    index.insert(seq(0, 48))
    hit = index.match(seq(0, 49))
    assert hit.block_hashes == tuple(block_hashes(seq(0, 48)))
    assert len(hit.block_ids) == 3 and hit.handle is hit


def test_token_buffer_and_list_agree() -> None:
    """Packed buffers and lists hash and match identically."""
    index = BlockIndex(num_blocks=16)
    index.insert(pack(seq(0, 64)))
    assert index.match(seq(0, 70)).length == 64
    assert index.match(pack(seq(0, 70))).length == 64


@pytest.mark.parametrize(
    "other",
    [
        CacheIdentity(cache_salt="tenant-b"),
        CacheIdentity(adapter="sql"),
        CacheIdentity(model="llama-3-8b"),
        CacheIdentity(template_revision="v2"),
        CacheIdentity(extra_keys=("image-hash",)),
    ],
)
def test_identities_never_share_blocks(other: CacheIdentity) -> None:
    """Salt, adapter, model, template revision and extra keys each separate the cache."""
    index = BlockIndex(num_blocks=16)
    index.insert(seq(0, 64))
    assert index.match(seq(0, 64), other).length == 0
    index.insert(seq(0, 64), other)
    assert index.match(seq(0, 64), other).length == 48
    assert index.match(seq(0, 64)).length == 48
    checked(index)


def test_model_namespace_keeps_vllm_hashes() -> None:
    """A model name namespaces the map but leaves the block hashes exactly vLLM's."""
    index = BlockIndex(num_blocks=16)
    ident = CacheIdentity(model="llama-3-8b")
    index.insert(seq(0, 32), ident)
    assert index.match(seq(0, 33), ident).block_hashes == tuple(block_hashes(seq(0, 32)))


def test_salt_and_adapter_hash_like_vllm() -> None:
    """Identity salt and adapter become vLLM's salt and LoRA keys (path from lora_paths)."""
    index = BlockIndex(num_blocks=16, lora_paths={"sql": "/adapters/sql"})
    ident = CacheIdentity(adapter="sql", cache_salt="t1")
    index.insert(seq(0, 32), ident)
    expected = block_hashes(seq(0, 32), lora_name="sql", lora_path="/adapters/sql", cache_salt="t1")
    assert index.match(seq(0, 33), ident).block_hashes == tuple(expected)


def test_lock_protects_from_eviction() -> None:
    """Locked blocks survive eviction pressure; unlocking makes them evictable again."""
    index = BlockIndex(num_blocks=5)
    index.insert(seq(0, 32))
    hit = index.match(seq(0, 33))
    index.lock(hit)
    assert checked(index).protected_tokens == 32 and index.evictable_tokens == 0
    assert index.evict(64) == 0
    assert index.insert(seq(500, 64)) == 32
    assert index.match(seq(0, 33)).length == 32
    index.unlock(hit)
    assert checked(index).protected_tokens == 0
    assert index.evict(1000) == 64


def test_exact_eviction_order_tail_first() -> None:
    """A request's blocks are evicted tail first, one block per step."""
    index = BlockIndex(num_blocks=8)
    index.insert(seq(0, 64))
    for remaining in (48, 32, 16, 0):
        assert index.evict(1) == 16
        assert index.match(seq(0, 65)).length == remaining
        checked(index)


def test_shared_head_outlives_private_tails() -> None:
    """Two prompts sharing a system prompt: both tails go before the shared head."""
    index = BlockIndex(num_blocks=16)
    system = seq(0, 32)
    a, b = [*system, *seq(100, 32)], [*system, *seq(200, 32)]
    index.insert(a)
    index.insert(b)
    assert index.evict(32) == 32
    assert index.match([*a, 1]).length == 32
    assert index.match([*b, 1]).length == 64
    assert index.evict(32) == 32
    assert index.match([*b, 1]).length == 32
    assert index.evict(16) == 16
    assert index.match([*b, 1]).length == 16
    checked(index)


def test_match_touch_refreshes_lru() -> None:
    """A touched match moves its blocks behind later insertions; touch=False does not."""
    index = BlockIndex(num_blocks=16)
    index.insert(seq(0, 32))
    index.insert(seq(100, 32))
    index.match(seq(0, 33))
    index.evict(32)
    assert index.match(seq(0, 33)).length == 32
    assert index.match(seq(100, 33)).length == 0
    index.insert(seq(100, 32))
    index.match(seq(0, 33), touch=False)
    index.evict(32)
    assert index.match(seq(0, 33)).length == 0


def test_insert_evicts_least_recent_when_full() -> None:
    """With every block used, an insert evicts the least recently freed cached blocks."""
    index = BlockIndex(num_blocks=5)
    index.insert(seq(0, 32))
    index.insert(seq(100, 32))
    assert index.insert(seq(200, 32)) == 32
    assert index.match(seq(0, 33)).length == 0
    assert index.match(seq(100, 33)).length == 32
    assert index.evicted_tokens_total == 32
    checked(index)


def test_insert_under_locks_stores_a_prefix() -> None:
    """When locks leave too few free blocks, only the first missing blocks are stored."""
    index = BlockIndex(num_blocks=4)
    index.insert(seq(0, 32))
    index.lock(index.match(seq(0, 33)))
    assert index.insert(seq(100, 48)) == 16
    assert index.match(seq(100, 49)).length == 16
    checked(index)


def test_lock_of_evicted_match_is_an_error() -> None:
    """Locking a match whose blocks were evicted since raises, naming the fix."""
    index = BlockIndex(num_blocks=8)
    index.insert(seq(0, 32))
    hit = index.match(seq(0, 33))
    index.evict(100)
    with pytest.raises(IndexStateError, match="match again"):
        index.lock(hit)


def test_unlock_without_lock_is_an_error() -> None:
    """Unlocking a handle that holds no lock raises."""
    index = BlockIndex(num_blocks=8)
    index.insert(seq(0, 32))
    with pytest.raises(IndexStateError, match="without a matching lock"):
        index.unlock(index.match(seq(0, 33)))


def test_foreign_handle_is_an_error() -> None:
    """A radix node or other object is not a block-index handle."""
    index = BlockIndex(num_blocks=8)
    with pytest.raises(IndexStateError, match="BlockMatch"):
        index.lock("node")  # type: ignore[arg-type]


def test_evict_frees_whole_blocks() -> None:
    """evict rounds up to whole blocks and returns what it freed, never more than held."""
    index = BlockIndex(num_blocks=8)
    index.insert(seq(0, 48))
    assert index.evict(0) == 0
    assert index.evict(17) == 32
    assert index.evict(100) == 16
    assert checked(index).total_tokens == 0


def test_totals_add_up() -> None:
    """total = evictable + protected, in whole blocks."""
    index = BlockIndex(num_blocks=16)
    index.insert(seq(0, 64))
    index.lock(index.match(seq(0, 33)))
    assert (index.total_tokens, index.evictable_tokens, index.protected_tokens) == (64, 32, 32)


def test_config_errors_name_the_parameter() -> None:
    """Bad block size, block count or algorithm are ConfigErrors naming what to change."""
    with pytest.raises(ConfigError, match="block_size"):
        BlockIndex(num_blocks=8, block_size=0)
    with pytest.raises(ConfigError, match="num_blocks"):
        BlockIndex(num_blocks=1)
    with pytest.raises(ConfigError, match="algorithm"):
        BlockIndex(num_blocks=8, algorithm="md5")


def test_insert_emits_block_stored_like_vllm() -> None:
    """An insert emits one BlockStored per run of new blocks with vLLM's hashes and tokens."""
    events: list[KVCacheEvent] = []
    index = BlockIndex(num_blocks=16, on_event=events.append)
    index.insert(seq(0, 32))
    index.insert(seq(0, 70))
    hashes = block_hashes(seq(0, 70))
    assert events == [
        BlockStored(tuple(hashes[:2]), None, tuple(seq(0, 32)), 16, None, (None, None)),
        BlockStored(tuple(hashes[2:]), hashes[1], tuple(seq(32, 32)), 16, None, (None, None)),
    ]
    assert events[1].int_parent_block_hash == block_hash_to_int(hashes[1])


def test_events_carry_lora_name_and_untagged_keys() -> None:
    """LoRA and salt reach the event untagged, salt on the first block only."""
    events: list[KVCacheEvent] = []
    index = BlockIndex(num_blocks=16, on_event=events.append)
    index.insert(seq(0, 32), CacheIdentity(adapter="sql", cache_salt="t"))
    (stored,) = events
    assert isinstance(stored, BlockStored)
    assert stored.lora_name == "sql"
    assert stored.extra_keys == (("sql", "t"), ("sql",))


def test_eviction_and_reset_emit_events() -> None:
    """Evicting a cached block emits BlockRemoved; reset emits AllBlocksCleared."""
    events: list[KVCacheEvent] = []
    index = BlockIndex(num_blocks=16, on_event=events.append)
    index.insert(seq(0, 32))
    events.clear()
    index.evict(16)
    assert events == [BlockRemoved((block_hashes(seq(0, 32))[1],))]
    index.reset()
    assert events[-1] == AllBlocksCleared()
    assert checked(index).total_tokens == 0


@pytest.mark.parametrize("name_keys", [False, True])
def test_events_name_models_apart_only_when_asked(name_keys: bool) -> None:
    """Two models caching the same tokens publish vLLM's one hash for both, unless the index
    names blocks by their namespaced keys (a simulated engine serving several models)."""
    events: list[KVCacheEvent] = []
    index = BlockIndex(num_blocks=3, on_event=events.append, events_name_keys=name_keys)
    for model in ("a", "b"):
        index.insert(seq(0, 16), CacheIdentity(model=model))
    index.evict(16)
    stored = [e.block_hashes for e in events if isinstance(e, BlockStored)]
    removed = [e.block_hashes for e in events if isinstance(e, BlockRemoved)]
    assert len(stored) == 2 and len(removed) == 1
    assert (stored[0] != stored[1]) is name_keys
    assert removed[0] == stored[0]  # the block cached first is evicted first
    assert (removed[0] == tuple(block_hashes(seq(0, 16)))) is not name_keys


def test_reset_drops_locks() -> None:
    """reset empties the cache even while blocks are locked (an engine restart)."""
    index = BlockIndex(num_blocks=8)
    index.insert(seq(0, 32))
    index.lock(index.match(seq(0, 33)))
    index.reset()
    assert index.match(seq(0, 33)).length == 0
    assert checked(index).protected_tokens == 0


def test_check_invariants_catches_unrecorded_reference() -> None:
    """A block referenced by nobody the index knows of is reported."""
    index = BlockIndex(num_blocks=8)
    index.insert(seq(0, 32))
    index.pool.touch([index.pool.blocks[1]])
    with pytest.raises(AssertionError, match="holders recorded"):
        index.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_stress_invariants_hold_after_every_operation(seed: int) -> None:
    """Random matches, locks, inserts and evictions keep every invariant and vLLM's hit rules."""
    rng = random.Random(seed)
    index = BlockIndex(num_blocks=24, block_size=4)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(0, 20))] for _ in range(5)]
    identities = [None, CacheIdentity(cache_salt="s"), CacheIdentity(adapter="a")]
    locked: list[BlockMatch] = []
    for _ in range(500):
        tokens = [*rng.choice(prefixes), *(rng.randrange(50) for _ in range(rng.randint(0, 12)))]
        ident = rng.choice(identities)
        op = rng.randrange(5)
        if op == 0:
            hit = index.match(tokens, ident, touch=rng.random() < 0.5)
            assert hit.length % 4 == 0 and hit.length <= max(len(tokens) - 1, 0)
            assert hit.block_hashes == tuple(
                index.block_hashes(tokens, ident)[: len(hit.block_ids)]
            )
        elif op == 1:
            hit = index.match(tokens, ident)
            index.lock(hit)
            locked.append(hit)
        elif op == 2 and locked:
            index.unlock(locked.pop(rng.randrange(len(locked))))
        elif op == 3:
            stored = index.insert(tokens, ident)
            assert stored % 4 == 0
        else:
            assert index.evict(rng.randint(0, 20)) >= 0
        index.check_invariants()
        assert index.total_tokens <= index.capacity_tokens
