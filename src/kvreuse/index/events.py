"""The KV-cache events a vLLM engine publishes, as a :class:`~kvreuse.index.BlockIndex` emits them.

Shapes follow vLLM 0.32's ``vllm.distributed.kv_events``: ``BlockStored`` when full blocks enter
the prefix cache (one event per caching step, with the parent of the first block, the blocks'
token ids and untagged extra keys), ``BlockRemoved`` when a cached block loses its hash (one event
per hash), ``AllBlocksCleared`` on a prefix-cache reset. Hashes are kept as the full
:data:`~kvreuse.index.hashing.BlockHash` bytes; vLLM puts their low 64 bits on the wire (its
default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), available as the ``int_*`` properties.

An index calls its ``on_event`` sink synchronously, in the order the engine would queue the
events; the caller batches and timestamps them (vLLM's ``EventBatch.ts``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvreuse.index.hashing import BlockHash, block_hash_to_int

MEDIUM_GPU = "GPU"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks ``block_hashes`` (a chain, in order) were cached; the first one's parent is
    ``parent_block_hash`` (``None`` when the chain starts at token 0). ``token_ids`` holds
    ``len(block_hashes) * block_size`` tokens; ``extra_keys`` has one untagged entry per block,
    or is ``None`` when no block has any."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    extra_keys: tuple[tuple[object, ...] | None, ...] | None = None
    medium: str = MEDIUM_GPU

    @property
    def int_block_hashes(self) -> tuple[int, ...]:
        """The hashes as vLLM's events carry them (low 64 bits)."""
        return tuple(block_hash_to_int(h) for h in self.block_hashes)

    @property
    def int_parent_block_hash(self) -> int | None:
        """The parent hash as vLLM's events carry it."""
        parent = self.parent_block_hash
        return None if parent is None else block_hash_to_int(parent)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks with these hashes were evicted (their KV slots were reused or dropped)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str = MEDIUM_GPU

    @property
    def int_block_hashes(self) -> tuple[int, ...]:
        """The hashes as vLLM's events carry them (low 64 bits)."""
        return tuple(block_hash_to_int(h) for h in self.block_hashes)


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset; every earlier ``BlockStored`` is void."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared

EventSink = Callable[[KVCacheEvent], None]
"""Receives each event as it happens; must not call back into the index."""
