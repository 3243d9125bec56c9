"""Cache-content notifications a replica publishes, in token terms.

vLLM publishes block-granular events (BlockStored with token ids and a parent hash, BlockRemoved,
AllBlocksCleared). The gateway turns those into these path-based events (it keeps the parent
links); the simulator emits them directly from its replicas' radix trees. A path is the full token
sequence from the first prompt token, so no hash seed has to agree between publisher and router.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvreuse.frozen import fast_init
from kvreuse.identity import DEFAULT_IDENTITY, CacheIdentity
from kvreuse.tokens import TokenBuffer


@fast_init
@dataclass(frozen=True, slots=True)
class KvStored:
    """``replica`` now holds KV for every prefix of ``tokens`` under ``identity``."""

    replica: str
    tokens: TokenBuffer
    identity: CacheIdentity = DEFAULT_IDENTITY
    time: float = 0.0


@fast_init
@dataclass(frozen=True, slots=True)
class KvRemoved:
    """``replica`` evicted the tail of ``tokens`` past ``keep_tokens``: it still holds the first
    ``keep_tokens`` tokens of this path and nothing that extends beyond them along it."""

    replica: str
    tokens: TokenBuffer
    keep_tokens: int
    identity: CacheIdentity = DEFAULT_IDENTITY
    time: float = 0.0


@dataclass(frozen=True, slots=True)
class KvCleared:
    """``replica`` dropped its whole cache (restart, AllBlocksCleared)."""

    replica: str
    time: float = 0.0


KvEvent = KvStored | KvRemoved | KvCleared
