"""A RadixIndex pickles and copies into an equal, independent index (compiled core or not)."""

from __future__ import annotations

import copy
import pickle
import random
from collections.abc import Callable

import pytest

from kvreuse.identity import CacheIdentity
from kvreuse.index import RadixIndex
from kvreuse.tokens import pack

ROUND_TRIPS: dict[str, Callable[[RadixIndex], RadixIndex]] = {
    "pickle": lambda index: pickle.loads(pickle.dumps(index)),
    "deepcopy": copy.deepcopy,
}


def populated() -> tuple[RadixIndex, list[tuple[bytes, CacheIdentity | None]]]:
    """A seeded index past its capacity (so it has evicted), under two identities."""
    rng = random.Random(5)
    index = RadixIndex(capacity_tokens=1500)
    prompts = []
    for i in range(60):
        shared = range(rng.randrange(4) * 100, 200)
        prompt = pack([*shared, *(rng.randrange(50) for _ in range(40))])
        identity = CacheIdentity(cache_salt="t1") if i % 3 == 0 else None
        index.insert(prompt, identity, now=float(i))
        prompts.append((prompt, identity))
    return index, prompts


@pytest.mark.parametrize("how", sorted(ROUND_TRIPS))
def test_a_copy_answers_like_the_original(how: str) -> None:
    """Same matches and totals, invariants intact."""
    index, prompts = populated()
    twin = ROUND_TRIPS[how](index)
    twin.check_invariants()
    assert twin.total_tokens == index.total_tokens
    assert index.evicted_tokens_total > 0
    for prompt, identity in prompts:
        assert twin.match_length(prompt, identity) == index.match_length(prompt, identity)


@pytest.mark.parametrize("how", sorted(ROUND_TRIPS))
def test_a_copy_is_independent(how: str) -> None:
    """Evicting from the copy leaves the original whole."""
    index, _ = populated()
    before = index.total_tokens
    twin = ROUND_TRIPS[how](index)
    twin.evict(before)
    twin.check_invariants()
    index.check_invariants()
    assert twin.total_tokens == 0 and index.total_tokens == before
