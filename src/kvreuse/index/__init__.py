"""Prefix-cache indexes: a token-granular radix tree and a vLLM-compatible hash-chain index."""

from kvreuse.identity import DEFAULT_IDENTITY, CacheIdentity
from kvreuse.index.base import Clock, PrefixIndex, PrefixMatch
from kvreuse.index.block_index import BlockIndex, BlockMatch
from kvreuse.index.block_pool import BlockPool, KVBlock
from kvreuse.index.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvreuse.index.eviction import EVICTION_POLICIES
from kvreuse.index.hashing import BlockHash, BlockHasher, block_hashes
from kvreuse.index.radix import Match, RadixIndex, RadixNode

__all__ = [
    "DEFAULT_IDENTITY",
    "EVICTION_POLICIES",
    "AllBlocksCleared",
    "BlockHash",
    "BlockHasher",
    "BlockIndex",
    "BlockMatch",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheIdentity",
    "Clock",
    "KVBlock",
    "KVCacheEvent",
    "Match",
    "PrefixIndex",
    "PrefixMatch",
    "RadixIndex",
    "RadixNode",
    "block_hashes",
]
