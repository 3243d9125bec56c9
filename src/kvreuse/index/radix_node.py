"""Nodes and match results of the radix index (:mod:`kvreuse.index.radix`)."""

from __future__ import annotations

from dataclasses import dataclass

from mypy_extensions import mypyc_attr

from kvreuse.frozen import fast_init
from kvreuse.identity import CacheIdentity
from kvreuse.tokens import TOKEN_BYTES, unpack


# Picklable and copyable when compiled too. Built only by compiled code: mypyc (2.4) skips
# __init__ of a serializable class called from interpreted code.
@mypyc_attr(serializable=True)
class RadixNode:
    """One edge of the tree and the node it leads to. Owned by its :class:`RadixIndex`."""

    __slots__ = (
        "children",
        "created",
        "hit_count",
        "identity",
        "key",
        "last_access",
        "lock_ref",
        "node_id",
        "parent",
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
        self.key = key
        self.parent = parent
        self.identity = identity
        self.node_id = node_id
        self.children: dict[bytes, RadixNode] = {}
        self.last_access = now
        self.created = now
        self.hit_count = 0
        self.lock_ref = 0
        self.priority = 0
        self.removed = False

    @property
    def num_tokens(self) -> int:
        """Tokens on the edge into this node."""
        return len(self.key) // TOKEN_BYTES

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def token_ids(self) -> list[int]:
        """The edge's token ids as ints (for display and tests)."""
        return unpack(self.key)

    def path_key(self) -> bytes:
        """The packed tokens from the root to the end of this node. O(depth + tokens)."""
        parts: list[bytes] = []
        node: RadixNode | None = self
        while node is not None and node.parent is not None:
            parts.append(node.key)
            node = node.parent
        return b"".join(reversed(parts))

    def depth_tokens(self) -> int:
        """Tokens from the root to the end of this node. O(depth)."""
        total, node = 0, self
        while node.parent is not None:
            total += len(node.key)
            node = node.parent
        return total // TOKEN_BYTES

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
