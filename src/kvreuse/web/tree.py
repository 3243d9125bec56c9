"""Copying a replica's radix tree into a drawable snapshot, each node labelled with the kind of
prompt segment it holds (system prompt, user turn, answer).

The tree itself stores token ids only. The workload knows which ids are which: a
:class:`SegmentMap` is built from the generated requests (intervals of token ids per kind) and a
node takes the kind of most of its tokens. Ids outside every interval (a timestamp stamped into
a system prompt, say) fall back to the kind of the interval they interrupt if the caller says
so, else ``other``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from kvreuse.index import RadixIndex, RadixNode
from kvreuse.tokens import TOKEN_BYTES
from kvreuse.web.result import TreeNode, TreeSnapshot

MAX_DRAWN_NODES = 250
"""More nodes than this are unreadable in a 500-pixel panel; the biggest are kept."""

SAMPLES_PER_NODE = 32
"""Tokens looked at to classify one node (evenly spaced): enough for a majority, cheap for a
node holding a whole document."""


@dataclass(frozen=True, slots=True)
class Segment:
    """Token ids ``first_id .. first_id + length - 1`` are all of ``kind``."""

    first_id: int
    length: int
    kind: str


class SegmentMap:
    """Token id → segment kind, by binary search over disjoint id intervals. Built once per run.

    Overlapping intervals are a caller bug (a workload reusing ids for two kinds) and are
    rejected by an assertion: a node's colour would otherwise depend on insertion order.
    """

    def __init__(self, segments: Iterable[Segment], fallback: str = "other") -> None:
        unique = sorted({(s.first_id, s.length, s.kind) for s in segments if s.length > 0})
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._kinds: list[str] = []
        for first, length, kind in unique:
            if self._starts and first == self._starts[-1]:
                assert self._ends[-1] == first + length and self._kinds[-1] == kind, (
                    f"token ids from {first} are labelled twice differently"
                )
                continue
            assert not self._ends or first >= self._ends[-1], (
                f"token id intervals overlap at {first}"
            )
            self._starts.append(first)
            self._ends.append(first + length)
            self._kinds.append(kind)
        self.fallback = fallback

    def __len__(self) -> int:
        return len(self._starts)

    def kind_of(self, token_id: int) -> str:
        """The kind of one token id. O(log intervals)."""
        pos = bisect.bisect_right(self._starts, token_id) - 1
        if pos >= 0 and token_id < self._ends[pos]:
            return self._kinds[pos]
        return self.fallback

    def kind_of_run(self, packed: bytes) -> str:
        """The majority kind of a packed token run (ties: first seen). O(samples log n)."""
        n = len(packed) // TOKEN_BYTES
        if n == 0:
            return self.fallback
        step = max(1, n // SAMPLES_PER_NODE)
        counts: dict[str, int] = {}
        for pos in range(0, n, step):
            at = pos * TOKEN_BYTES
            kind = self.kind_of(int.from_bytes(packed[at : at + TOKEN_BYTES], "little"))
            counts[kind] = counts.get(kind, 0) + 1
        return max(counts, key=lambda k: counts[k])


def snapshot_tree(
    index: RadixIndex,
    segments: SegmentMap,
    replica_id: str,
    at_s: float,
    max_nodes: int = MAX_DRAWN_NODES,
) -> TreeSnapshot:
    """Copy ``index`` (every identity's tree) into a :class:`TreeSnapshot`, keeping at most
    ``max_nodes``: the nodes with the most tokens, plus their ancestors so every kept node still
    hangs off the root. O(n log n) for n nodes."""
    rows: list[tuple[RadixNode, int]] = []  # (node, start token)
    end_of: dict[int, int] = {}
    for identity in index.identities():
        for _, node in index.walk(identity):
            parent = node.parent
            assert parent is not None, "walk() yielded a root"
            start = 0 if parent.is_root else end_of[parent.node_id]
            end_of[node.node_id] = start + node.num_tokens
            rows.append((node, start))
    total = sum(node.num_tokens for node, _ in rows)
    keep: set[int] | None = None
    if len(rows) > max_nodes:
        keep = set()
        parent_of = {
            node.node_id: (None if node.parent is None or node.parent.is_root else node.parent)
            for node, _ in rows
        }
        # Largest first; each pick pulls in its ancestors, so stop when the budget is spent.
        for node, _ in sorted(rows, key=lambda row: row[0].num_tokens, reverse=True):
            chain: list[int] = []
            walker: RadixNode | None = node
            while walker is not None and walker.node_id not in keep:
                chain.append(walker.node_id)
                walker = parent_of[walker.node_id]
            if len(keep) + len(chain) > max_nodes:
                continue
            keep.update(chain)
    nodes = tuple(
        TreeNode(
            node_id=node.node_id,
            parent_id=None if node.parent is None or node.parent.is_root else node.parent.node_id,
            tokens=node.num_tokens,
            start_token=start,
            kind=segments.kind_of_run(node.key),
            locked=node.lock_ref > 0,
        )
        for node, start in rows
        if keep is None or node.node_id in keep
    )
    return TreeSnapshot(
        replica_id=replica_id,
        at_s=at_s,
        nodes=nodes,
        total_tokens=total,
        omitted_nodes=len(rows) - len(nodes),
    )
