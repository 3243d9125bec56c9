"""Behaviour of the radix-tree prefix index, one behaviour per test."""

from __future__ import annotations

import random

import pytest

from kvreuse.errors import ConfigError, IndexStateError, TokenError
from kvreuse.identity import CacheIdentity
from kvreuse.index import RadixIndex
from kvreuse.testing import ManualClock
from kvreuse.tokens import pack, unpack


def checked(index: RadixIndex) -> RadixIndex:
    index.check_invariants()
    return index


def test_empty_index_matches_nothing() -> None:
    """A fresh index matches zero tokens."""
    index = RadixIndex()
    assert index.match([1, 2, 3]).length == 0
    checked(index)


def test_insert_returns_new_tokens_only() -> None:
    """Insert reports only tokens it did not already hold."""
    index = RadixIndex()
    assert index.insert([1, 2, 3, 4]) == 4
    assert index.insert([1, 2, 3, 4, 5, 6]) == 2
    assert index.insert([1, 2]) == 0
    assert checked(index).total_tokens == 6


def test_match_is_token_granular() -> None:
    """Two prompts sharing 1,003 tokens reuse exactly 1,003 (seed 000)."""
    index = RadixIndex()
    shared = list(range(1003))
    index.insert([*shared, 7, 8, 9])
    assert index.match([*shared, 5, 5]).length == 1003
    checked(index)


def test_match_requires_first_token() -> None:
    """A match that differs at token 0 reuses nothing, however much follows."""
    index = RadixIndex()
    index.insert(list(range(100)))
    assert index.match([999, *range(1, 100)]).length == 0


def test_match_splits_edge_at_divergence() -> None:
    """Matching inside an edge splits it so the returned node ends at the match."""
    index = RadixIndex()
    index.insert(list(range(10)))
    hit = index.match([0, 1, 2, 3, 99])
    assert hit.length == 4
    assert hit.node.token_ids() == [0, 1, 2, 3]
    assert hit.node.depth_tokens() == 4
    assert index.num_nodes == 2
    checked(index)


def test_insert_diverging_inside_edge_branches() -> None:
    """An insert that diverges inside an edge splits it and adds a sibling branch."""
    index = RadixIndex()
    index.insert([1, 2, 3, 4])
    assert index.insert([1, 2, 9, 9]) == 2
    lengths = sorted(node.num_tokens for _, node in index.walk())
    assert lengths == [2, 2, 2]
    assert index.match([1, 2, 9, 9, 1]).length == 4
    checked(index)


def test_accepts_lists_buffers_and_arrays() -> None:
    """Lists, packed buffers and arrays of the same ids are interchangeable."""
    from array import array

    index = RadixIndex()
    index.insert(pack([5, 6, 7]))
    assert index.match([5, 6, 7]).length == 3
    assert index.match(array("I", [5, 6, 8])).length == 2


def test_rejects_negative_token_ids() -> None:
    """Negative token ids are a caller mistake with a clear error."""
    with pytest.raises(TokenError, match="token ids"):
        RadixIndex().insert([1, -2])


def test_identities_never_share_nodes() -> None:
    """The same tokens under another salt, adapter or model do not hit (seed 000)."""
    index = RadixIndex()
    tokens = list(range(50))
    index.insert(tokens, CacheIdentity(model="m", cache_salt="tenant-a"))
    assert index.match(tokens, CacheIdentity(model="m", cache_salt="tenant-a")).length == 50
    assert index.match(tokens, CacheIdentity(model="m", cache_salt="tenant-b")).length == 0
    assert index.match(tokens, CacheIdentity(model="m", adapter="lora1")).length == 0
    assert index.match(tokens, CacheIdentity(model="m2", cache_salt="tenant-a")).length == 0
    assert index.match(tokens).length == 0
    checked(index)


def test_page_size_rounds_matches_down_to_pages() -> None:
    """With pages of 4, a 10-token overlap reuses 8 tokens."""
    index = RadixIndex(page_size=4)
    index.insert(list(range(12)))
    assert index.match([*range(10), 99, 99]).length == 8
    checked(index)


def test_page_size_truncates_inserts_to_whole_pages() -> None:
    """Inserted tokens past the last whole page are not stored."""
    index = RadixIndex(page_size=4)
    assert index.insert(list(range(10))) == 8
    assert index.total_tokens == 8
    checked(index)


def test_page_size_keys_children_by_first_page() -> None:
    """Prompts sharing the first token but not the first page do not share a node."""
    index = RadixIndex(page_size=2)
    index.insert([1, 2, 3, 4])
    index.insert([1, 9, 3, 4])
    assert index.match([1, 9, 3, 4]).length == 4
    assert index.match([1, 2, 3, 5]).length == 2
    checked(index)


def test_evict_removes_least_recently_used_leaf_first() -> None:
    """LRU: the leaf touched longest ago goes first."""
    clock = ManualClock()
    index = RadixIndex(clock=clock)
    index.insert([1, 1, 1])
    clock.advance(1)
    index.insert([2, 2, 2])
    clock.advance(1)
    index.match([1, 1, 1])  # now [1,1,1] is more recent than [2,2,2]
    assert index.evict(1) == 3
    assert index.match([2, 2, 2]).length == 0
    assert index.match([1, 1, 1]).length == 3
    checked(index)


def test_exact_eviction_order_lru() -> None:
    """Evicting one token at a time removes leaves in exact access order."""
    index = RadixIndex()
    for t in range(5):
        index.insert([100 + t, 1, 2], now=float(t))
    index.match([102, 1, 2], now=10.0)
    index.match([100, 1, 2], now=11.0)
    order = []
    for _ in range(5):
        before = {n.token_ids()[0] for _, n in index.walk()}
        index.evict(1)
        after = {n.token_ids()[0] for _, n in index.walk()}
        order.extend(before - after)
        checked(index)
    assert order == [101, 103, 104, 102, 100]


def test_evict_ties_break_on_creation_order() -> None:
    """Leaves with equal access time are evicted oldest-created first."""
    index = RadixIndex()
    for t in (5, 3, 9):
        index.insert([t], now=1.0)
    evicted = []
    for _ in range(3):
        before = {n.token_ids()[0] for _, n in index.walk()}
        index.evict(1)
        evicted.extend(before - {n.token_ids()[0] for _, n in index.walk()})
    assert evicted == [5, 3, 9]


def test_parent_becomes_candidate_after_children_go() -> None:
    """A shared trunk is evicted only after its leaves, and then joins the candidates."""
    index = RadixIndex()
    index.insert([1, 2, 3, 10], now=5.0)
    index.insert([1, 2, 3, 20], now=6.0)
    # The trunk [1,2,3] was touched at 6.0 too, but leaves go first regardless.
    assert index.evict(1) == 1
    assert index.match([1, 2, 3, 20]).length == 4
    assert index.evict(2) == 4  # the other leaf, then the trunk
    assert index.total_tokens == 0
    checked(index)


def test_evict_frees_whole_leaves() -> None:
    """Eviction never splits a leaf, so it may free more than asked."""
    index = RadixIndex()
    index.insert(list(range(100)))
    assert index.evict(1) == 100
    assert index.total_tokens == 0


def test_evict_returns_zero_when_nothing_evictable() -> None:
    """With everything locked, evict frees nothing."""
    index = RadixIndex()
    index.insert([1, 2, 3])
    index.lock(index.match([1, 2, 3]).node)
    assert index.evict(10) == 0
    assert index.total_tokens == 3
    checked(index)


def test_locked_path_survives_eviction() -> None:
    """Nodes in use by running requests are never evicted."""
    index = RadixIndex()
    index.insert([1, 2, 3, 4], now=0.0)
    index.insert([9, 9], now=1.0)
    hit = index.match([1, 2, 3, 4], now=0.5)
    index.lock(hit.node)
    assert index.evict(100) == 2
    assert index.match([1, 2, 3, 4]).length == 4
    assert index.protected_tokens == 4
    checked(index)


def test_lock_protects_ancestors() -> None:
    """Locking a deep node pins every node up to the root."""
    index = RadixIndex()
    index.insert([1, 2, 3])
    index.insert([1, 2, 3, 4, 5])
    index.lock(index.match([1, 2, 3, 4, 5]).node)
    assert index.protected_tokens == 5
    assert index.evictable_tokens == 0
    checked(index)


def test_unlock_makes_tokens_evictable_again() -> None:
    """After unlock the tokens count as evictable and can be evicted."""
    index = RadixIndex()
    index.insert([1, 2, 3])
    node = index.match([1, 2, 3]).node
    index.lock(node)
    index.lock(node)
    index.unlock(node)
    assert index.protected_tokens == 3
    index.unlock(node)
    assert index.evictable_tokens == 3
    assert index.evict(3) == 3
    checked(index)


def test_unlock_without_lock_is_an_error() -> None:
    """Unlocking an unlocked node is a caller mistake."""
    index = RadixIndex()
    index.insert([1, 2])
    with pytest.raises(IndexStateError, match="without a matching lock"):
        index.unlock(index.match([1, 2]).node)


def test_lock_of_evicted_node_is_an_error() -> None:
    """A handle from before an eviction cannot be locked."""
    index = RadixIndex()
    index.insert([1, 2])
    node = index.match([1, 2]).node
    index.evict(2)
    with pytest.raises(IndexStateError, match="evicted"):
        index.lock(node)


def test_split_keeps_lock_counts() -> None:
    """Splitting a locked edge leaves both halves locked."""
    index = RadixIndex()
    index.insert([1, 2, 3, 4])
    full = index.match([1, 2, 3, 4]).node
    index.lock(full)
    index.match([1, 2, 9])  # splits the locked edge
    assert index.protected_tokens == 4
    checked(index)
    index.unlock(full)
    assert index.protected_tokens == 0
    checked(index)


def test_capacity_evicts_on_insert() -> None:
    """With a capacity, inserting evicts the oldest leaves first."""
    index = RadixIndex(capacity_tokens=10)
    index.insert([1] * 6, now=0.0)
    index.insert([2] * 6, now=1.0)
    assert index.match([1] * 6).length == 0
    assert index.match([2] * 6).length == 6
    assert index.total_tokens == 6
    checked(index)


def test_capacity_never_evicts_the_path_being_extended() -> None:
    """The prefix an insert extends survives that insert's eviction."""
    index = RadixIndex(capacity_tokens=8)
    index.insert([1, 1, 1, 1], now=0.0)
    index.insert([1, 1, 1, 1, 2, 2, 2, 2, 2], now=1.0)
    assert index.match([1, 1, 1, 1, 2]).length == 5
    checked(index)


def test_capacity_stores_only_what_fits_beside_locked_kv() -> None:
    """When locked KV fills the capacity, an insert stores only the part that fits."""
    index = RadixIndex(capacity_tokens=5)
    index.insert([1, 2, 3])
    index.lock(index.match([1, 2, 3]).node)
    assert index.insert([7, 7, 7, 7]) == 2
    assert index.total_tokens == 5
    checked(index)


def test_lfu_evicts_least_hit_first() -> None:
    """LFU keeps the prefix matched most often."""
    index = RadixIndex(eviction="lfu")
    index.insert([1, 1], now=0.0)
    index.insert([2, 2], now=0.0)
    for t in range(3):
        index.match([1, 1], now=float(t))
    index.match([2, 2], now=10.0)
    index.evict(1)
    assert index.match([1, 1]).length == 2
    assert index.match([2, 2]).length == 0


def test_fifo_ignores_access() -> None:
    """FIFO evicts the oldest insertion even if it was used last."""
    index = RadixIndex(eviction="fifo")
    index.insert([1, 1], now=0.0)
    index.insert([2, 2], now=1.0)
    index.match([1, 1], now=5.0)
    index.evict(1)
    assert index.match([1, 1]).length == 0


def test_priority_evicts_low_priority_first() -> None:
    """Priority eviction keeps high-priority prefixes over more recent low-priority ones."""
    index = RadixIndex(eviction="priority")
    index.insert([1, 1], now=0.0, priority=5)
    index.insert([2, 2], now=1.0, priority=0)
    index.evict(1)
    assert index.match([1, 1]).length == 2
    assert index.match([2, 2]).length == 0


def test_unknown_eviction_policy_names_choices() -> None:
    """A wrong policy name lists the valid ones."""
    with pytest.raises(ConfigError, match="lfu, lru"):
        RadixIndex(eviction="random")


def test_reset_drops_everything() -> None:
    """Reset empties the index (engine restart)."""
    index = RadixIndex()
    index.insert([1, 2, 3])
    index.lock(index.match([1, 2]).node)
    index.reset()
    assert index.total_tokens == 0 and index.protected_tokens == 0
    assert index.match([1, 2, 3]).length == 0
    checked(index)


def test_default_time_is_logical_not_wall_clock() -> None:
    """Without now or a clock, time is an operation counter: later operations are newer."""
    index = RadixIndex()
    index.insert([1])
    index.insert([2])
    index.evict(1)
    assert index.match([1]).length == 0
    assert index.match([2]).length == 1


def test_injected_clock_supplies_time() -> None:
    """The injected clock dates accesses when no ``now`` is given."""
    clock = ManualClock(now=42.0)
    index = RadixIndex(clock=clock)
    index.insert([3, 4])
    assert index.match([3, 4]).node.last_access == 42.0


def test_evicted_total_accumulates() -> None:
    """The index counts every token it ever evicted."""
    index = RadixIndex()
    index.insert([1, 2])
    index.insert([3, 4, 5])
    index.evict(10)
    assert index.evicted_tokens_total == 5


def test_six_turn_chat_prefills_2400() -> None:
    """Seed 001's table: 15,900 tokens without cache, 2,400 with the radix tree."""
    from kvreuse.six_turn import ChatShape, conversation_turns, replay

    turns = conversation_turns(ChatShape())
    prefilled = replay(RadixIndex(), turns)
    assert [len(p) // 4 for p, _ in turns] == [1650, 2050, 2450, 2850, 3250, 3650]
    assert prefilled == [1650, 150, 150, 150, 150, 150]
    assert sum(len(p) // 4 for p, _ in turns) == 15_900
    assert sum(prefilled) == 2_400


def test_on_evict_sees_each_leaf_with_its_path() -> None:
    """The eviction callback gets every evicted leaf while its full path is still readable."""
    seen: list[list[int]] = []
    index = RadixIndex(on_evict=lambda node: seen.append(unpack(node.path_key())))
    index.insert([1, 2, 3], now=0.0)
    index.insert([1, 2, 9], now=1.0)
    index.evict(100)
    assert seen == [[1, 2, 3], [1, 2, 9], [1, 2]]
    checked(index)


def test_extend_stores_the_rest_below_a_held_node() -> None:
    """extend from a matched node stores only the tokens past it and returns the new end."""
    index = RadixIndex()
    index.insert([1, 2, 3], now=0.0)
    held = index.match([1, 2, 3, 4, 5], now=1.0).node
    end = index.extend(held, [1, 2, 3, 4, 5], now=2.0)
    assert end.depth_tokens() == 5 and end.parent is held
    assert index.total_tokens == 5
    assert index.match([1, 2, 3, 4, 5], now=3.0).length == 5
    checked(index)


def test_extend_touches_the_path_above_the_node() -> None:
    """extend refreshes the ancestors' access time, as insert from the root would."""
    index = RadixIndex()
    index.insert([1, 2], now=0.0)
    index.insert([1, 2, 3, 4], now=1.0)
    held = index.match([1, 2, 3, 4], now=1.0).node
    index.extend(held, [1, 2, 3, 4, 5], now=7.0)
    node = held
    while node.parent is not None:
        assert node.last_access == 7.0
        node = node.parent


def test_extend_from_a_node_that_was_split_since() -> None:
    """A held node split by a later insert still ends where it did, so extend works from it."""
    index = RadixIndex()
    index.insert([1, 2, 3, 4], now=0.0)
    held = index.match([1, 2, 3, 4], now=0.0).node
    index.lock(held)
    index.insert([1, 2, 9], now=1.0)  # splits the [1, 2, 3, 4] edge above the held node
    end = index.extend(held, [1, 2, 3, 4, 5, 6], now=2.0)
    assert end.depth_tokens() == 6
    assert index.match([1, 2, 3, 4, 5, 6], now=3.0).length == 6
    checked(index)


def test_extend_returns_the_node_itself_when_nothing_is_new() -> None:
    """extend with no tokens past the node stores nothing and returns the deepest match."""
    index = RadixIndex()
    index.insert([1, 2, 3], now=0.0)
    held = index.match([1, 2, 3], now=0.0).node
    assert index.extend(held, [1, 2, 3], now=1.0) is held
    assert index.total_tokens == 3


def test_extend_rejects_a_node_off_the_path() -> None:
    """extend from a node that does not end on the tokens' path is a caller mistake."""
    index = RadixIndex()
    index.insert([1, 2, 3], now=0.0)
    held = index.match([1, 2, 3], now=0.0).node
    with pytest.raises(IndexStateError, match="path"):
        index.extend(held, [1, 2, 7, 8], now=1.0)
    with pytest.raises(IndexStateError, match="path"):
        index.extend(held, [1, 2], now=1.0)


def test_extend_of_evicted_node_is_an_error() -> None:
    """extend from a node eviction removed says to match again."""
    index = RadixIndex()
    index.insert([1, 2, 3], now=0.0)
    held = index.match([1, 2, 3], now=0.0).node
    index.evict(3)
    with pytest.raises(IndexStateError, match="match again"):
        index.extend(held, [1, 2, 3, 4], now=1.0)


def test_extend_under_capacity_keeps_the_held_path() -> None:
    """With a capacity, extend evicts other leaves, never the path it grows."""
    index = RadixIndex(capacity_tokens=6)
    index.insert([9, 9, 9], now=0.0)
    index.insert([1, 2], now=1.0)
    held = index.match([1, 2], now=2.0).node
    end = index.extend(held, [1, 2, 3, 4, 5, 6], now=3.0)
    assert end.depth_tokens() == 6
    assert index.match([9], now=4.0).length == 0
    checked(index)


def test_match_length_agrees_with_match_and_touches_alike() -> None:
    """match_length returns match's length and leaves the tree as match would."""
    index, twin = RadixIndex(), RadixIndex()
    for tree in (index, twin):
        tree.insert([1, 2, 3, 4], now=0.0)
        tree.insert([1, 2, 9], now=1.0)
    assert index.match_length([1, 2, 3, 7], now=5.0) == twin.match([1, 2, 3, 7], now=5.0).length
    shape = [(d, n.token_ids(), n.last_access, n.hit_count) for d, n in index.walk()]
    assert shape == [(d, n.token_ids(), n.last_access, n.hit_count) for d, n in twin.walk()]
    checked(index)


def shape(index: RadixIndex) -> list[tuple[int, list[int], float, int]]:
    return [(d, n.token_ids(), n.last_access, n.hit_count) for d, n in index.walk()]


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_length_reads_what_match_finds_and_changes_nothing(page_size: int) -> None:
    """prefix_length equals match's length on every query (seeded) and leaves the tree node for
    node as an unread twin: no touch, no split, no new root."""
    rng = random.Random(page_size)
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 40))] for _ in range(60)]
    read, unread, matched = (RadixIndex(page_size=page_size) for _ in range(3))
    for when, prompt in enumerate(prompts):
        for index in (read, unread, matched):
            index.insert(prompt, now=float(when))
    other = CacheIdentity(model="other")
    for query in [*prompts, *([rng.randrange(3) for _ in range(30)] for _ in range(60))]:
        assert read.prefix_length(query) == matched.match(query, now=1e6).length
        assert read.prefix_length(query, other) == 0
    assert shape(read) == shape(unread) and other not in read.identities()
    checked(read)
