"""The tokenizer contract the prompt tools and the gateway depend on, and helpers shared by its
implementations.

Prefix caches key on token ids, not characters, so every prompt tool measures on the ids a real
tokenizer produces for the *whole* rendered prompt. Implementations live beside this module in
:mod:`kvreuse.tokenizers` (they read files); this module and :mod:`.chat_template` stay pure.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class Encoded:
    """Token ids of a text and, for each token, the character offset where it starts."""

    ids: tuple[int, ...]
    starts: tuple[int, ...]

    def __post_init__(self) -> None:
        assert len(self.ids) == len(self.starts), "one start offset per token"

    def char_offset(self, token_index: int, text_length: int) -> int:
        """Character offset of token ``token_index``; ``text_length`` past the last token."""
        if token_index >= len(self.starts):
            return text_length
        return self.starts[token_index]


@runtime_checkable
class Tokenizer(Protocol):
    """A real tokenizer, loaded offline.

    ``encode`` is called once per rendered prompt and must not add BOS/EOS on its own: chat
    templates emit them, exactly as ``apply_chat_template(tokenize=True)`` tokenizes with
    ``add_special_tokens=False``. Special-token text in the prompt (``<|im_start|>``) maps to
    the special id.
    """

    @property
    def name(self) -> str:
        """A short, human-readable name (``gpt2``, ``o200k_base``, a directory name)."""
        ...

    @property
    def revision(self) -> str:
        """Hex sha256 over the tokenizer's files and settings; changes whenever ids may change."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``. Called per prompt; O(len(text))."""
        ...

    def encode_with_offsets(self, text: str) -> Encoded:
        """Token ids plus the character offset each token starts at (for diffs and audits)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, for readable diffs only (never used to compare prompts)."""
        ...


def starts_from_pieces(text: str, pieces: Sequence[bytes]) -> tuple[int, ...]:
    """Character start offsets of byte-level tokens whose bytes concatenate to ``text``.

    A token that begins inside a multi-byte character is reported at that character.
    O(len(text) + len(pieces)).
    """
    encoded = text.encode("utf-8")
    char_at_byte = [0] * (len(encoded) + 1)
    byte_pos = 0
    for char_index, char in enumerate(text):
        width = len(char.encode("utf-8"))
        for offset in range(width):
            char_at_byte[byte_pos + offset] = char_index
        byte_pos += width
    char_at_byte[len(encoded)] = len(text)
    starts: list[int] = []
    byte_pos = 0
    for piece in pieces:
        starts.append(char_at_byte[min(byte_pos, len(encoded))])
        byte_pos += len(piece)
    return tuple(starts)


def special_pattern(specials: Sequence[str]) -> re.Pattern[str] | None:
    """One regex matching any special-token string, longest first at each position.

    Build it once per tokenizer: Mistral's tekken file alone defines a thousand specials.
    """
    if not specials:
        return None
    ordered = sorted(set(specials), key=len, reverse=True)
    return re.compile("|".join(re.escape(special) for special in ordered))


def split_on_specials(text: str, pattern: re.Pattern[str] | None) -> list[tuple[str, bool]]:
    """Split ``text`` into (chunk, is_special) runs at the special tokens ``pattern`` matches.

    Byte-level BPE tokenizers encode ordinary text and special markers separately; this is the
    split tiktoken applies with ``allowed_special="all"``. O(len(text)).
    """
    if pattern is None:
        return [(text, False)] if text else []
    runs: list[tuple[str, bool]] = []
    plain_start = 0
    for match in pattern.finditer(text):
        if match.start() > plain_start:
            runs.append((text[plain_start : match.start()], False))
        runs.append((match.group(), True))
        plain_start = match.end()
    if plain_start < len(text):
        runs.append((text[plain_start:], False))
    return runs
