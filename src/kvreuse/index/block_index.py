"""vLLM's automatic prefix caching as a :class:`~kvreuse.index.base.PrefixIndex`.

A flat map from chained block hashes (:mod:`kvreuse.index.hashing`) to the blocks of a fixed
:class:`~kvreuse.index.block_pool.BlockPool`. Hit rules are vLLM's ``get_computed_blocks``: walk
the prompt's full blocks and stop at the first missing hash, and reuse at most
``num_tokens - 1`` tokens rounded down to a block boundary, because the last prompt token must be
recomputed to get logits (seed 004: 70 shared tokens reuse 64; a fully cached 64-token prompt
reuses 48).

Cache identity maps onto vLLM's hash inputs: ``cache_salt`` salts the first block, ``adapter`` is
the LoRA name (its path comes from ``lora_paths``, else the name), ``extra_keys`` are hashed into
every block as ``("extra", key)``. ``model``, ``tokenizer_revision`` and ``template_revision``
(one vLLM engine serves one model, so vLLM has no such input) namespace the hash map with an
8-byte suffix on the keys, leaving the hashes, and so the events, exactly vLLM's.

vLLM orders eviction by the free queue, not by time: ``now`` and ``clock`` are accepted for the
protocol and not consulted. Two layers of operations share one pool:

* the :class:`PrefixIndex` surface (``match``/``lock``/``unlock``/``insert``/``evict``), where a
  lock is a request holding its matched blocks and ``insert`` caches computed KV at finish;
* vLLM's per-request ``KVCacheManager`` flow for a simulated engine (:mod:`.block_requests`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from kvreuse.errors import ConfigError, IndexStateError
from kvreuse.identity import DEFAULT_IDENTITY, CacheIdentity
from kvreuse.index.base import Clock
from kvreuse.index.block_pool import BlockPool, KVBlock
from kvreuse.index.block_requests import RequestBlocksMixin, RunningRequest
from kvreuse.index.events import AllBlocksCleared, BlockStored, EventSink
from kvreuse.index.extra_keys import ExtraKeySpec, event_extra_keys
from kvreuse.index.hashing import (
    BlockHash,
    BlockHasher,
    default_hasher,
    num_tokens_of,
    token_ids_view,
)
from kvreuse.tokens import Tokens


@dataclass(frozen=True, slots=True)
class BlockMatch:
    """Result of :meth:`BlockIndex.match`: the first ``length`` tokens are cached in
    ``block_ids``, whose hashes are ``block_hashes``; pass it to ``lock``/``unlock``."""

    length: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    identity: CacheIdentity

    @property
    def handle(self) -> BlockMatch:
        """The match itself is the handle."""
        return self


@dataclass(frozen=True, slots=True)
class Namespace:
    """How an identity enters the cache: ``keys`` go into the hashes, ``suffix`` onto map keys."""

    identity: CacheIdentity
    keys: ExtraKeySpec
    suffix: bytes

    def key(self, block_hash: BlockHash) -> bytes:
        """The hash-map key of ``block_hash`` in this namespace. O(1)."""
        return block_hash + self.suffix if self.suffix else block_hash


class BlockIndex(RequestBlocksMixin):
    """Hash-chain block index over ``num_blocks`` blocks (block 0 is vLLM's null block, so
    ``num_blocks - 1`` hold KV) of ``block_size`` tokens. See the module docstring.

    ``algorithm`` is vLLM's ``--prefix-caching-hash-algo``; ``none_hash_seed`` pins NONE_HASH
    (default: this process's, seeded as vLLM seeds it, so random per process for the xxhash
    algorithms unless PYTHONHASHSEED is set). ``lora_paths`` maps adapter names to the paths
    vLLM hashes with them. ``on_event`` receives vLLM's KV events as they happen.
    ``events_name_keys`` makes them name each block by its hash-map key (the hash plus the
    model's namespace suffix): a simulated engine serving several models then tells their blocks
    apart, as separate vLLM engines' event streams do, at the price of hashes that are no longer
    vLLM's byte for byte.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int = 16,
        algorithm: str = "sha256",
        clock: Clock | None = None,
        none_hash_seed: str | None = None,
        lora_paths: Mapping[str, str] | None = None,
        on_event: EventSink | None = None,
        events_name_keys: bool = False,
    ) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.algorithm = algorithm
        # Without a seed, share the process-wide hasher: vLLM draws NONE_HASH once per process.
        self.hasher = (
            default_hasher(algorithm)
            if none_hash_seed is None
            else BlockHasher(algorithm, none_hash_seed=none_hash_seed)
        )
        self.pool = BlockPool(num_blocks, on_event=on_event, events_name_keys=events_name_keys)
        self.on_event = on_event
        del clock  # accepted for parity with RadixIndex; vLLM's LRU is queue order, not time
        self._lora_paths = dict(lora_paths or {})
        self._namespaces: dict[CacheIdentity, Namespace] = {}
        # Hashing a CacheIdentity costs ~0.2 µs; most calls pass none, so keep that one at hand.
        self._default_namespace = self.namespace(DEFAULT_IDENTITY)
        self._locks: dict[BlockMatch, int] = {}
        self.requests: dict[Hashable, RunningRequest] = {}
        self._evicted_total = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def evictable_tokens(self) -> int:
        """Tokens in free blocks that still hold a hash. O(1)."""
        return self.pool.num_cached_free_blocks * self.block_size

    @property
    def protected_tokens(self) -> int:
        """Tokens in blocks referenced by locks or running requests, whole blocks. O(1)."""
        return self.pool.num_used_blocks * self.block_size

    @property
    def total_tokens(self) -> int:
        return self.evictable_tokens + self.protected_tokens

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool can hold (the null block excluded)."""
        return (self.pool.num_blocks - 1) * self.block_size

    @property
    def evicted_tokens_total(self) -> int:
        """Tokens evicted over the index's life, by :meth:`evict` or by reuse of a cached
        block for new KV."""
        return self._evicted_total

    def namespace(self, identity: CacheIdentity | None = None) -> Namespace:
        """The hashing namespace of ``identity``, built once. O(1) amortised."""
        if identity is None:
            return self._default_namespace
        found = self._namespaces.get(identity)
        if found is None:
            found = self._namespaces[identity] = self._build_namespace(identity)
        return found

    def block_hashes(
        self, tokens: Tokens, identity: CacheIdentity | None = None
    ) -> list[BlockHash]:
        """vLLM's hashes of the full blocks of ``tokens`` under ``identity``. O(n)."""
        return self.hasher.hashes(tokens, self.block_size, self.namespace(identity).keys)

    # ------------------------------------------------------------------ PrefixIndex

    def match(
        self,
        tokens: Tokens,
        identity: CacheIdentity | None = None,
        now: float | None = None,
        *,
        touch: bool = True,
    ) -> BlockMatch:
        """Longest cached prefix under vLLM's hit rules. Hashing stops at the first miss.

        With ``touch`` (the default), matched free blocks move to the tail of the free queue,
        tail first, exactly as if a request had used and released them; ``touch=False`` is
        vLLM's read-only ``get_computed_blocks`` (a router probing, a scheduler deciding).
        O(h * block_size) for h hashed blocks.
        """
        ns = self.namespace(identity)
        max_blocks = max(num_tokens_of(tokens) - 1, 0) // self.block_size
        get = self.pool.get_cached_block
        blocks: list[KVBlock] = []
        hashes: list[BlockHash] = []
        suffix = ns.suffix
        for block_hash in self.hasher.iter_hashes(
            tokens, self.block_size, ns.keys, max_blocks=max_blocks
        ):
            block = get(block_hash + suffix if suffix else block_hash)
            if block is None:
                break
            blocks.append(block)
            hashes.append(block_hash)
        if touch and blocks:
            self.pool.touch(blocks)
            self.pool.free_blocks(blocks[::-1])
        return BlockMatch(
            len(blocks) * self.block_size,
            tuple(b.block_id for b in blocks),
            tuple(hashes),
            ns.identity,
        )

    def lock(self, handle: BlockMatch) -> None:
        """Hold the matched blocks (vLLM's ``touch``) until :meth:`unlock`. Raises
        :class:`IndexStateError` if one was evicted since the match. O(blocks)."""
        blocks = self.resolve(handle)
        self.pool.touch(blocks)
        self._locks[handle] = self._locks.get(handle, 0) + 1

    def unlock(self, handle: BlockMatch) -> None:
        """Release one :meth:`lock`: blocks are freed tail first, so a shared head outlives the
        tails hanging off it. O(blocks)."""
        count = self._locks.get(handle, 0)
        if count == 0:
            raise IndexStateError(f"unlock of {handle!r} without a matching lock")
        if count == 1:
            del self._locks[handle]
        else:
            self._locks[handle] = count - 1
        self.pool.free_blocks([self.pool.blocks[i] for i in reversed(handle.block_ids)])

    def insert(
        self, tokens: Tokens, identity: CacheIdentity | None = None, now: float | None = None
    ) -> int:
        """Cache the full blocks of ``tokens`` as a finished request leaves them: blocks already
        cached are reused, missing ones take the free-queue head (evicting its hash), then all
        are freed tail first to the queue tail. When locks leave too few free blocks, only the
        first missing blocks are stored. Returns tokens newly stored. O(n)."""
        ns = self.namespace(identity)
        hashes = self.hasher.hashes(tokens, self.block_size, ns.keys)
        pool = self.pool
        chain = [pool.get_cached_block(ns.key(h)) for h in hashes]
        pool.touch([b for b in chain if b is not None])
        missing = [i for i, b in enumerate(chain) if b is None]
        new = self._allocate(min(len(missing), pool.num_free_blocks)) or []
        for position, block in zip(missing, new, strict=False):
            pool.cache_block(block, ns.key(hashes[position]), hashes[position])
            chain[position] = block
        if self.on_event is not None and new:
            self._emit_stored(ns, token_ids_view(tokens), hashes, missing[: len(new)])
        pool.free_blocks([b for b in reversed(chain) if b is not None])
        return len(new) * self.block_size

    def evict(self, num_tokens: int) -> int:
        """Drop the hashes of least recently freed cached blocks, whole blocks, until
        ``num_tokens`` are freed or none is left; returns tokens freed. O(blocks dropped)."""
        if num_tokens <= 0:
            return 0
        wanted = -(-num_tokens // self.block_size)
        freed = self.pool.evict_lru(wanted) * self.block_size
        self._evicted_total += freed
        return freed

    def reset(self) -> None:
        """Drop everything, locks and running requests included (an engine restart); emits
        ``AllBlocksCleared``. O(num_blocks)."""
        for request in self.requests.values():
            request.blocks.clear()
        self.requests.clear()
        self._locks.clear()
        self.pool = BlockPool(self.pool.num_blocks, on_event=self.on_event)
        if self.on_event is not None:
            self.on_event(AllBlocksCleared())

    def check_invariants(self) -> None:
        """O(n) self-check: the pool's own invariants, and every reference accounted for by a
        lock or a running request."""
        self.pool.check_invariants()
        expected = [0] * self.pool.num_blocks
        for handle, count in self._locks.items():
            assert count > 0, f"lock count {count} of {handle!r}"
            # No hash check: vLLM's evict_blocks may drop a referenced block's hash.
            for block_id in handle.block_ids:
                expected[block_id] += count
        for request in self.requests.values():
            assert len(request.hashes) >= request.num_cached_blocks, "cached past the hashes"
            for block in request.blocks:
                expected[block.block_id] += 1
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == expected[block.block_id], (
                f"{block!r}: {expected[block.block_id]} holders recorded"
            )

    # ------------------------------------------------------------------ shared internals

    def resolve(self, handle: BlockMatch) -> list[KVBlock]:
        """The blocks of ``handle``, checked to still hold its hashes. O(blocks)."""
        if not isinstance(handle, BlockMatch):
            raise IndexStateError(f"expected a BlockMatch from this index, got {handle!r}")
        blocks = []
        suffix = self.namespace(handle.identity).suffix
        for block_id, block_hash in zip(handle.block_ids, handle.block_hashes, strict=True):
            block = self.pool.blocks[block_id] if block_id < self.pool.num_blocks else None
            if block is None or block.key != (block_hash + suffix if suffix else block_hash):
                raise IndexStateError(
                    f"block {block_id} of this match was evicted since; match again first"
                )
            blocks.append(block)
        return blocks

    def _allocate(self, count: int) -> list[KVBlock] | None:
        """Take ``count`` blocks from the pool, counting the cached ones it evicts."""
        before = self.pool.num_cached_blocks
        blocks = self.pool.get_new_blocks(count)
        self._evicted_total += (before - self.pool.num_cached_blocks) * self.block_size
        return blocks

    def _emit_stored(
        self, ns: Namespace, view: Sequence[int], hashes: Sequence[BlockHash], positions: list[int]
    ) -> None:
        """One ``BlockStored`` per run of consecutive newly cached block positions, as vLLM emits
        one per ``cache_full_blocks`` call."""
        assert self.on_event is not None
        size = self.block_size
        if self.pool.events_name_keys and ns.suffix:
            hashes = [BlockHash(ns.key(block_hash)) for block_hash in hashes]
        run_start = 0
        for i in range(1, len(positions) + 1):
            if i < len(positions) and positions[i] == positions[i - 1] + 1:
                continue
            first, last = positions[run_start], positions[i - 1] + 1
            self.on_event(
                BlockStored(
                    block_hashes=tuple(hashes[first:last]),
                    parent_block_hash=hashes[first - 1] if first else None,
                    token_ids=tuple(view[first * size : last * size]),
                    block_size=size,
                    lora_name=ns.keys.lora_name,
                    extra_keys=tuple(
                        event_extra_keys(ns.keys.block_keys(b * size, (b + 1) * size))
                        for b in range(first, last)
                    ),
                )
            )
            run_start = i

    def _build_namespace(self, identity: CacheIdentity) -> Namespace:
        adapter = identity.adapter
        keys = ExtraKeySpec(
            lora_name=adapter,
            lora_path=None if adapter is None else self._lora_paths.get(adapter, adapter),
            cache_salt=identity.cache_salt,
            extra_keys=identity.extra_keys,
        )
        parts = (identity.model, identity.tokenizer_revision, identity.template_revision)
        suffix = b""
        if any(parts):
            suffix = hashlib.sha256("\0".join(parts).encode()).digest()[:8]
        return Namespace(identity, keys, suffix)
