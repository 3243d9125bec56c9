"""A fixed pool of KV blocks with vLLM's ``BlockPool`` semantics (vLLM 0.32 ``v1/core``).

* Block 0 is the null block: a placeholder that is never allocated, freed or cached.
* Every other block is either referenced (``ref_cnt > 0``, held by running requests) or free.
  Free blocks wait in one queue in eviction order; allocation takes the head.
* Freeing a request's blocks (callers pass them tail first, as vLLM's ``free`` reverses them)
  puts blocks without a hash at the head, to be reused first, and cached blocks at the tail in
  the order given, so a chain's tail is evicted before the head it shares with other requests.
* A freed cached block keeps its hash, and so stays a prefix-cache hit, until allocation reuses
  it and drops the hash (a ``BlockRemoved`` event). A hit on a free cached block (``touch``)
  takes it out of the queue.
* Several blocks may hold the same hash (vLLM does not de-duplicate, so block tables stay
  append-only); a lookup returns the first one cached.

The queue is split in two for speed with the same order as vLLM's linked list: a stack of blocks
without a hash at its head (blocks are only ever put there by prepending) followed by an
``OrderedDict`` holding the rest. Keys of the hash map are ``bytes``: the block hash, plus a
namespace suffix when the owning index separates models (events carry the plain hash, unless
``events_name_keys``: see :class:`~kvreuse.index.block_index.BlockIndex`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvreuse.errors import ConfigError, IndexStateError
from kvreuse.index.events import AllBlocksCleared, BlockRemoved, EventSink
from kvreuse.index.hashing import BlockHash


class KVBlock:
    """One KV block's metadata. ``key`` and ``block_hash`` are set while it is cached."""

    __slots__ = ("block_hash", "block_id", "is_null", "key", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.key: bytes | None = None
        self.block_hash: BlockHash | None = None
        self.is_null = False

    def __repr__(self) -> str:
        cached = "cached" if self.key is not None else "uncached"
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, {cached})"


class BlockPool:
    """``num_blocks`` blocks including the null block. Returns ``None`` from allocation when too
    few blocks are free (backpressure); raises :class:`IndexStateError` on a double free."""

    def __init__(
        self, num_blocks: int, *, enable_caching: bool = True, on_event: EventSink | None = None,
        events_name_keys: bool = False,
    ) -> None:
        if num_blocks < 2:
            raise ConfigError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.on_event = on_event
        self.events_name_keys = events_name_keys
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        # Queue head = end of this list; vLLM's initial queue is in block-id order.
        self._front: list[KVBlock] = self.blocks[:0:-1]
        self._queue: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached: dict[bytes, KVBlock | dict[int, KVBlock]] = {}
        self._num_cached_free = 0
        self._num_hashed = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, cached or not (vLLM's ``get_num_free_blocks``). O(1)."""
        return len(self._front) + len(self._queue)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a hash: the evictable prefix cache. O(1)."""
        return self._num_cached_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a hash, referenced or free. O(1)."""
        return self._num_hashed

    @property
    def num_used_blocks(self) -> int:
        """Referenced blocks, the null block excluded. O(1)."""
        return self.num_blocks - 1 - self.num_free_blocks

    def usage(self) -> float:
        """Fraction of usable blocks referenced, as vLLM's ``get_usage``. O(1)."""
        return self.num_used_blocks / (self.num_blocks - 1)

    def get_cached_block(self, key: bytes) -> KVBlock | None:
        """The first block cached under ``key``, or ``None``. O(1)."""
        found = self._cached.get(key)
        if found is None or isinstance(found, KVBlock):
            return found
        return next(iter(found.values()))

    def free_queue(self) -> list[KVBlock]:
        """Free blocks in eviction order, head first. O(free)."""
        return [*reversed(self._front), *self._queue.values()]

    # ------------------------------------------------------------------ operations

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock] | None:
        """Take ``num_blocks`` from the queue head with ``ref_cnt`` 1, dropping the hash of any
        cached one (``BlockRemoved``); ``None`` if fewer are free. O(num_blocks)."""
        if num_blocks > self.num_free_blocks:
            return None
        taken: list[KVBlock] = []
        front, queue = self._front, self._queue
        for _ in range(num_blocks):
            if front:
                block = front.pop()
            else:
                block = queue.popitem(last=False)[1]
                if block.key is not None:
                    self._num_cached_free -= 1
                    self._drop_hash(block)
            assert block.ref_cnt == 0, f"{block!r} was free with references"
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """A hit: add a reference to each block, taking free ones out of the queue. O(k), or
        O(free) for a free block without a hash (never a prefix hit in practice)."""
        queue = self._queue
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                if queue.pop(block.block_id, None) is not None:
                    if block.key is not None:
                        self._num_cached_free -= 1
                else:
                    self._front.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Sequence[KVBlock]) -> None:
        """Drop one reference from each block; those reaching zero join the queue, first block
        first in eviction order (pass a request's blocks tail first). O(k)."""
        for block in ordered_blocks:
            if not block.is_null and block.ref_cnt <= 0:
                raise IndexStateError(f"free of {block!r}, which nothing references")
        evict_first: list[KVBlock] = []
        queue = self._queue
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.key is None:
                    evict_first.append(block)
                else:
                    queue[block.block_id] = block
                    self._num_cached_free += 1
        if evict_first:
            self._front.extend(reversed(evict_first))

    def cache_block(self, block: KVBlock, key: bytes, block_hash: BlockHash) -> None:
        """Record that ``block`` (full, referenced) holds the KV ``block_hash`` names, under map
        key ``key``. No event: the caller knows the tokens and emits ``BlockStored``. O(1)."""
        if not self.enable_caching or block.is_null:
            return
        assert block.key is None, f"{block!r} is already cached"
        assert block.ref_cnt > 0, f"{block!r} must be held by a request to be cached"
        block.key = key
        block.block_hash = block_hash
        self._num_hashed += 1
        existing = self._cached.get(key)
        if existing is None:
            self._cached[key] = block
        elif isinstance(existing, KVBlock):
            self._cached[key] = {existing.block_id: existing, block.block_id: block}
        else:
            existing[block.block_id] = block

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """vLLM's ``evict_blocks``: drop the hash of each listed block, referenced or not; free
        ones keep their queue position. O(k)."""
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise IndexStateError(f"block id {block_id} is outside the pool")
            block = self.blocks[block_id]
            if block.key is None:
                continue
            if block.ref_cnt == 0 and not block.is_null:
                self._num_cached_free -= 1
            self._drop_hash(block)

    def evict_lru(self, num_blocks: int) -> int:
        """Drop the hashes of up to ``num_blocks`` least recently freed cached blocks and move
        them to the queue head, where vLLM keeps blocks without a hash. Not a vLLM operation
        (vLLM evicts only on allocation): it serves :meth:`PrefixIndex.evict`. Returns the
        number of hashes dropped. O(k)."""
        wanted = min(num_blocks, self._num_cached_free)
        if wanted <= 0:
            return 0
        popitem, push = self._queue.popitem, self._front.append
        cached, on_event = self._cached, self.on_event
        pop = cached.pop
        dropped = inlined = 0
        # The common case inlined (one block per hash, no event sink): this loop is the whole
        # cost of PrefixIndex.evict, about 15 ns per token at block size 16.
        while dropped < wanted:
            block = popitem(False)[1]
            push(block)
            key = block.key
            if key is None:
                continue
            dropped += 1
            if on_event is None:
                found = pop(key)
                if found is block:
                    block.key = block.block_hash = None
                    inlined += 1
                    continue
                cached[key] = found  # several blocks share this hash: the general path
            self._drop_hash(block)
        self._num_hashed -= inlined
        self._num_cached_free -= dropped
        return dropped

    def reset_prefix_cache(self) -> bool:
        """Drop every hash (``AllBlocksCleared``) if no block is referenced; ``False`` and no
        change otherwise, as vLLM. O(n)."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.key = None
            block.block_hash = None
        self._cached.clear()
        self._num_cached_free = self._num_hashed = 0
        if self.on_event is not None:
            self.on_event(AllBlocksCleared())
        return True

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """O(n) self-check of the queue, reference counts, counters and the hash map."""
        null = self.null_block
        assert null.is_null and null.key is None and null.block_id == 0, "bad null block"
        free_ids: set[int] = set()
        for block in self._front:
            assert block.key is None, f"{block!r} with a hash sits at the queue head"
        for block in (*self._front, *self._queue.values()):
            assert not block.is_null, "the null block is in the free queue"
            assert block.block_id not in free_ids, f"{block!r} is queued twice"
            assert block.ref_cnt == 0, f"queued {block!r} is referenced"
            free_ids.add(block.block_id)
        for block_id, block in self._queue.items():
            assert block.block_id == block_id, f"{block!r} queued under id {block_id}"
        cached_free = hashed = 0
        for block in self.blocks[1:]:
            assert block.ref_cnt >= 0, f"{block!r} has a negative count"
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), (
                f"{block!r}: free-queue membership disagrees with its count"
            )
            if block.key is None:
                assert block.block_hash is None, f"{block!r} has a hash but no key"
                continue
            hashed += 1
            cached_free += block.ref_cnt == 0
            found = self._cached.get(block.key)
            assert found is block or (
                isinstance(found, dict) and found.get(block.block_id) is block
            ), f"{block!r} is missing from the hash map"
        mapped = sum(1 if isinstance(v, KVBlock) else len(v) for v in self._cached.values())
        assert mapped == hashed, f"hash map holds {mapped} blocks, {hashed} blocks have a hash"
        assert hashed == self._num_hashed, f"num_cached_blocks {self._num_hashed} != {hashed}"
        assert cached_free == self._num_cached_free, (
            f"num_cached_free_blocks {self._num_cached_free} != {cached_free}"
        )

    # ------------------------------------------------------------------ internals

    def _drop_hash(self, block: KVBlock) -> None:
        key, block_hash = block.key, block.block_hash
        assert key is not None and block_hash is not None, f"{block!r} has no hash to drop"
        found = self._cached.pop(key)
        if isinstance(found, dict):
            del found[block.block_id]
            if found:
                self._cached[key] = found
        else:
            assert found is block, f"hash map entry of {block!r} points elsewhere"
        block.key = None
        block.block_hash = None
        self._num_hashed -= 1
        if self.on_event is not None:
            self.on_event(BlockRemoved((BlockHash(key) if self.events_name_keys else block_hash,)))
