"""Packed token buffers: packing round trips and the common-prefix search."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.tokens import common_prefix_tokens, pack, unpack

token_lists = st.lists(st.integers(0, 3), max_size=40)


@settings(max_examples=300, deadline=None)
@given(token_lists, token_lists)
def test_common_prefix_tokens_equals_a_token_by_token_scan(a: list[int], b: list[int]) -> None:
    """The bisecting search agrees with the first differing position, either order."""
    expected = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                    min(len(a), len(b)))
    assert common_prefix_tokens(pack(a), pack(b)) == expected
    assert common_prefix_tokens(pack(b), pack(a)) == expected


def test_common_prefix_tokens_finds_a_late_divergence_in_long_buffers() -> None:
    """A divergence 1,500 tokens into 2,000-token buffers is found exactly."""
    base = list(range(2000))
    other = [*base[:1500], 9, *base[1501:]]
    assert common_prefix_tokens(pack(base), pack(other)) == 1500
    assert common_prefix_tokens(pack(base), pack(base[:1700])) == 1700


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=50))
def test_pack_unpack_round_trip(ids: list[int]) -> None:
    """Every uint32 id survives packing and unpacking."""
    assert unpack(pack(ids)) == ids
