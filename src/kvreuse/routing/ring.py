"""Consistent hashing with virtual nodes, and the stable keys routed through it.

Every replica owns ``vnodes`` points on a 64-bit ring; a key's preference list is the distinct
replicas met walking clockwise from the key's point. Adding or removing a replica only moves the
keys whose first preference changes (about 1/n of them), which is why session and prefix affinity
survive scaling. Hashes are xxh3-64 of bytes, so preference lists are identical across processes
and runs (Python's ``hash`` of str is salted per process).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

import xxhash

from kvreuse.errors import require_at_least
from kvreuse.identity import CacheIdentity
from kvreuse.tokens import TOKEN_BYTES, TokenBuffer


def stable_hash(data: bytes) -> int:
    """64-bit hash, identical across processes. O(len)."""
    return int(xxhash.xxh3_64_intdigest(data))


def identity_seed(identity: CacheIdentity) -> bytes:
    """Bytes naming a cache namespace, mixed into routing keys so two tenants' equal prompts do
    not share affinity (nor cache). O(1)."""
    return repr(identity).encode()


def prefix_key(tokens: TokenBuffer, k: int, identity: CacheIdentity) -> int:
    """Routing key of the first ``k`` tokens under ``identity``. O(k)."""
    return stable_hash(identity_seed(identity) + tokens[: k * TOKEN_BYTES])


def block_chain(tokens: TokenBuffer, identity: CacheIdentity, block_size: int) -> list[int]:
    """Chained 64-bit hashes of the full blocks of ``tokens`` under ``identity``: entry b names
    the first (b+1)·block_size tokens (the chain starts from :func:`identity_seed`'s hash), so
    equal entries mean equal prefixes. llm-d's scorers and the gateways' shared index key blocks
    by it. O(n)."""
    step = block_size * TOKEN_BYTES
    digest = xxhash.xxh3_64_intdigest
    h = stable_hash(identity_seed(identity))
    chain = []
    for b in range(len(tokens) // step):
        h = digest(tokens[b * step : (b + 1) * step], seed=h)
        chain.append(h)
    return chain


class ConsistentRing:
    """A hash ring over replica ids. Insertion order of ids does not affect placement."""

    def __init__(self, replica_ids: Iterable[str] = (), vnodes: int = 160) -> None:
        require_at_least("vnodes", vnodes, 1)
        self.vnodes = vnodes
        self._members: set[str] = set()
        self._points: list[int] = []
        self._owners: list[str] = []
        for rid in replica_ids:
            self.add(rid)

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._members

    def __len__(self) -> int:
        return len(self._members)

    def add(self, replica_id: str) -> None:
        """Place ``replica_id``'s virtual nodes. O(vnodes + n·vnodes) for the re-sort."""
        if replica_id in self._members:
            return
        self._members.add(replica_id)
        pairs = list(zip(self._points, self._owners, strict=True))
        pairs += [
            (stable_hash(f"{replica_id}#{v}".encode()), replica_id) for v in range(self.vnodes)
        ]
        pairs.sort()
        self._points = [p for p, _ in pairs]
        self._owners = [o for _, o in pairs]

    def remove(self, replica_id: str) -> None:
        """Take ``replica_id`` off the ring. O(n·vnodes)."""
        if replica_id not in self._members:
            return
        self._members.discard(replica_id)
        keep = [(p, o) for p, o in zip(self._points, self._owners, strict=True) if o != replica_id]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def preference(self, key: int) -> Iterator[str]:
        """Distinct replicas in clockwise order from ``key``. O(log(n·vnodes)) to start, then
        amortised O(vnodes) per replica yielded."""
        owners = self._owners
        size = len(owners)
        if not size:
            return
        start = bisect.bisect_left(self._points, key)
        seen: set[str] = set()
        for step in range(size):
            owner = owners[(start + step) % size]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self._members):
                    return

    def first(self, key: int, allowed: Iterable[str] | None = None) -> str | None:
        """The first replica of ``key``'s preference list that is in ``allowed`` (any when
        ``None``)."""
        keep = None if allowed is None else set(allowed)
        for owner in self.preference(key):
            if keep is None or owner in keep:
                return owner
        return None
