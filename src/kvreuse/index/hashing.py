"""vLLM-compatible prefix-cache block hashes (vLLM 0.32 ``kv_cache_utils``), byte for byte.

Only full blocks are hashed. Block ``i`` hashes ``(parent_hash, tuple(token_ids), extra_keys)``
with the chosen algorithm; block 0's parent is ``NONE_HASH``, the algorithm applied to a seed
string. Equal hashes therefore mean equal prefixes from token 0 under equal extra keys (seed 000).

* Algorithms: ``sha256`` (pickle, highest protocol), ``sha256_cbor`` (canonical CBOR), ``xxhash``
  and ``xxhash_cbor`` (XXH3-128 of the same serialisations).
* NONE_HASH seed, as vLLM's ``resolve_none_hash_seed``: ``PYTHONHASHSEED`` when set; else the
  fixed ``"vllm-none-hash"`` for the sha256 algorithms and 32 random bytes (hex) per process for
  the xxhash ones, so xxhash hashes only agree across processes that share ``PYTHONHASHSEED`` (or
  pass ``none_hash_seed``). This module and ``os.urandom`` are the only sources of environment and
  randomness in the index core, because vLLM compatibility demands them.
* Extra keys (:mod:`kvreuse.index.extra_keys`): vLLM's tagged LoRA, multimodal, salt and
  prompt-embeds keys, plus kvreuse's identity keys; ``None`` when a block has none.
* KV events carry ``int.from_bytes(hash, "big") & (2**64 - 1)``: :func:`block_hash_to_int`.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import islice
from typing import NewType, cast

import cbor2
import xxhash

from kvreuse.errors import ConfigError, require_at_least
from kvreuse.index.extra_keys import (
    NO_EXTRA_KEYS,
    ExtraKeys,
    ExtraKeySpec,
    MultiModalSpan,
    PromptEmbeds,
    canonical_extra_keys,
)
from kvreuse.tokens import TOKEN_BYTES, Tokens, as_buffer, unpack

BlockHash = NewType("BlockHash", bytes)
"""A block's chained hash: 32 bytes for the sha256 algorithms, 16 for the xxhash ones."""

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


# Each algorithm is one Python frame with its callees bound as defaults (locals, not globals):
# hashing runs once per block, and vLLM pays two or three frames per block for the same bytes.
_Digest = Callable[[bytes], "hashlib._Hash"]


def _sha256_pickle(
    obj: object, _sha256: _Digest = hashlib.sha256, _dumps: Callable[..., bytes] = pickle.dumps
) -> bytes:
    return _sha256(_dumps(obj, pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(
    obj: object, _sha256: _Digest = hashlib.sha256, _dumps: Callable[..., bytes] = cbor2.dumps
) -> bytes:
    return _sha256(_dumps(obj, canonical=True)).digest()


def _xxhash_pickle(
    obj: object,
    _xxh: Callable[[bytes], bytes] = xxhash.xxh3_128_digest,
    _dumps: Callable[..., bytes] = pickle.dumps,
) -> bytes:
    return _xxh(_dumps(obj, pickle.HIGHEST_PROTOCOL))


def _xxhash_cbor(
    obj: object,
    _xxh: Callable[[bytes], bytes] = xxhash.xxh3_128_digest,
    _dumps: Callable[..., bytes] = cbor2.dumps,
) -> bytes:
    return _xxh(_dumps(obj, canonical=True))


@dataclass(frozen=True, slots=True)
class HashAlgorithm:
    """One of vLLM's prefix-caching hash functions (``vllm.utils.hashing``)."""

    name: str
    hash_object: Callable[[object], bytes]
    cryptographic: bool


HASH_ALGORITHMS: dict[str, HashAlgorithm] = {
    "sha256": HashAlgorithm("sha256", _sha256_pickle, True),
    "sha256_cbor": HashAlgorithm("sha256_cbor", _sha256_cbor, True),
    "xxhash": HashAlgorithm("xxhash", _xxhash_pickle, False),
    "xxhash_cbor": HashAlgorithm("xxhash_cbor", _xxhash_cbor, False),
}


def hash_algorithm(name: str) -> HashAlgorithm:
    """Look an algorithm up by vLLM's name; raises :class:`ConfigError` naming the choices."""
    try:
        return HASH_ALGORITHMS[name]
    except KeyError:
        choices = ", ".join(sorted(HASH_ALGORITHMS))
        raise ConfigError(f"unknown hash algorithm {name!r}; choose one of: {choices}") from None


def resolve_none_hash_seed(algorithm: str, environ: Mapping[str, str] | None = None) -> str:
    """The seed vLLM derives NONE_HASH from: PYTHONHASHSEED if set, else the fixed default for
    cryptographic algorithms and a fresh random seed for the others."""
    env = os.environ if environ is None else environ
    seed = env.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if hash_algorithm(algorithm).cryptographic:
        return DEFAULT_NONE_HASH_SEED
    return os.urandom(32).hex()


def block_hash_to_int(block_hash: bytes) -> int:
    """The 64-bit integer vLLM's KV events carry for a block hash (its low 64 bits, big-endian)."""
    return int.from_bytes(block_hash[-8:], "big")


def token_ids_view(tokens: Tokens) -> Sequence[int]:
    """``tokens`` as a sliceable sequence of Python ints: sequences as they are, buffers
    unpacked to a list. O(1), or O(n) for a buffer."""
    if isinstance(tokens, bytes):
        return unpack(as_buffer(tokens))  # as_buffer validates the length
    return tokens


def num_tokens_of(tokens: Tokens) -> int:
    """Token count without unpacking. O(1)."""
    return len(tokens) // TOKEN_BYTES if isinstance(tokens, bytes) else len(tokens)


@lru_cache(maxsize=32)
def _block_struct(block_size: int) -> struct.Struct:
    return struct.Struct(f"<{block_size}I")


def token_blocks(tokens: Tokens, block_size: int) -> Iterator[tuple[int, ...]]:
    """The full blocks of ``tokens`` as tuples of ints, the form vLLM hashes, built in C: a
    buffer is unpacked block by block (``Struct.iter_unpack``), a sequence is grouped with
    ``zip`` (reusing its int objects, three times faster than slicing). O(n)."""
    if isinstance(tokens, bytes):
        buffer = as_buffer(tokens)
        usable = len(buffer) - len(buffer) % (block_size * TOKEN_BYTES)
        return _block_struct(block_size).iter_unpack(memoryview(buffer)[:usable])
    return zip(*[iter(tokens)] * block_size, strict=False)


class BlockHasher:
    """Hashes blocks with one algorithm and one NONE_HASH; build it once and keep it.

    ``none_hash_seed`` overrides vLLM's seed resolution (tests, simulations that must agree with
    an engine started with a given PYTHONHASHSEED).
    """

    __slots__ = ("_hash_object", "algorithm", "none_hash", "none_hash_seed")

    def __init__(self, algorithm: str = "sha256", *, none_hash_seed: str | None = None) -> None:
        algo = hash_algorithm(algorithm)
        self.algorithm = algorithm
        self._hash_object = algo.hash_object
        seed = resolve_none_hash_seed(algorithm) if none_hash_seed is None else none_hash_seed
        self.none_hash_seed = seed
        self.none_hash = BlockHash(algo.hash_object(seed))

    def hash_block(
        self, parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: ExtraKeys = None
    ) -> BlockHash:
        """vLLM's ``hash_block_tokens``: a falsy parent means NONE_HASH; tags in ``extra_keys``
        are canonicalised (:func:`canonical_extra_keys`). O(block)."""
        parent = parent_hash or self.none_hash
        keys = canonical_extra_keys(extra_keys)
        return BlockHash(self._hash_object((parent, tuple(token_ids), keys)))

    def iter_hashes(
        self,
        tokens: Tokens,
        block_size: int = 16,
        keys: ExtraKeySpec = NO_EXTRA_KEYS,
        *,
        parent: bytes | None = None,
        start: int = 0,
        max_blocks: int | None = None,
    ) -> Iterator[BlockHash]:
        """Lazily yield the hashes of the full blocks of ``tokens``, which begin at absolute
        position ``start`` (a block boundary) after the block hashed ``parent``. Stopping early
        skips the remaining hashing (a lookup stops at the first miss). O(n)."""
        blocks = self._blocks(tokens, block_size, parent, start, max_blocks)
        hash_object = self._hash_object
        prev: bytes = parent or self.none_hash
        if keys.per_block:
            block_keys, end = keys.block_keys, start + block_size
            for block in blocks:
                prev = hash_object((prev, block, block_keys(end - block_size, end)))
                yield cast(BlockHash, prev)
                end += block_size
            return
        extra = keys.block_keys(start, start + block_size)
        rest = keys.block_keys(start + block_size, start + 2 * block_size)
        for block in blocks:
            prev = hash_object((prev, block, extra))
            yield cast(BlockHash, prev)
            extra = rest

    def hashes(
        self,
        tokens: Tokens,
        block_size: int = 16,
        keys: ExtraKeySpec = NO_EXTRA_KEYS,
        *,
        parent: bytes | None = None,
        start: int = 0,
    ) -> list[BlockHash]:
        """All full-block hashes of ``tokens`` (see :meth:`iter_hashes`). O(n).

        The common case (no multimodal or prompt-embeds keys) runs a tight loop without a
        generator: this is the hot path the "no slower than vLLM" target measures.
        """
        if keys.per_block:
            return list(self.iter_hashes(tokens, block_size, keys, parent=parent, start=start))
        blocks = self._blocks(tokens, block_size, parent, start, None)
        hash_object = self._hash_object
        out: list[bytes] = []
        append = out.append
        prev: bytes = parent or self.none_hash
        extra = keys.block_keys(start, start + block_size)
        rest = keys.block_keys(start + block_size, start + 2 * block_size)
        for block in blocks:
            prev = hash_object((prev, block, extra))
            append(prev)
            extra = rest
        return cast(list[BlockHash], out)

    @staticmethod
    def _blocks(
        tokens: Tokens, block_size: int, parent: bytes | None, start: int, max_blocks: int | None
    ) -> Iterator[tuple[int, ...]]:
        require_at_least("block_size", block_size, 1)
        if start < 0 or start % block_size or (start > 0) != (parent is not None):
            raise ConfigError(
                "pass parent (the previous block's hash) exactly when start > 0, and make start "
                f"a multiple of block_size; got start={start}, parent={parent!r}"
            )
        blocks = token_blocks(tokens, block_size)
        return blocks if max_blocks is None else islice(blocks, max(max_blocks, 0))


_default_hashers: dict[str, BlockHasher] = {}


def default_hasher(algorithm: str = "sha256") -> BlockHasher:
    """The process-wide hasher for ``algorithm``, seeded once like vLLM's ``init_none_hash``."""
    hasher = _default_hashers.get(algorithm)
    if hasher is None:
        hasher = _default_hashers[algorithm] = BlockHasher(algorithm)
    return hasher


def none_hash(algorithm: str = "sha256") -> BlockHash:
    """This process's NONE_HASH for ``algorithm``."""
    return default_hasher(algorithm).none_hash


def hash_block(
    parent_hash: bytes | None,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys = None,
    algorithm: str = "sha256",
) -> BlockHash:
    """One block's hash, as vLLM's ``hash_block_tokens``. O(block)."""
    return default_hasher(algorithm).hash_block(parent_hash, token_ids, extra_keys)


def block_hashes(
    tokens: Tokens,
    block_size: int = 16,
    algorithm: str = "sha256",
    cache_salt: str | None = None,
    lora_name: str | None = None,
    mm_features: Sequence[MultiModalSpan] = (),
    prompt_embeds: PromptEmbeds | None = None,
    parent: bytes | None = None,
    *,
    lora_path: str | None = None,
    extra_keys: Sequence[str] = (),
    start: int = 0,
    none_hash_seed: str | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``tokens``, as vLLM's request block hasher computes them.

    ``lora_path`` is part of vLLM's LoRA key; it defaults to the name, which only matches an
    engine whose adapter path equals its name. ``parent``/``start`` continue a chain: the tokens
    begin at absolute position ``start`` right after the block hashed ``parent``. O(n).
    """
    hasher = (
        default_hasher(algorithm) if none_hash_seed is None else _seeded(algorithm, none_hash_seed)
    )
    keys = NO_EXTRA_KEYS
    if lora_name is not None or cache_salt or mm_features or prompt_embeds or extra_keys:
        keys = ExtraKeySpec(
            lora_name=lora_name,
            lora_path=lora_path,
            cache_salt=cache_salt,
            mm_features=tuple(mm_features),
            prompt_embeds=prompt_embeds,
            extra_keys=tuple(extra_keys),
        )
    return hasher.hashes(tokens, block_size, keys, parent=parent, start=start)


@lru_cache(maxsize=16)
def _seeded(algorithm: str, none_hash_seed: str) -> BlockHasher:
    """Hashers for explicit seeds, kept so repeated calls do not re-derive NONE_HASH."""
    return BlockHasher(algorithm, none_hash_seed=none_hash_seed)
