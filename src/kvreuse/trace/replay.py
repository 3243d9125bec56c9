"""Prompts for a trace's requests, so an engine sees the trace's prefix structure.

Each hash id becomes a run of ``block`` token ids drawn from ``[first_token, vocab_size)`` by a
counter-mode hash of the id (SHA-256 of ``id || j``), so equal ids give equal runs and, ids being
chained, equal leading ids give equal prefixes; different ids collide on a token with
probability 1 / (vocab - first_token) per position, which keeps whole blocks apart. A prompt is
its ids' runs cut to ``input_length``. Token-id prompts go to ``/v1/completions`` as they are;
with a tokenizer the runs are drawn from :class:`WordTable`'s tokens, whose text tokenizes back
to exactly those tokens. Pure: no I/O.

A run costs about 150 us (64 SHA-256 digests unpacked as one ``struct`` of big-endian words;
the per-word loop it replaced took 420 us), and runs are cached up to :data:`CACHE_TOKENS`
tokens, oldest dropped first: the Mooncake trace's 43,924 distinct ids would otherwise hold
180 MB of runs.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvreuse.errors import ConfigError, require_at_least
from kvreuse.trace.format import TraceRecord

CACHE_TOKENS = 1 << 22
"""Tokens of runs a synthesizer keeps (4M: 32 MB of tuple slots, the ints are the alphabet's)."""


class PromptSynthesizer:
    """Token runs per id, cached (a trace reuses ids). ``alphabet`` is the token ids to draw
    from (all of ``[first_token, vocab_size)`` without a tokenizer)."""

    def __init__(self, block: int, alphabet: Sequence[int],
                 cache_tokens: int = CACHE_TOKENS) -> None:
        require_at_least("block", block, 1)
        if len(alphabet) < 2:
            raise ConfigError("prompts need at least 2 distinct tokens to draw from")
        self.block = block
        self.alphabet = tuple(alphabet)
        self._digests = -(-block // 8)  # a SHA-256 digest is 8 big-endian 32-bit words
        self._words = struct.Struct(f">{block}I")
        self._max_runs = max(1, cache_tokens // block)
        self._runs: dict[int, tuple[int, ...]] = {}

    def run(self, block_id: int) -> tuple[int, ...]:
        """The ``block`` tokens of ``block_id``: word ``j`` of ``SHA-256(id || counter)``
        (id 8 bytes, counter 4, big-endian) modulo the alphabet's size picks token
        ``8 * counter + j``. O(block)."""
        cached = self._runs.get(block_id)
        if cached is not None:
            return cached
        seed = block_id.to_bytes(8, "big")
        sha256 = hashlib.sha256
        digests = b"".join([sha256(seed + counter.to_bytes(4, "big")).digest()
                            for counter in range(self._digests)])
        alphabet, size = self.alphabet, len(self.alphabet)
        run = tuple([alphabet[word % size] for word in self._words.unpack_from(digests)])
        if len(self._runs) >= self._max_runs:  # oldest first: dicts keep insertion order
            del self._runs[next(iter(self._runs))]
        self._runs[block_id] = run
        return run

    @property
    def cached_runs(self) -> int:
        """How many runs the cache holds now (at most ``cache_tokens // block``)."""
        return len(self._runs)

    def prompt(self, record: TraceRecord) -> list[int]:
        tokens: list[int] = []
        for block_id in record.hash_ids:
            tokens.extend(self.run(block_id))
        return tokens[: record.input_length]


def vocabulary_alphabet(vocab_size: int, first_token: int) -> list[int]:
    if not 0 <= first_token < vocab_size - 1:
        raise ConfigError(f"--first-token must be in [0, vocab size - 1), got {first_token} "
                          f"with --vocab-size {vocab_size}")
    return list(range(first_token, vocab_size))


@dataclass(frozen=True, slots=True)
class WordTable:
    """Tokens whose decoded text, concatenated, tokenizes back to the same tokens: each is a
    word with a leading space, letters only, that encodes to itself alone. ``text`` maps a
    token to its text."""

    tokens: tuple[int, ...]
    text: dict[int, str]

    @classmethod
    def build(cls, vocab_size: int, decode: Callable[[list[int]], str],
              encode: Callable[[str], list[int]], limit: int = 4096) -> WordTable:
        tokens: list[int] = []
        text: dict[int, str] = {}
        for token in range(vocab_size):
            word = decode([token])
            if len(word) < 3 or not word.startswith(" ") or not word[1:].isalpha():
                continue
            if not word[1:].isascii() or encode(word) != [token]:
                continue
            tokens.append(token)
            text[token] = word
            if len(tokens) >= limit:
                break
        if len(tokens) < 2:
            raise ConfigError("the tokenizer has too few plain-word tokens to synthesize "
                              "text prompts; replay token-id prompts without --tokenizer")
        return cls(tuple(tokens), text)

    def render(self, tokens: Sequence[int]) -> str:
        return "".join(self.text[t] for t in tokens)


LATE_S = 0.1
"""A request the replay sends this many seconds after its time or later counts as sent late:
the client could not keep up, and the target saw a gentler load than the trace's."""


@dataclass(frozen=True, slots=True)
class ReplaySummary:
    """What a replay measured. Times in seconds; rates are fractions."""

    sent: int
    ok: int
    errors: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p95_s: float | None
    ttft_p99_s: float | None
    prompt_tokens: int
    usage_cached_tokens: int | None
    usage_hit_rate: float | None
    engine_hit_rate: float | None
    duration_s: float
    sent_late: int = 0  # requests the client got out more than LATE_S after their time
    worst_late_s: float = 0.0

    @property
    def token_hit_rate(self) -> float | None:
        """The engines' own counters when read, else usage's cached tokens."""
        return self.engine_hit_rate if self.engine_hit_rate is not None else self.usage_hit_rate

    def as_dict(self) -> dict[str, object]:
        return {
            "sent": self.sent, "ok": self.ok, "errors": self.errors,
            "ttft_p50_s": self.ttft_p50_s, "ttft_p90_s": self.ttft_p90_s,
            "ttft_p95_s": self.ttft_p95_s, "ttft_p99_s": self.ttft_p99_s,
            "prompt_tokens": self.prompt_tokens,
            "usage_cached_tokens": self.usage_cached_tokens,
            "usage_hit_rate": self.usage_hit_rate, "engine_hit_rate": self.engine_hit_rate,
            "token_hit_rate": self.token_hit_rate, "duration_s": self.duration_s,
            "sent_late": self.sent_late, "worst_late_s": self.worst_late_s,
        }
