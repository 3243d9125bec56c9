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
