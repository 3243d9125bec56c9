"""Synthesized prompts: equal ids become equal token runs; text that tokenizes back exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvreuse.errors import ConfigError
from kvreuse.trace.format import TraceRecord
from kvreuse.trace.replay import PromptSynthesizer, WordTable, vocabulary_alphabet


def record(ids: tuple[int, ...], length: int) -> TraceRecord:
    return TraceRecord(1, 0.0, length, 1, ids)


def test_equal_ids_give_equal_runs_and_prompts_are_cut() -> None:
    """Shared leading ids give a shared prefix of exactly those blocks; length is honoured."""
    synth = PromptSynthesizer(8, vocabulary_alphabet(1000, 100))
    a = synth.prompt(record((1, 2, 3), 20))
    b = synth.prompt(record((1, 2, 9), 24))
    assert len(a) == 20 and len(b) == 24
    assert a[:16] == b[:16] and a[16:20] != b[16:20]
    assert all(100 <= t < 1000 for t in a + b)
    assert PromptSynthesizer(8, vocabulary_alphabet(1000, 100)).prompt(record((1,), 8)) == a[:8]


def test_bad_vocabulary_is_refused() -> None:
    """A first token at or past the vocabulary is a ConfigError naming the flag."""
    with pytest.raises(ConfigError, match="--first-token"):
        vocabulary_alphabet(100, 100)


def test_word_table_text_tokenizes_back_exactly(tmp_path: Path) -> None:
    """With a real BPE tokenizer, the text of a synthesized run encodes to that very run."""
    from kvreuse.gateway.prompts import HFPromptTokenizer
    from kvreuse.testing.tiny_tokenizer import build_tokenizer_dir
    from kvreuse.tokens import unpack

    tokenizer = HFPromptTokenizer(build_tokenizer_dir(tmp_path, vocab_size=2000,
                                                      corpus_lines=3000))
    table = WordTable.build(tokenizer.vocab_size, tokenizer.decode,
                            lambda text: unpack(tokenizer.encode(text)))
    synth = PromptSynthesizer(64, table.tokens)
    tokens = synth.prompt(record((5, 6, 7, 8), 250))
    assert unpack(tokenizer.encode(table.render(tokens))) == tokens


def reference_run(block_id: int, block: int, alphabet: tuple[int, ...]) -> tuple[int, ...]:
    """The rule word by word, as first written: word j of SHA-256(id || counter) picks a token."""
    import hashlib

    out: list[int] = []
    counter = 0
    while len(out) < block:
        digest = hashlib.sha256(block_id.to_bytes(8, "big") + counter.to_bytes(4, "big")).digest()
        counter += 1
        out.extend(alphabet[int.from_bytes(digest[k:k + 4], "big") % len(alphabet)]
                   for k in range(0, 32, 4))
    return tuple(out[:block])


@pytest.mark.parametrize("block", [1, 7, 8, 9, 512])
def test_runs_match_the_word_by_word_rule(block: int) -> None:
    """The unpacked digests give the very tokens of the word-by-word rule, at any block size."""
    alphabet = tuple(vocabulary_alphabet(8192, 100))
    synth = PromptSynthesizer(block, alphabet)
    for block_id in (0, 1, 2**63 - 1, 123_456_789, *range(1000, 1040)):
        assert synth.run(block_id) == reference_run(block_id, block, alphabet)


def test_the_run_cache_is_bounded_in_tokens() -> None:
    """Past its token budget the cache drops its oldest runs, and a dropped run comes back equal."""
    synth = PromptSynthesizer(16, vocabulary_alphabet(1000, 100), cache_tokens=64)
    first = synth.run(0)
    for block_id in range(1, 100):
        synth.run(block_id)
        assert synth.cached_runs == min(block_id + 1, 4)
    assert synth.run(0) == first
