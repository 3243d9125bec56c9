"""The per-upstream index rebuilt from KV events: placement, holes, copies, namespaces."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.identity import CacheIdentity
from kvreuse.index import BlockIndex
from kvreuse.index.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvreuse.index.hashing import BlockHash
from kvreuse.kv_event_codec import decode_message, encode_message, encode_payload
from kvreuse.routing import CacheMirror, KvCleared, KvRemoved, KvStored, RequestView
from kvreuse.routing.event_index import EventIndex, salt_of
from kvreuse.tokens import pack


def h(value: int) -> BlockHash:
    return BlockHash(value.to_bytes(8, "big"))


def store(hashes: list[int], tokens: list[int], parent: int | None = None, size: int = 2,
          salt: str | None = None) -> BlockStored:
    extra = ((salt,), *([None] * (len(hashes) - 1))) if salt else None
    return BlockStored(tuple(h(x) for x in hashes), None if parent is None else h(parent),
                       tuple(tokens), size, extra_keys=extra)


def test_match_follows_parent_links_and_vllm_hit_rules() -> None:
    """Blocks chained by parent hash match whole blocks, at most num_tokens - 1 tokens."""
    index = EventIndex("r0")
    index.apply(store([1, 2], [10, 11, 12, 13]))
    index.apply(store([3], [14, 15], parent=2))
    assert index.match(pack([10, 11, 12, 13, 14, 15, 99])) == 6
    assert index.match(pack([10, 11, 12, 13, 14, 15])) == 4  # the last token is recomputed
    assert index.match(pack([10, 11, 12, 99, 14, 15, 1])) == 2
    assert index.match(pack([11, 11, 12])) == 0
    index.check_invariants()


def test_hash_values_do_not_matter_only_tokens_and_links() -> None:
    """Two indexes fed the same tokens under different hash seeds agree on every match."""
    a, b = EventIndex("a"), EventIndex("b")
    a.apply(store([1, 2], [5, 6, 7, 8]))
    b.apply(store([901, 902], [5, 6, 7, 8]))
    for prompt in ([5, 6, 7, 8, 9], [5, 6, 0], [5, 6, 7, 8]):
        assert a.match(pack(prompt)) == b.match(pack(prompt))


def test_removed_parent_leaves_an_unreachable_child() -> None:
    """vLLM can evict a parent while its child stays; the child is unreachable until the
    parent is stored again under its hash."""
    index = EventIndex("r0")
    index.apply(store([1, 2], [1, 2, 3, 4]))
    index.apply(BlockRemoved((h(1),)))
    assert index.match(pack([1, 2, 3, 4, 5])) == 0
    assert index.cached_tokens == 2 and index.num_blocks == 1
    index.apply(store([1], [1, 2]))
    assert index.match(pack([1, 2, 3, 4, 5])) == 4
    index.check_invariants()


def test_copies_of_one_hash_survive_one_removal() -> None:
    """Two running requests can cache the same block twice; one eviction leaves a copy."""
    index = EventIndex("r0")
    index.apply(store([1], [1, 2]))
    index.apply(store([1], [1, 2]))
    index.apply(BlockRemoved((h(1),)))
    assert index.match(pack([1, 2, 3])) == 2
    index.apply(BlockRemoved((h(1),)))
    assert index.match(pack([1, 2, 3])) == 0
    assert index.num_blocks == 0 and index.cached_tokens == 0
    index.check_invariants()


def test_salt_on_the_first_block_namespaces_the_tree() -> None:
    """A salted chain matches only requests with that salt, as in vLLM."""
    index = EventIndex("r0")
    index.apply(store([1, 2], [1, 2, 3, 4], salt="tenant-a"))
    prompt = pack([1, 2, 3, 4, 5])
    assert index.match(prompt, CacheIdentity(cache_salt="tenant-a")) == 4
    assert index.match(prompt, CacheIdentity(cache_salt="tenant-b")) == 0
    assert index.match(prompt) == 0


def test_salt_of_skips_the_lora_name_and_mm_pairs() -> None:
    """vLLM lists the LoRA name first and (mm_id, offset) pairs before the salt."""
    assert salt_of(("my-lora", ["img", 0], "s1"), "my-lora") == "s1"
    assert salt_of(("s2",), None) == "s2"
    assert salt_of(("my-lora",), "my-lora") is None
    assert salt_of(None, None) is None


def test_orphans_and_unknown_removals_are_counted_not_raised() -> None:
    """A block whose parent was never seen, or a removal of an unknown hash, is reported."""
    index = EventIndex("r0")
    assert index.apply(store([5], [1, 2], parent=4)).orphan_blocks == 1
    assert index.apply(BlockRemoved((h(77),))).unknown_removals == 1
    assert index.num_blocks == 0


def test_other_media_are_ignored() -> None:
    """Blocks stored to a CPU offload tier do not make GPU prefix hits."""
    index = EventIndex("r0")
    offloaded = BlockStored((h(1),), None, (1, 2), 2, medium="CPU")
    assert index.apply(offloaded).ignored
    assert index.match(pack([1, 2, 3])) == 0


def test_events_translate_to_routing_paths() -> None:
    """Stored blocks become KvStored of the full path; removals say what is kept."""
    index = EventIndex("r0")
    index.apply(store([1], [1, 2]))
    applied = index.apply(store([2], [3, 4], parent=1))
    assert applied.routing_events == (KvStored("r0", pack([1, 2, 3, 4])),)
    removed = index.apply(BlockRemoved((h(2),))).routing_events
    assert removed == (KvRemoved("r0", pack([1, 2, 3, 4]), 2),)
    cleared = index.apply(AllBlocksCleared(), now=3.0).routing_events
    assert cleared == (KvCleared("r0", 3.0),) and index.num_blocks == 0


def through_the_wire(events: list[KVCacheEvent], shape: str) -> list[KVCacheEvent]:
    payload = encode_payload(events, ts=0.0, shape=shape)
    return list(decode_message(encode_message("", 0, payload)).events)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(["map", "array"]))
def test_index_agrees_with_the_engines_block_index(seed: int, shape: str) -> None:
    """Differential: fed a BlockIndex's own events (64-bit hashes, either shape), the event
    index predicts exactly the hits the block index gives, under eviction pressure."""
    rng = random.Random(seed)
    events: list[KVCacheEvent] = []
    engine = BlockIndex(num_blocks=24, block_size=4, on_event=events.append)
    index = EventIndex("r0")
    salts = [None, "a", "b"]
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(5)]
    for step in range(60):
        identity = CacheIdentity(cache_salt=rng.choice(salts))
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
        tokens = pack(prompt)
        for event in through_the_wire(events, shape):
            index.apply(event)
        events.clear()
        expected = engine.match(tokens, identity, touch=False).length
        assert index.match(tokens, identity) == expected, f"step {step}"
        if rng.random() < 0.05:
            engine.reset()
        else:
            engine.insert(tokens, identity)
        index.check_invariants()


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_index_agrees_under_concurrent_requests(seed: int) -> None:
    """Differential with vLLM's per-request flow: overlapping requests cache duplicate copies
    of one block and free them in any order; the event index still predicts every hit."""
    rng = random.Random(seed)
    events: list[KVCacheEvent] = []
    engine = BlockIndex(num_blocks=40, block_size=4, on_event=events.append)
    index = EventIndex("r0")
    prefixes = [[rng.randrange(20) for _ in range(rng.randrange(8, 24))] for _ in range(3)]
    running: dict[int, list[int]] = {}
    for step in range(80):
        for event in events:
            index.apply(event)
        events.clear()
        if running and (rng.random() < 0.5 or len(running) > 4):
            request_id = rng.choice(sorted(running))
            prompt = running.pop(request_id)
            engine.cache_blocks(request_id, pack([*prompt, 7, 7, 7, 7]))
            engine.free_request(request_id)
            continue
        prompt = rng.choice(prefixes) + [rng.randrange(20) for _ in range(rng.randrange(1, 6))]
        tokens = pack(prompt)
        match = engine.match(tokens, touch=False)
        assert index.match(tokens) == match.length, f"step {step}"
        # Without its hit (admitted in the same step as an identical prompt), a request
        # recomputes and caches second copies of blocks that are already cached.
        hit = match if rng.random() < 0.6 else None
        if engine.allocate_slots(step, len(prompt) + 4, match=hit) is not None:
            engine.cache_blocks(step, tokens)
            running[step] = prompt
        index.check_invariants()


def test_budget_trims_the_blocks_stored_longest_ago() -> None:
    """Past its budget the index forgets its oldest blocks at once, says so in routing
    events, and never holds more than the budget."""
    index = EventIndex("r0", budget_tokens=8)
    removed: list[KvRemoved] = []
    for chain in range(10):
        base = 100 * chain
        applied = index.apply(store([base + 1, base + 2], [base, base + 1, base + 2, base + 3]))
        removed += [e for e in applied.routing_events if isinstance(e, KvRemoved)]
        assert index.tree_tokens <= 8
        index.check_invariants()
    assert index.match(pack([900, 901, 902, 903, 0])) == 4  # the newest chain stays
    assert index.match(pack([0, 1, 2, 3, 0])) == 0  # the oldest went
    assert index.trimmed_blocks == 16
    # Each trimmed chain is told as one run: its path, nothing kept.
    assert [(len(r.tokens) // 4, r.keep_tokens) for r in removed] == [(4, 0)] * 8
    assert {r.replica for r in removed} == {"r0"}


def test_a_hash_reused_for_other_tokens_moves_and_the_policy_hears_it() -> None:
    """A hash stored again for other tokens (a collision, a forged event) names the new block
    only, and the old block, left without a copy, is reported removed."""
    index = EventIndex("r0")
    index.apply(store([1, 2], [10, 11, 12, 13]))
    applied = index.apply(store([2], [20, 21]))
    removed = [e for e in applied.routing_events if isinstance(e, KvRemoved)]
    assert [(r.tokens, r.keep_tokens) for r in removed] == [(pack([10, 11, 12, 13]), 2)]
    assert isinstance(applied.routing_events[0], KvStored)  # then the old block's removal
    assert index.match(pack([10, 11, 12, 13, 0])) == 2
    assert index.match(pack([20, 21, 0])) == 2
    index.check_invariants()


def test_a_hash_moved_off_a_hole_child_keeps_the_chain_being_stored_in_the_tree() -> None:
    """Re-storing a hash whose old block was a hole's only child leaves the new chain linked
    (dropping the old block must not prune the hole the new chain is being stored into)."""
    index = EventIndex("r0")
    index.apply(store([1, 2], [10, 11, 12, 13]))
    index.apply(BlockRemoved((h(1),)))  # [10, 11] is a hole above [12, 13]
    index.apply(store([2, 3], [10, 11, 14, 15]))  # hash 2 moves into the hole's place
    assert index.match(pack([10, 11, 14, 15, 0])) == 4
    assert index.match(pack([10, 11, 12, 13, 0])) == 2
    index.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_forged_streams_keep_the_index_whole_and_the_policy_told(seed: int) -> None:
    """Seeded stress of forged events (reused hashes, unknown parents, stores below holes,
    removals of unknown blocks, clears): the index's invariants hold after every event, and a
    mirror fed only its routing events predicts exactly what the index matches."""
    rng = random.Random(seed)
    index = EventIndex("r0", budget_tokens=rng.choice([None, 64, 400]))
    mirror = CacheMirror(block_size=2)
    for step in range(300):
        roll = rng.random()
        event: KVCacheEvent
        if roll < 0.6:
            count = rng.randint(1, 4)
            parent = None if rng.random() < 0.4 else rng.randint(1, 40)
            event = store([rng.randint(1, 40) for _ in range(count)],
                          [rng.randint(0, 5) for _ in range(2 * count)], parent=parent)
        elif roll < 0.97:
            event = BlockRemoved(tuple(h(rng.randint(1, 40)) for _ in range(rng.randint(1, 3))))
        else:
            event = AllBlocksCleared()
        for routed in index.apply(event, float(step)).routing_events:
            mirror.apply(routed)
        index.check_invariants()
        mirror.check_invariants()
        for _ in range(3):
            probe = pack([rng.randint(0, 5) for _ in range(rng.randint(1, 12))] + [99])
            view = RequestView("p", probe, len(probe) // 4)
            assert mirror.predict(view, ["r0"], 0.0)["r0"] == index.match(probe), f"step {step}"


def test_budget_bounds_a_forged_chain_holes_included() -> None:
    """A long chain whose parents were removed keeps its holes in the tree; the budget counts
    them, so removing parents cannot be used to grow the tree past it."""
    index = EventIndex("r0", budget_tokens=64)
    parent = None
    for i in range(200):
        index.apply(store([i + 1], [2 * i, 2 * i + 1], parent=parent))
        if parent is not None:
            index.apply(BlockRemoved((h(parent),)))
        parent = i + 1
        assert index.tree_tokens <= 64
    index.check_invariants()


def test_emptied_namespaces_are_forgotten() -> None:
    """Removing a salt's last block drops its root: caller-chosen salts do not pile up."""
    index = EventIndex("r0")
    for n in range(50):
        index.apply(store([n + 1], [n, n], salt=f"salt-{n}"))
        index.apply(BlockRemoved((h(n + 1),)))
    assert index.identities() == []
    index.check_invariants()


def test_set_budget_trims_now_and_returns_what_went() -> None:
    """Lowering the budget trims immediately (a capacity scraped late)."""
    index = EventIndex("r0")
    for chain in range(4):
        index.apply(store([10 * chain + 1], [chain, chain]))
    events = index.set_budget(4)
    assert index.tree_tokens == 4 and len(events) == 2
    assert all(isinstance(e, KvRemoved) for e in events)
    index.check_invariants()


def test_blocks_of_another_size_start_the_tree_over() -> None:
    """The tree is filed by whole blocks: a store of another block size (a restarted engine
    with another --block-size, or a forged event) clears it and tells the policy so, instead
    of filing blocks of two sizes side by side."""
    index = EventIndex("r0")
    index.apply(store([1, 2], [10, 11, 12, 13]))
    applied = index.apply(store([5], [10, 11, 12, 13], size=4))
    assert isinstance(applied.routing_events[0], KvCleared)
    assert isinstance(applied.routing_events[1], KvStored)
    assert index.num_blocks == 1 and index.block_size == 4
    assert index.match(pack([10, 11, 12, 13, 14])) == 4
    index.check_invariants()
    # A removal naming a block of the old tree is unknown now, not a crash.
    assert index.apply(BlockRemoved((h(2),))).unknown_removals == 1
    index.check_invariants()
