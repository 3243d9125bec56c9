"""Leading-token fingerprints: block alignment, revisions, chained block hashes, JSON."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.lint.fingerprint import PrefixFingerprint, Revisions, aligned_length, fingerprint

IDS = list(range(1000, 1100))


def test_covers_whole_blocks_only() -> None:
    """100 tokens with blocks of 16 fingerprint the first 96."""
    result = fingerprint(IDS, n=2048, block_size=16)
    assert result.tokens == 96
    assert result.prompt_tokens == 100
    assert len(result.block_digests) == 6


def test_tokens_after_n_do_not_matter() -> None:
    """Prompts equal in their first n tokens have equal fingerprints."""
    a = fingerprint([*IDS[:64], 1, 2, 3], n=64)
    b = fingerprint([*IDS[:64], 9, 9], n=64)
    assert a.digest == b.digest


def test_a_token_inside_the_prefix_changes_everything_from_its_block() -> None:
    """Changing token 40 changes the digest and block hashes from block 2 on."""
    changed = list(IDS)
    changed[40] += 1
    a, b = fingerprint(IDS, n=96), fingerprint(changed, n=96)
    assert a.digest != b.digest
    assert a.first_different_block(b) == 2
    assert a.block_digests[:2] == b.block_digests[:2]


def test_revisions_change_the_digest_but_not_the_tokens_digest() -> None:
    """A model revision change is a different fingerprint over the same tokens."""
    a = fingerprint(IDS, revisions=Revisions("tok", "tpl", "m1"))
    b = fingerprint(IDS, revisions=Revisions("tok", "tpl", "m2"))
    assert a.digest != b.digest
    assert a.tokens_digest == b.tokens_digest
    assert a.revisions.changed_fields(b.revisions) == ["model"]


def test_n_must_be_a_multiple_of_the_block_size() -> None:
    """--tokens 100 with blocks of 16 is refused with a suggestion."""
    with pytest.raises(ConfigError, match="multiple of the block size"):
        fingerprint(IDS, n=100, block_size=16)


def test_json_round_trip_and_no_prompt_text() -> None:
    """to_json/from_json round-trip; the JSON holds hashes and counts only."""
    result = fingerprint(IDS, revisions=Revisions("t", "p", "m"))
    data = result.to_json()
    assert PrefixFingerprint.from_json(json.loads(json.dumps(data))) == result
    assert set(data) == {
        "fingerprint", "tokens_sha256", "tokens", "prompt_tokens", "block_size",
        "tokenizer_revision", "template_revision", "model_revision", "block_hashes",
    }
    assert "1000" not in json.dumps(data["block_hashes"])


def test_from_json_names_the_missing_field() -> None:
    """A golden entry without 'tokens' is an InputFormatError naming it."""
    data = fingerprint(IDS).to_json()
    del data["tokens"]
    with pytest.raises(InputFormatError, match="'tokens'"):
        PrefixFingerprint.from_json(data, "golden")


@given(st.integers(0, 5000), st.integers(1, 200), st.sampled_from([1, 16, 32, 256]))
def test_aligned_length_is_a_whole_number_of_blocks_within_bounds(
    prompt: int, blocks: int, block_size: int
) -> None:
    """Property: the covered length is a multiple of the block size, <= n and <= the prompt."""
    covered = aligned_length(prompt, blocks * block_size, block_size)
    assert covered % block_size == 0
    assert covered <= min(prompt, blocks * block_size)
    assert min(prompt, blocks * block_size) - covered < block_size
