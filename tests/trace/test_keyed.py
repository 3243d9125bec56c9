"""Keyed chained block ids: equal prefixes, equal ids; nothing without the secret."""

from __future__ import annotations

import pytest

from kvreuse.errors import ConfigError
from kvreuse.tokens import pack
from kvreuse.trace.keyed import KeyedIds

SECRET = b"0123456789abcdef-secret"


def test_equal_prefixes_give_equal_ids_and_diverge_after() -> None:
    """Two prompts sharing their first 8 tokens share exactly the first two 4-token ids."""
    ids = KeyedIds(SECRET, 4)
    a = ids.block_ids(pack(list(range(10))))
    b = ids.block_ids(pack([*range(8), 99, 98, 97]))
    assert len(a) == 3 and len(b) == 3
    assert a[:2] == b[:2] and a[2] != b[2]
    assert all(0 <= i < 2**63 for i in a + b)


def test_ids_chain_the_whole_prefix() -> None:
    """A block equal in content but after a different prefix gets a different id."""
    ids = KeyedIds(SECRET, 2)
    assert ids.block_ids(pack([1, 2, 5, 6]))[1] != ids.block_ids(pack([3, 4, 5, 6]))[1]


def test_same_secret_agrees_other_secret_and_namespace_differ() -> None:
    """Two instances with one secret agree; another secret or cache salt changes every id."""
    tokens = pack(list(range(20)))
    first = KeyedIds(SECRET, 8).block_ids(tokens)
    assert KeyedIds(SECRET, 8).block_ids(tokens) == first
    other = KeyedIds(b"another-secret-of-16+", 8).block_ids(tokens)
    assert not set(other) & set(first)
    salted = KeyedIds(SECRET, 8).block_ids(tokens, "salt-a")
    assert not set(salted) & set(first)
    assert KeyedIds(SECRET, 8).tenant("acme") == KeyedIds(SECRET, 8).tenant("acme") != "acme"


def test_short_secret_and_bad_block_are_refused() -> None:
    """A secret under 16 bytes or a block < 1 is a ConfigError."""
    with pytest.raises(ConfigError, match="16 bytes"):
        KeyedIds(b"short", 4)
    with pytest.raises(ConfigError, match="block-size"):
        KeyedIds(SECRET, 0)
