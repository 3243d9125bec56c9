"""Behaviour of the vLLM-style block pool: null block, reference counts, the LRU free queue."""

from __future__ import annotations

import random

import pytest

from kvreuse.errors import ConfigError, IndexStateError
from kvreuse.index.block_pool import BlockPool, KVBlock
from kvreuse.index.events import AllBlocksCleared, BlockRemoved, KVCacheEvent
from kvreuse.index.hashing import BlockHash


def h(name: str) -> BlockHash:
    return BlockHash(name.encode().ljust(32, b"."))


def queue_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_queue()]


def cache(pool: BlockPool, block: KVBlock, name: str) -> None:
    pool.cache_block(block, h(name), h(name))


def test_block_zero_is_the_null_block() -> None:
    """Block 0 is never handed out, so n blocks give n - 1 usable ones."""
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert blocks is not None and [b.block_id for b in blocks] == [1, 2, 3]
    assert pool.null_block.is_null and pool.num_free_blocks == 0
    pool.check_invariants()


def test_too_few_blocks_is_config_error() -> None:
    """A pool needs the null block and at least one more."""
    with pytest.raises(ConfigError, match="num_blocks"):
        BlockPool(1)


def test_allocation_backpressure_returns_none() -> None:
    """Asking for more blocks than are free returns None and changes nothing."""
    pool = BlockPool(4)
    assert pool.get_new_blocks(4) is None
    assert pool.num_free_blocks == 3
    pool.check_invariants()


def test_freed_blocks_keep_their_hash() -> None:
    """A freed cached block is still found by its hash until it is reallocated."""
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1) or []
    cache(pool, block, "a")
    pool.free_blocks([block])
    assert pool.get_cached_block(h("a")) is block
    assert pool.num_cached_free_blocks == 1
    pool.check_invariants()


def test_free_order_is_eviction_order() -> None:
    """Cached blocks freed tail first are evicted tail first, after blocks never cached."""
    events: list[KVCacheEvent] = []
    pool = BlockPool(6, on_event=events.append)
    blocks = pool.get_new_blocks(3) or []
    for block, name in zip(blocks, "abc", strict=True):
        cache(pool, block, name)
    pool.free_blocks(blocks[::-1])
    assert queue_ids(pool) == [4, 5, 3, 2, 1]
    taken = pool.get_new_blocks(4) or []
    assert [b.block_id for b in taken] == [4, 5, 3, 2]
    assert events == [BlockRemoved((h("c"),)), BlockRemoved((h("b"),))]
    assert pool.get_cached_block(h("a")) is blocks[0]
    pool.check_invariants()


def test_uncached_blocks_are_reused_first() -> None:
    """A freed block without a hash goes to the queue head (vLLM's LIFO reuse)."""
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3) or []
    cache(pool, blocks[0], "a")
    cache(pool, blocks[1], "b")
    pool.free_blocks(blocks[::-1])
    assert queue_ids(pool) == [3, 4, 5, 2, 1]
    pool.check_invariants()


def test_touch_takes_free_block_out_of_queue() -> None:
    """A hit on a free cached block references it and removes it from the queue."""
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2) or []
    cache(pool, blocks[0], "a")
    pool.free_blocks(blocks[::-1])
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1 and 1 not in queue_ids(pool)
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 2
    pool.check_invariants()


def test_touched_block_rejoins_queue_at_tail() -> None:
    """Using a cached block again moves it behind blocks freed since (LRU)."""
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3) or []
    for block, name in zip(blocks, "abc", strict=True):
        cache(pool, block, name)
    pool.free_blocks(blocks[::-1])
    pool.touch([blocks[2]])
    pool.free_blocks([blocks[2]])
    assert queue_ids(pool) == [2, 1, 3]


def test_double_free_is_an_error() -> None:
    """Freeing a block nothing references raises and changes nothing."""
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2) or []
    pool.free_blocks(blocks)
    with pytest.raises(IndexStateError, match="nothing references"):
        pool.free_blocks(blocks)
    pool.check_invariants()


def test_duplicate_hashes_are_kept() -> None:
    """Two blocks may hold one hash; lookups return the first until it is evicted."""
    pool = BlockPool(3)
    first, second = pool.get_new_blocks(2) or []
    cache(pool, first, "a")
    cache(pool, second, "a")
    assert pool.get_cached_block(h("a")) is first
    pool.free_blocks([first, second])
    pool.get_new_blocks(1)
    assert pool.get_cached_block(h("a")) is second
    pool.check_invariants()


def test_evict_lru_handles_duplicate_hashes() -> None:
    """Explicit eviction of one copy of a hash leaves the other copy findable."""
    pool = BlockPool(3)
    first, second = pool.get_new_blocks(2) or []
    cache(pool, first, "a")
    cache(pool, second, "a")
    pool.free_blocks([first, second])
    assert pool.evict_lru(1) == 1
    assert pool.get_cached_block(h("a")) is second
    pool.check_invariants()
    assert pool.evict_lru(1) == 1
    assert pool.get_cached_block(h("a")) is None
    pool.check_invariants()


def test_evict_blocks_keeps_queue_position() -> None:
    """vLLM's evict_blocks drops a free block's hash but leaves it where it is in the queue."""
    events: list[KVCacheEvent] = []
    pool = BlockPool(4, on_event=events.append)
    blocks = pool.get_new_blocks(3) or []
    for block, name in zip(blocks, "abc", strict=True):
        cache(pool, block, name)
    pool.free_blocks(blocks[::-1])
    pool.evict_blocks([2])
    assert queue_ids(pool) == [3, 2, 1]
    assert pool.get_cached_block(h("b")) is None
    assert events == [BlockRemoved((h("b"),))]
    pool.check_invariants()


def test_evict_lru_drops_least_recent_hashes() -> None:
    """Explicit eviction drops the oldest cached free blocks and moves them to the head."""
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3) or []
    for block, name in zip(blocks, "abc", strict=True):
        cache(pool, block, name)
    pool.free_blocks(blocks[::-1])
    assert pool.evict_lru(2) == 2
    assert pool.get_cached_block(h("c")) is None and pool.get_cached_block(h("b")) is None
    assert pool.get_cached_block(h("a")) is blocks[0]
    assert queue_ids(pool) == [2, 3, 1]
    assert pool.evict_lru(5) == 1
    pool.check_invariants()


def test_referenced_blocks_are_not_evictable() -> None:
    """evict_lru never touches blocks a request holds."""
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2) or []
    cache(pool, blocks[0], "a")
    assert pool.evict_lru(1) == 0
    assert pool.get_cached_block(h("a")) is blocks[0]


def test_reset_requires_all_blocks_free() -> None:
    """reset_prefix_cache fails while blocks are held, then clears every hash."""
    events: list[KVCacheEvent] = []
    pool = BlockPool(4, on_event=events.append)
    blocks = pool.get_new_blocks(2) or []
    cache(pool, blocks[0], "a")
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks[::-1])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h("a")) is None and pool.num_cached_blocks == 0
    assert events == [AllBlocksCleared()]
    pool.check_invariants()


def test_usage_excludes_null_block() -> None:
    """Usage is referenced blocks over usable blocks."""
    pool = BlockPool(5)
    pool.get_new_blocks(2)
    assert pool.usage() == 0.5


def test_check_invariants_catches_corruption() -> None:
    """A tampered reference count is reported."""
    pool = BlockPool(4)
    pool.get_new_blocks(1)
    pool.blocks[2].ref_cnt = 1
    with pytest.raises(AssertionError, match="is referenced"):
        pool.check_invariants()


class ReferencePool:
    """vLLM's BlockPool reduced to lists: the free queue is a plain list, head first."""

    def __init__(self, num_blocks: int) -> None:
        self.queue = list(range(1, num_blocks))
        self.ref = [0] * num_blocks
        self.key: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, list[int]] = {}

    def drop(self, block_id: int) -> None:
        key = self.key[block_id]
        if key is not None:
            self.cached[key].remove(block_id)
            if not self.cached[key]:
                del self.cached[key]
            self.key[block_id] = None

    def get_new(self, n: int) -> list[int] | None:
        if n > len(self.queue):
            return None
        taken, self.queue = self.queue[:n], self.queue[n:]
        for block_id in taken:
            self.drop(block_id)
            self.ref[block_id] = 1
        return taken

    def touch(self, ids: list[int]) -> None:
        for block_id in ids:
            if self.ref[block_id] == 0:
                self.queue.remove(block_id)
            self.ref[block_id] += 1

    def free(self, ids: list[int]) -> None:
        first, last = [], []
        for block_id in ids:
            self.ref[block_id] -= 1
            if self.ref[block_id] == 0:
                (first if self.key[block_id] is None else last).append(block_id)
        self.queue = first + self.queue + last

    def cache(self, block_id: int, key: bytes) -> None:
        self.key[block_id] = key
        self.cached.setdefault(key, []).append(block_id)


@pytest.mark.parametrize("seed", range(8))
def test_stress_matches_reference_queue(seed: int) -> None:
    """Random allocate/cache/touch/free/evict sequences keep vLLM's exact queue order."""
    rng = random.Random(seed)
    pool, ref = BlockPool(12), ReferencePool(12)
    held: list[list[KVBlock]] = []
    keys = [h(str(i)) for i in range(8)]
    for _ in range(400):
        op = rng.randrange(5)
        if op == 0:
            n = rng.randint(1, 4)
            got = pool.get_new_blocks(n)
            expected = ref.get_new(n)
            assert (None if got is None else [b.block_id for b in got]) == expected
            if got:
                held.append(got)
        elif op == 1 and held:
            blocks = rng.choice(held)
            block = rng.choice(blocks)
            if block.key is None:
                key = rng.choice(keys)
                pool.cache_block(block, key, BlockHash(key))
                ref.cache(block.block_id, key)
        elif op == 2:
            key = rng.choice(keys)
            found = pool.get_cached_block(key)
            assert (found and found.block_id) == (ref.cached.get(key, [None])[0] or None)
            if found is not None:
                pool.touch([found])
                ref.touch([found.block_id])
                held.append([found])
        elif op == 3 and held:
            blocks = held.pop(rng.randrange(len(held)))
            pool.free_blocks(blocks[::-1])
            ref.free([b.block_id for b in blocks[::-1]])
        elif op == 4:
            victim = rng.randrange(1, 12)
            pool.evict_blocks([victim])
            ref.drop(victim)
        pool.check_invariants()
        assert queue_ids(pool) == ref.queue
        assert [b.ref_cnt for b in pool.blocks[1:]] == ref.ref[1:]
