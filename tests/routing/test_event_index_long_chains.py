"""Removals told as runs: long chains evicted tail first or trimmed cost work linear in their
tokens, and a policy told the runs holds exactly what it would hold told each block's own
removal."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from kvreuse.identity import CacheIdentity
from kvreuse.index.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvreuse.index.hashing import BlockHash
from kvreuse.routing import CacheMirror, KvEvent, KvRemoved, KvStored, RequestView
from kvreuse.routing.event_index import EventIndex
from kvreuse.tokens import TOKEN_BYTES, TokenBuffer, pack


def h(value: int) -> BlockHash:
    return BlockHash(value.to_bytes(8, "big"))


def held(mirror: CacheMirror) -> set[tuple[CacheIdentity, bytes]]:
    """Every token the mirror's (only) replica holds, named by its path: independent of how
    the mirror happens to cut its edges."""
    out: set[tuple[CacheIdentity, bytes]] = set()
    for identity in mirror.identities():
        stack = [(mirror.root(identity), b"")]
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                below = path + child.key
                if child.holders:
                    for end in range(len(path) + TOKEN_BYTES, len(below) + 1, TOKEN_BYTES):
                        out.add((identity, below[:end]))
                stack.append((child, below))
    return out


def per_block(event: KvEvent, block_size: int) -> list[KvEvent]:
    """The reference: a removal told block by block, deepest first (what the index told
    before runs), anything else as is."""
    if not isinstance(event, KvRemoved):
        return [event]
    end = len(event.tokens) // TOKEN_BYTES
    return [KvRemoved(event.replica, TokenBuffer(event.tokens[: stop * TOKEN_BYTES]),
                      stop - block_size, event.identity, event.time)
            for stop in range(end, event.keep_tokens, -block_size)]


def random_event(rng: random.Random, hashes: int, size: int) -> KVCacheEvent:
    roll = rng.random()
    if roll < 0.55:
        count = rng.randint(1, 6)
        parent = None if rng.random() < 0.4 else h(rng.randint(1, hashes))
        salt = rng.choice([None, None, "s"])
        extra = ((salt,), *([None] * (count - 1))) if salt else None
        return BlockStored(tuple(h(rng.randint(1, hashes)) for _ in range(count)), parent,
                           tuple(rng.randint(0, 3) for _ in range(size * count)), size,
                           extra_keys=extra)
    if roll < 0.98:
        return BlockRemoved(tuple(h(rng.randint(1, hashes)) for _ in range(rng.randint(1, 4))))
    return AllBlocksCleared()


@pytest.mark.parametrize("seed", range(40))
def test_runs_leave_the_policy_what_block_by_block_removals_would(seed: int) -> None:
    """Differential on seeded forged streams (shared leading tokens, holes, reused hashes,
    trims, clears): a mirror told the index's events one event at a time, one told whole
    batches (apply_batch), and one told every removal block by block hold the same tokens,
    and predict what the index matches."""
    rng = random.Random(seed)
    size = rng.choice([1, 2, 3])
    budget = rng.choice([None, 24, 60, 200])
    hashes = rng.choice([10, 40, 120])
    single, batched = EventIndex("r0", budget), EventIndex("r0", budget)
    told, told_batched, reference = CacheMirror(size), CacheMirror(size), CacheMirror(size)
    for step in range(150):
        batch = [random_event(rng, hashes, size) for _ in range(rng.randint(1, 8))]
        for event in batch:
            for routed in single.apply(event, float(step)).routing_events:
                told.apply(routed)
                for each in per_block(routed, single.block_size):
                    reference.apply(each)
        for routed in batched.apply_batch(batch, float(step)).routing_events:
            told_batched.apply(routed)
        single.check_invariants()
        batched.check_invariants()
        tokens = held(reference)
        assert held(told) == tokens, f"step {step}"
        assert held(told_batched) == tokens, f"step {step}"
        probe = pack([rng.randint(0, 3) for _ in range(rng.randint(1, 12))] + [99])
        view = RequestView("p", probe, len(probe) // 4)
        assert told_batched.predict(view, ["r0"], 0.0)["r0"] == batched.match(probe)


BLOCK = 16


def chain(blocks: int, first_hash: int = 1) -> BlockStored:
    return BlockStored(tuple(h(first_hash + i) for i in range(blocks)), None,
                       tuple((i * 7) % 50_000 for i in range(blocks * BLOCK)), BLOCK)


def told_tokens(events: tuple[KvEvent, ...] | list[KvEvent]) -> int:
    return sum(len(e.tokens) // TOKEN_BYTES for e in events
               if isinstance(e, KvStored | KvRemoved))


def test_a_long_chain_evicted_tail_first_is_one_run() -> None:
    """20,000 blocks stored, then evicted tail first, a BlockRemoved per block in one batch
    (what vLLM publishes): one KvRemoved of the chain, its tokens told once, not a path per
    block (O(n^2) tokens: 3.2 billion here)."""
    blocks = 20_000
    index = EventIndex("r0")
    mirror = CacheMirror(BLOCK)
    for routed in index.apply(chain(blocks)).routing_events:
        mirror.apply(routed)
    assert mirror.tree_tokens("r0") == blocks * BLOCK
    removals = [BlockRemoved((h(1 + i),)) for i in reversed(range(blocks))]
    applied = index.apply_batch(removals, 1.0)
    assert applied.unknown_removals == 0
    assert len(applied.routing_events) == 1
    (removed,) = applied.routing_events
    assert isinstance(removed, KvRemoved) and removed.keep_tokens == 0
    assert told_tokens(applied.routing_events) == blocks * BLOCK
    mirror.apply(removed)
    assert mirror.tree_tokens("r0") == 0 and index.tree_tokens == 0
    index.check_invariants()


def test_a_multi_block_removal_event_is_one_run() -> None:
    """One BlockRemoved naming a whole chain, tail first, is told as one run by apply."""
    blocks = 20_000
    index = EventIndex("r0")
    index.apply(chain(blocks))
    applied = index.apply(BlockRemoved(tuple(h(1 + i) for i in reversed(range(blocks)))))
    assert len(applied.routing_events) == 1
    assert told_tokens(applied.routing_events) == blocks * BLOCK


def test_a_chain_past_the_budget_trims_in_linear_memory() -> None:
    """A chain 1.1 x the budget, stored at once: the trim (which forgets the whole chain, its
    oldest blocks first becoming holes) is told as one run, and the memory it takes stays
    within a small multiple of the chain's (a path per block was 2.7 GB at 17,000 blocks)."""
    budget_blocks = 20_000
    blocks = budget_blocks * 11 // 10
    event = chain(blocks)
    index = EventIndex("r0", budget_tokens=budget_blocks * BLOCK)
    tracemalloc.start()
    try:
        applied = index.apply(event)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index.trimmed_blocks == blocks and index.tree_tokens == 0
    assert [type(e) for e in applied.routing_events] == [KvStored, KvRemoved]
    assert told_tokens(applied.routing_events) == 2 * blocks * BLOCK
    chain_bytes = blocks * BLOCK * TOKEN_BYTES
    assert peak < 64 * chain_bytes, f"peak {peak} bytes for a {chain_bytes}-byte chain"
    index.check_invariants()


def test_set_budget_trims_a_long_chain_as_one_run() -> None:
    index = EventIndex("r0")
    index.apply(chain(20_000))
    events = index.set_budget(BLOCK)
    assert [type(e) for e in events] == [KvRemoved]
    assert told_tokens(events) == 20_000 * BLOCK and index.tree_tokens == 0


def test_a_removed_block_with_a_sibling_starts_its_own_run() -> None:
    """Two blocks at one position sharing leading tokens: evicting one must leave the other
    whole, which KvRemoved only guarantees for a run's first block; so the parent's removal
    is told apart."""
    index = EventIndex("r0")
    mirror = CacheMirror(block_size=2)
    for event in (BlockStored((h(1), h(2)), None, (1, 2, 3, 4), 2),
                  BlockStored((h(3),), h(1), (3, 5), 2)):
        for routed in index.apply(event).routing_events:
            mirror.apply(routed)
    applied = index.apply(BlockRemoved((h(2), h(1))))
    assert [(len(e.tokens) // TOKEN_BYTES, e.keep_tokens) for e in applied.routing_events
            if isinstance(e, KvRemoved)] == [(4, 2), (2, 0)]
    for routed in applied.routing_events:
        mirror.apply(routed)
    # The parent again: [3, 5], whose first token the evicted [3, 4] shared, is reachable.
    for routed in index.apply(BlockStored((h(1),), None, (1, 2), 2)).routing_events:
        mirror.apply(routed)
    probe = pack([1, 2, 3, 5, 9])
    assert mirror.predict(RequestView("p", probe, 1), ["r0"], 0.0)["r0"] == index.match(probe) == 4


def test_a_batch_of_alternate_holes_overflows_instead_of_telling_n_squared_tokens() -> None:
    """Every other block of an 8,000-block chain removed (a forged stream: each hole would be
    told with its whole path, 256 million tokens): the batch reports overflowed with no routing
    events, past told_tokens_limit, and the index is still consistent."""
    index = EventIndex("r0")
    index.apply(chain(8_000))
    removals = [BlockRemoved((h(1 + i),)) for i in range(0, 7_999, 2)]
    applied = index.apply_batch(removals, 1.0)
    assert applied.overflowed and applied.routing_events == ()
    assert applied.unknown_removals == 0
    assert index.told_tokens_limit() < 256_000_000
    index.check_invariants()


def test_a_batch_under_the_limit_is_told_in_full() -> None:
    """The same holes on a 1,000-block chain tell 4 million tokens: under the limit, told."""
    index = EventIndex("r0")
    index.apply(chain(1_000))
    applied = index.apply_batch([BlockRemoved((h(1 + i),)) for i in range(0, 999, 2)], 1.0)
    assert not applied.overflowed and len(applied.routing_events) == 500


def test_a_snapshot_past_the_limit_is_none() -> None:
    """routing_snapshot of a chain with thousands of holes: None, not O(n^2) tokens."""
    index = EventIndex("r0")
    index.apply(chain(8_000))
    for i in range(0, 7_999, 2):
        index.apply(BlockRemoved((h(1 + i),)))
    assert index.routing_snapshot() is None
    small = EventIndex("r1")
    small.apply(chain(10))
    assert small.routing_snapshot() is not None


def test_the_limit_grows_with_the_budget() -> None:
    """At least MIN_TOLD_TOKENS_LIMIT, and 4 x the index's budget when that is larger."""
    from kvreuse.routing.event_index import MIN_TOLD_TOKENS_LIMIT

    index = EventIndex("r0")
    assert index.told_tokens_limit() == MIN_TOLD_TOKENS_LIMIT
    index.set_budget(MIN_TOLD_TOKENS_LIMIT)
    assert index.told_tokens_limit() == 4 * MIN_TOLD_TOKENS_LIMIT
