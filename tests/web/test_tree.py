"""Tree snapshots: what the lab draws of a replica's radix tree."""

from __future__ import annotations

import random

import pytest

from kvreuse.identity import CacheIdentity
from kvreuse.index import RadixIndex
from kvreuse.tokens import pack
from kvreuse.web.tree import Segment, SegmentMap, snapshot_tree

SEGMENTS = SegmentMap(
    [Segment(0, 100, "system"), Segment(100, 50, "user"), Segment(150, 50, "answer")]
)


def test_kind_of_looks_up_intervals_and_falls_back() -> None:
    """Ids inside an interval get its kind; ids outside every interval get the fallback."""
    assert [SEGMENTS.kind_of(i) for i in (0, 99, 100, 149, 150, 199, 200)] == [
        "system",
        "system",
        "user",
        "user",
        "answer",
        "answer",
        "other",
    ]


def test_a_run_takes_the_kind_of_most_of_its_tokens() -> None:
    """A node spanning 90 system and 10 user tokens is a system node."""
    assert SEGMENTS.kind_of_run(pack(range(10, 110))) == "system"
    assert SEGMENTS.kind_of_run(pack(range(95, 160))) == "user"


def test_overlapping_intervals_are_a_bug() -> None:
    """Two kinds claiming the same ids would make colours depend on order."""
    with pytest.raises(AssertionError, match="overlap"):
        SegmentMap([Segment(0, 10, "system"), Segment(5, 10, "user")])


def test_snapshot_keeps_structure_depths_and_kinds() -> None:
    """A shared system prompt with two branches: one trunk node and two children."""
    index = RadixIndex()
    system = list(range(0, 100))
    index.insert(system + list(range(100, 120)))
    index.insert(system + list(range(120, 140)) + list(range(150, 180)))
    snap = snapshot_tree(index, SEGMENTS, "r0", 30.0)
    by_parent: dict[int | None, list[int]] = {}
    for node in snap.nodes:
        by_parent.setdefault(node.parent_id, []).append(node.tokens)
    assert by_parent[None] == [100]
    trunk = next(n for n in snap.nodes if n.parent_id is None)
    assert trunk.kind == "system" and trunk.start_token == 0
    children = [n for n in snap.nodes if n.parent_id == trunk.node_id]
    assert sorted(n.tokens for n in children) == [20, 50]
    assert all(n.start_token == 100 for n in children)
    assert snap.total_tokens == 170 and snap.omitted_nodes == 0


def test_locked_nodes_are_marked() -> None:
    """A node pinned by a running request is flagged so the page can outline it."""
    index = RadixIndex()
    index.insert(list(range(0, 100)))
    index.lock(index.match(list(range(0, 100))).node)
    (node,) = snapshot_tree(index, SEGMENTS, "r0", 0.0).nodes
    assert node.locked


def test_every_identity_is_included() -> None:
    """Two tenants' salted trees both appear, each hanging off the root."""
    index = RadixIndex()
    index.insert(list(range(0, 10)), CacheIdentity(cache_salt="a"))
    index.insert(list(range(0, 10)), CacheIdentity(cache_salt="b"))
    snap = snapshot_tree(index, SEGMENTS, "r0", 0.0)
    assert [n.parent_id for n in snap.nodes] == [None, None]


def test_truncation_keeps_the_biggest_nodes_with_their_ancestors() -> None:
    """Seeded: with a node budget, every kept node's parent is kept and the biggest survive."""
    rng = random.Random(7)
    index = RadixIndex()
    next_id = 1000
    prompts: list[list[int]] = [[]]
    for _ in range(300):
        base = rng.choice(prompts)
        length = rng.randint(1, 60)
        prompt = base + list(range(next_id, next_id + length))
        next_id += length
        index.insert(prompt)
        prompts.append(prompt)
    full = snapshot_tree(index, SEGMENTS, "r0", 0.0, max_nodes=10_000)
    cut = snapshot_tree(index, SEGMENTS, "r0", 0.0, max_nodes=40)
    assert len(cut.nodes) <= 40
    assert cut.omitted_nodes == len(full.nodes) - len(cut.nodes)
    assert cut.total_tokens == full.total_tokens == index.total_tokens
    kept = {n.node_id for n in cut.nodes}
    assert all(n.parent_id is None or n.parent_id in kept for n in cut.nodes)
    biggest = max(full.nodes, key=lambda n: n.tokens)
    assert biggest.node_id in kept
