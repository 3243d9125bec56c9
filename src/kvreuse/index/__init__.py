"""Prefix-cache indexes: a token-granular radix tree and a vLLM-compatible hash-chain index."""

from kvreuse.identity import DEFAULT_IDENTITY, CacheIdentity
from kvreuse.index.base import Clock, PrefixIndex, PrefixMatch
from kvreuse.index.eviction import EVICTION_POLICIES
from kvreuse.index.radix import Match, RadixIndex, RadixNode

__all__ = [
    "DEFAULT_IDENTITY",
    "EVICTION_POLICIES",
    "CacheIdentity",
    "Clock",
    "Match",
    "PrefixIndex",
    "PrefixMatch",
    "RadixIndex",
    "RadixNode",
]
