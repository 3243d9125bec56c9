"""The prefix-trie kernel the token trees of kvreuse are built on.

Per cache identity, a root whose edges are runs of packed token ids filed under their first page
(``page_tokens`` tokens). The kernel owns the structure: links, the per-identity roots (the last
identity remembered: callers pass one identity object request after request), the walk down whole
edges to where a path diverges, splits (with a payload hook), linking and unlinking, subtree
iteration and the structural invariants. What a node *means* is its layer's:
:class:`~kvreuse.index.radix.RadixIndex` (locks, access times, eviction order),
:class:`~kvreuse.routing.approx_trees.ApproxTrees` (which replicas were sent a prefix, and when),
:class:`~kvreuse.routing.mirror.CacheMirror` (which replicas' KV events say they hold it) and
:class:`~kvreuse.routing.event_index.EventIndex` (one upstream's blocks and their copies). A layer
subclasses :class:`TrieNode` and :class:`PrefixTrie`; walks that update a payload edge by edge
(insertion, eviction, removal) stay in the layer's loop, on these primitives, since they are the
compiled core's hot paths. The two fleet-wide layers share their prediction walk
(:class:`~kvreuse.routing.fleet_masks.FleetTrie`, with a per-edge hook).

Node classes are marked ``mypyc_attr(serializable=True)`` so indexes pickle when compiled; mypyc
2.4 then skips ``__init__`` when *interpreted* code calls such a class, so only compiled modules
may construct them (``tests/index/test_compiled_only_nodes.py`` checks the sources).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from mypy_extensions import mypyc_attr

from kvreuse.identity import DEFAULT_IDENTITY, CacheIdentity
from kvreuse.tokens import TOKEN_BYTES, Tokens, as_buffer, common_prefix_tokens

N = TypeVar("N", bound="TrieNode[Any]")


# Picklable and copyable when compiled too; constructed by compiled code only (see above).
@mypyc_attr(serializable=True)
class TrieNode(Generic[N]):
    """An edge (``key``, whole pages of packed tokens) and the node it leads to. A root has an
    empty key and no parent."""

    __slots__ = ("children", "key", "parent")

    def __init__(self, key: bytes, parent: N | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[bytes, N] = {}

    @property
    def num_tokens(self) -> int:
        """Tokens on the edge into this node."""
        return len(self.key) // TOKEN_BYTES

    def path_key(self) -> bytes:
        """The packed tokens from the root to the end of this node. O(depth + tokens)."""
        parts: list[bytes] = []
        node: TrieNode[N] | None = self
        while node is not None and node.parent is not None:
            parts.append(node.key)
            node = node.parent
        return b"".join(reversed(parts))

    def depth_tokens(self) -> int:
        """Tokens from the root to the end of this node. O(depth + tokens)."""
        return len(self.path_key()) // TOKEN_BYTES


class PrefixTrie(Generic[N]):
    """Per-identity tries of :class:`TrieNode` subclasses; see the module docstring.

    ``page_tokens``: children are filed under their first ``page_tokens`` tokens, and every
    edge is a whole number of pages. ``_num_nodes`` counts non-root nodes.
    """

    def __init__(self, page_tokens: int = 1) -> None:
        self._page_bytes = page_tokens * TOKEN_BYTES
        self._roots: dict[CacheIdentity, N] = {}
        self._last_identity: CacheIdentity | None = None
        self._last_root: N | None = None
        self._num_nodes = 0

    # ------------------------------------------------------------------ layer hooks

    def _new_root(self, identity: CacheIdentity) -> N:
        """A root for ``identity`` (called once per identity)."""
        raise NotImplementedError

    def _cut(self, child: N, key: bytes) -> N:
        """A node for the upper ``key`` of ``child``'s edge, under ``child``'s parent, with the
        payload it inherits from ``child``; :meth:`_split` links it."""
        raise NotImplementedError

    # ------------------------------------------------------------------ roots

    def identities(self) -> list[CacheIdentity]:
        """Identities that have a root."""
        return list(self._roots)

    def root(self, identity: CacheIdentity | None = None) -> N:
        """The root of ``identity``'s trie (``None``: the default identity), created on first
        use. O(1)."""
        root = self.find_root(identity)
        if root is None:
            ident = DEFAULT_IDENTITY if identity is None else identity
            root = self._roots[ident] = self._new_root(ident)
            self._last_identity, self._last_root = identity, root
        return root

    def find_root(self, identity: CacheIdentity | None) -> N | None:
        """:meth:`root` without creating one: ``None`` when ``identity`` has none. O(1)."""
        # An identity check skips hashing the dataclass (about 0.3 µs) on the common path.
        if identity is self._last_identity and self._last_root is not None:
            return self._last_root
        root = self._roots.get(DEFAULT_IDENTITY if identity is None else identity)
        if root is not None:
            self._last_identity, self._last_root = identity, root
        return root

    def prefix_length(self, tokens: Tokens, identity: CacheIdentity | None = None) -> int:
        """Tokens of ``tokens`` the trie holds from ``identity``'s root, in whole pages: what a
        match would find, read without touching, splitting or creating anything (for
        observers that must not change the cache they look at). O(tokens compared + depth)."""
        root = self.find_root(identity)
        if root is None:
            return 0
        buf = as_buffer(tokens)
        _, pos, diverging = self._descend(root, buf, 0, len(buf) - len(buf) % self._page_bytes)
        if diverging is not None:
            pos += self._common(diverging, buf, pos)
        return pos // TOKEN_BYTES

    def _drop_root(self, identity: CacheIdentity) -> None:
        """Forget ``identity``'s root (its trie must be empty). O(1)."""
        self._roots.pop(identity, None)
        self._last_identity, self._last_root = None, None

    # ------------------------------------------------------------------ structure

    def _descend(self, node: N, buf: bytes, pos: int, end: int) -> tuple[N, int, N | None]:
        """Follow ``buf[pos:end]`` (whole pages) down whole edges from ``node``, which ends at
        byte ``pos``. Returns the deepest node reached, the byte offset it ends at, and the
        child whose edge the path enters but leaves (``None`` when the path ends or has no
        child there). O(bytes compared + depth)."""
        # N's links read as Any inside this generic class: typed locals keep them native.
        page = self._page_bytes
        children: dict[bytes, N] = node.children
        while pos < end:
            child: N | None = children.get(buf[pos : pos + page])
            if child is None:
                return node, pos, None
            if not buf.startswith(child.key, pos):
                return node, pos, child
            pos += len(child.key)
            node = child
            children = node.children
        return node, pos, None

    def _common(self, child: N, buf: bytes, pos: int) -> int:
        """Bytes of ``child``'s edge that ``buf`` matches from ``pos``, in whole pages. O(edge)."""
        key = child.key
        common = common_prefix_tokens(key, buf[pos : pos + len(key)]) * TOKEN_BYTES
        return common - common % self._page_bytes

    def _split(self, child: N, at: int) -> N:
        """Cut ``child``'s edge ``at`` bytes in (whole pages); returns the new upper node,
        made by :meth:`_cut`. O(edge)."""
        parent: N | None = child.parent
        assert parent is not None and 0 < at < len(child.key), "split outside the edge"
        page = self._page_bytes
        upper = self._cut(child, child.key[:at])
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[:page]] = child
        parent.children[upper.key[:page]] = upper
        self._num_nodes += 1
        return upper

    def _link(self, parent: N, node: N) -> N:
        """File the new ``node`` (its parent already set) under ``parent``. O(1)."""
        parent.children[node.key[: self._page_bytes]] = node
        self._num_nodes += 1
        return node

    def _unlink(self, node: N) -> N:
        """Take ``node`` out of its parent's children (it keeps its ``parent``, for the
        layer's last look); returns the parent. O(1)."""
        parent: N | None = node.parent
        assert parent is not None, "unlinking a root"
        del parent.children[node.key[: self._page_bytes]]
        self._num_nodes -= 1
        return parent

    def _absorb(self, upper: N) -> None:
        """Join ``upper`` and its only child into one edge that keeps ``upper``'s payload (the
        layer checks both payloads agree). O(edge + children)."""
        below: list[N] = list(upper.children.values())
        assert len(below) == 1, "absorbing needs exactly one child"
        lower = below[0]
        upper.key += lower.key
        upper.children = lower.children
        grandchildren: dict[bytes, N] = upper.children
        for child in grandchildren.values():
            child.parent = upper
        lower.parent = None
        self._num_nodes -= 1

    def _drop_roots(self) -> None:
        """Forget every trie, roots included. O(1)."""
        self._roots.clear()
        self._last_identity, self._last_root = None, None
        self._num_nodes = 0

    def _clear_roots(self) -> None:
        """Empty every trie (roots stay). O(1) per root."""
        for root in self._roots.values():
            root.children.clear()
        self._num_nodes = 0

    # ------------------------------------------------------------------ iteration

    @staticmethod
    def _subtree(root: N) -> Iterator[N]:
        """``root`` and every node below it, depth first. O(subtree)."""
        stack = [root]
        while stack:
            node = stack.pop()
            yield node
            children: dict[bytes, N] = node.children
            stack.extend(children.values())

    def nodes(self) -> Iterator[tuple[CacheIdentity, N]]:
        """``(identity, node)`` for every non-root node of every trie. O(n)."""
        for identity, root in self._roots.items():
            for node in self._subtree(root):
                if node is not root:
                    yield identity, node

    def walk(self, identity: CacheIdentity | None = None) -> Iterator[tuple[int, N]]:
        """Yield ``(depth, node)`` in depth-first order under ``identity``'s root (root
        excluded). O(n)."""
        root = self._roots.get(DEFAULT_IDENTITY if identity is None else identity)
        if root is None:
            return
        stack: list[tuple[int, N]] = [(0, root)]
        while stack:
            depth, node = stack.pop()
            if depth:
                yield depth, node
            below: list[N] = list(node.children.values())
            below.reverse()  # so the first child comes off the stack first
            for child in below:
                stack.append((depth + 1, child))

    def _check_structure(self) -> None:
        """O(n) structural self-check: roots empty and parentless, children linked back and
        filed under their first page, edges non-empty whole pages, the node count right."""
        page = self._page_bytes
        count = 0
        for root in self._roots.values():
            assert root.parent is None and not root.key, "a root must be empty and parentless"
            for node in self._subtree(root):
                children: dict[bytes, N] = node.children
                for first, child in children.items():
                    assert child.parent is node, f"{child!r} has the wrong parent"
                    assert child.key and len(child.key) % page == 0, (
                        f"{child!r} edge is empty or not whole pages"
                    )
                    assert child.key[:page] == first, f"{child!r} filed wrongly"
                    count += 1
        assert count == self._num_nodes, f"num_nodes {self._num_nodes} != {count}"
