"""Nodes and match results of the radix index (:mod:`kvreuse.index.radix`)."""

from __future__ import annotations

from dataclasses import dataclass

from mypy_extensions import mypyc_attr

from kvreuse.frozen import fast_init
from kvreuse.identity import CacheIdentity
from kvreuse.index.trie import TrieNode
from kvreuse.tokens import unpack


# Picklable when compiled too; so only compiled code may construct it (kvreuse.index.trie).
@mypyc_attr(serializable=True)
class RadixNode(TrieNode["RadixNode"]):
    """One edge of the tree and the node it leads to, with its lock count and the access
    history eviction orders by. Owned by its :class:`RadixIndex`."""

    __slots__ = (
        "created",
        "hit_count",
        "identity",
        "last_access",
        "lock_ref",
        "node_id",
        "priority",
        "removed",
    )

    def __init__(
        self,
        key: bytes,
        parent: RadixNode | None,
        identity: CacheIdentity,
        node_id: int,
        now: float,
    ) -> None:
        super().__init__(key, parent)
        self.identity = identity
        self.node_id = node_id
        self.last_access = now
        self.created = now
        self.hit_count = 0
        self.lock_ref = 0
        self.priority = 0
        self.removed = False

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def token_ids(self) -> list[int]:
        """The edge's token ids as ints (for display and tests)."""
        return unpack(self.key)

    def __repr__(self) -> str:
        return f"RadixNode(id={self.node_id}, tokens={self.num_tokens}, lock={self.lock_ref})"


@fast_init
@dataclass(frozen=True, slots=True)
class Match:
    """Result of :meth:`RadixIndex.match`: ``length`` tokens are cached, ending at ``node``."""

    length: int
    node: RadixNode
    identity: CacheIdentity

    @property
    def handle(self) -> RadixNode:
        """The node to pass to :meth:`RadixIndex.lock`."""
        return self.node
