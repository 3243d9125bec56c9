"""Seeded stress tests and hypothesis properties for the radix index."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.identity import CacheIdentity
from kvreuse.index import RadixIndex, RadixNode


def longest_common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def reference_match(stored: list[list[int]], tokens: list[int], page: int = 1) -> int:
    best = max((longest_common_prefix(s, tokens) for s in stored), default=0)
    return best - best % page


token_lists = st.lists(st.integers(0, 4), min_size=0, max_size=12)


@settings(max_examples=200, deadline=None)
@given(st.lists(token_lists, max_size=12), token_lists, st.sampled_from([1, 2, 3]))
def test_match_equals_longest_stored_prefix(
    inserts: list[list[int]], query: list[int], page: int
) -> None:
    """Without eviction, match length is the longest common prefix with anything inserted."""
    index = RadixIndex(page_size=page)
    stored = []
    for tokens in inserts:
        index.insert(tokens)
        index.check_invariants()
        stored.append(tokens[: len(tokens) - len(tokens) % page])
    assert index.match(query).length == reference_match(stored, query, page)
    index.check_invariants()


@settings(max_examples=200, deadline=None)
@given(st.lists(token_lists, max_size=12))
def test_total_tokens_equals_distinct_prefix_count(inserts: list[list[int]]) -> None:
    """The tree stores each distinct prefix position exactly once."""
    index = RadixIndex()
    prefixes = set()
    for tokens in inserts:
        index.insert(tokens)
        prefixes.update(tuple(tokens[: i + 1]) for i in range(len(tokens)))
    assert index.total_tokens == len(prefixes)


@settings(max_examples=100, deadline=None)
@given(st.lists(token_lists, min_size=1, max_size=10), st.integers(0, 60))
def test_evict_never_touches_locked_and_frees_what_it_says(
    inserts: list[list[int]], to_evict: int
) -> None:
    """Eviction frees the reported tokens, and a locked prefix still matches afterwards."""
    index = RadixIndex()
    for tokens in inserts:
        index.insert(tokens)
    pinned = inserts[0]
    node = index.match(pinned).node
    index.lock(node)
    before = index.total_tokens
    freed = index.evict(to_evict)
    index.check_invariants()
    assert index.total_tokens == before - freed
    assert freed >= min(to_evict, before - index.protected_tokens) or index.evictable_tokens == 0
    assert index.match(pinned).length == len(pinned)


def test_seeded_stress_with_capacity_locks_and_identities() -> None:
    """Thousands of random operations keep every invariant after each step."""
    rng = random.Random(20261129)
    identities = [None, CacheIdentity(cache_salt="a"), CacheIdentity(adapter="x")]
    index = RadixIndex(capacity_tokens=400, page_size=1)
    systems = [[rng.randrange(50) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    locked: list[RadixNode] = []
    for step in range(3000):
        op = rng.random()
        identity = rng.choice(identities)
        tokens = rng.choice(systems) + [rng.randrange(50) for _ in range(rng.randrange(0, 30))]
        now = float(step)
        if op < 0.35:
            index.insert(tokens, identity, now=now)
        elif op < 0.6:
            hit = index.match(tokens, identity, now=now)
            assert hit.length <= len(tokens)
            if rng.random() < 0.5 and not hit.node.is_root:
                index.lock(hit.node)
                locked.append(hit.node)
        elif op < 0.8 and locked:
            index.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            index.evict(rng.randrange(1, 80))
        index.check_invariants()
        assert index.total_tokens <= max(400, index.protected_tokens)
    for node in locked:
        index.unlock(node)
    index.check_invariants()
    assert index.protected_tokens == 0


def test_seeded_stress_matches_reference_without_capacity() -> None:
    """Random chat-like traffic matches a brute-force reference exactly."""
    rng = random.Random(7)
    index = RadixIndex(page_size=2)
    stored: list[list[int]] = []
    for _ in range(400):
        base = rng.choice(stored) if stored and rng.random() < 0.7 else []
        cut = rng.randrange(len(base) + 1) if base else 0
        tokens = base[:cut] + [rng.randrange(20) for _ in range(rng.randrange(1, 15))]
        expected = reference_match(stored, tokens, page=2)
        assert index.match(tokens).length == expected
        index.insert(tokens)
        stored.append(tokens[: len(tokens) - len(tokens) % 2])
        index.check_invariants()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(token_lists, st.integers(0, 12)), min_size=1, max_size=10),
    st.sampled_from([1, 2]),
    st.sampled_from([None, 8, 20]),
)
def test_extend_from_a_held_prefix_equals_insert_from_the_root(
    steps: list[tuple[list[int], int]], page: int, capacity: int | None
) -> None:
    """match a prefix, lock it, extend from it: the tree ends up exactly as after insert."""
    via_extend = RadixIndex(page_size=page, capacity_tokens=capacity)
    via_insert = RadixIndex(page_size=page, capacity_tokens=capacity)
    for now, (tokens, cut) in enumerate(steps):
        for index in (via_extend, via_insert):
            held = index.match(tokens[:cut], now=float(now)).node
            index.lock(held)
            if index is via_extend:
                index.extend(held, tokens, now=float(now))
            else:
                index.insert(tokens, now=float(now))
            index.unlock(held)
            index.check_invariants()
        assert shape(via_extend) == shape(via_insert)


def shape(index: RadixIndex) -> list[tuple[int, list[int], float]]:
    return [(depth, node.token_ids(), node.last_access) for depth, node in index.walk()]
