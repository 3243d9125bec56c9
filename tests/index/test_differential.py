"""Differential test: with unlimited capacity, the block index hits exactly what the radix index
matches, rounded by vLLM's rules: ``min(radix_length, num_tokens - 1)`` floored to a block."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.identity import CacheIdentity
from kvreuse.index import BlockIndex, RadixIndex
from kvreuse.tokens import pack

# An empty salt is deliberately absent: vLLM treats cache_salt="" as no salt, while the radix
# index keys on the identity object, so "" and None differ there.
IDENTITIES = [
    None,
    CacheIdentity(cache_salt="tenant-a"),
    CacheIdentity(cache_salt="tenant-b"),
    CacheIdentity(adapter="sql"),
    CacheIdentity(adapter="sql", cache_salt="tenant-a"),
    CacheIdentity(model="llama-3-8b"),
    CacheIdentity(model="llama-3-8b", template_revision="v2"),
    CacheIdentity(extra_keys=("img-1",)),
    CacheIdentity(extra_keys=("img-1", "img-2")),
]


def vllm_hit(radix_length: int, num_tokens: int, block_size: int) -> int:
    usable = min(radix_length, max(num_tokens - 1, 0))
    return usable - usable % block_size


def check_workload(
    ops: list[tuple[bool, list[int], CacheIdentity | None]], block_size: int
) -> None:
    capacity = sum(len(tokens) // block_size for _, tokens, _ in ops) + 2
    blocks = BlockIndex(num_blocks=capacity, block_size=block_size)
    radix = RadixIndex()
    for is_insert, tokens, identity in ops:
        if is_insert:
            radix.insert(tokens, identity)
            blocks.insert(pack(tokens) if len(tokens) % 2 else tokens, identity)
        else:
            expected = vllm_hit(radix.match(tokens, identity).length, len(tokens), block_size)
            assert blocks.match(tokens, identity).length == expected, (tokens, identity)
    blocks.check_invariants()
    radix.check_invariants()


def random_workload(
    rng: random.Random, length: int
) -> list[tuple[bool, list[int], CacheIdentity | None]]:
    """Prompts built from a few shared prefixes plus random tails, so matches end anywhere."""
    stems = [[rng.randrange(6) for _ in range(rng.randint(0, 60))] for _ in range(6)]
    ops = []
    for _ in range(length):
        stem = rng.choice(stems)
        cut = rng.randint(0, len(stem))
        tokens = [*stem[:cut], *(rng.randrange(6) for _ in range(rng.randint(0, 40)))]
        ops.append((rng.random() < 0.5, tokens, rng.choice(IDENTITIES)))
    return ops


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_agree(seed: int, block_size: int) -> None:
    """Seeded random workloads across identities: block hit == radix match by vLLM's rules."""
    check_workload(random_workload(random.Random(seed), 300), block_size)


token_lists = st.lists(st.integers(0, 3), max_size=40)
operations = st.lists(
    st.tuples(st.booleans(), token_lists, st.sampled_from(IDENTITIES)), max_size=25
)


@settings(max_examples=150, deadline=None)
@given(operations, st.sampled_from([1, 2, 4, 8, 16]))
def test_hypothesis_workloads_agree(
    ops: list[tuple[bool, list[int], CacheIdentity | None]], block_size: int
) -> None:
    """Hypothesis-generated workloads: block hit == radix match by vLLM's rules."""
    check_workload(ops, block_size)


def test_seed_004_numbers_through_both_indexes() -> None:
    """70 shared tokens: the radix index reuses 70, the block index 64."""
    radix, blocks = RadixIndex(), BlockIndex(num_blocks=16)
    shared = list(range(70))
    for index in (radix, blocks):
        index.insert([*shared, *range(500, 530)])
    query = [*shared, *range(900, 920)]
    assert radix.match(query).length == 70
    assert blocks.match(query).length == vllm_hit(70, len(query), 16) == 64
