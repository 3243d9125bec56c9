"""Extra keys: everything besides token ids that vLLM folds into a block hash, in its tagged form.

vLLM 0.32's ``generate_block_hash_extra_keys`` builds, per block and in this order:
``("lora", name, path)`` on every block of a LoRA request; ``("mm", identifier, offset -
block_start)`` for each multimodal placeholder overlapping the block; ``("cache_salt", salt)`` on
the block starting at token 0 when the salt is non-empty; ``("prompt_embeds", sha256(rows))`` on
every block of a prompt-embeds request; ``None`` when there are none. kvreuse appends
``("extra", key)`` for each :attr:`~kvreuse.identity.CacheIdentity.extra_keys` entry on every
block, so hashes match vLLM's only when there are no such keys. KV events carry the untagged
form (:func:`event_extra_keys`).
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass

from kvreuse.errors import ConfigError

ExtraKeys = tuple[object, ...] | None
"""A block's extra keys as vLLM hashes them (tagged tuples), or ``None``."""

# One shared object per tag: pickle memoises strings by identity, and vLLM's tags are code
# constants, so a block with two multimodal keys pickles its second "mm" as a memo reference.
LORA_TAG = "lora"
MM_TAG = "mm"
SALT_TAG = "cache_salt"
EMBEDS_TAG = "prompt_embeds"
EXTRA_TAG = "extra"
_TAGS = {tag: tag for tag in (LORA_TAG, MM_TAG, SALT_TAG, EMBEDS_TAG, EXTRA_TAG)}


@dataclass(frozen=True, slots=True)
class MultiModalSpan:
    """A multimodal placeholder, as vLLM's ``MultiModalFeatureSpec``: the item's ``identifier``
    (its content hash) and its token span ``[offset, offset + length)`` in the prompt."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class PromptEmbeds:
    """Raw bytes of a ``[num_rows, hidden]`` row-major prompt-embeddings tensor.

    vLLM keys each block on ``sha256`` of that block's rows (fewer, or none, past the last row).
    """

    data: bytes
    num_rows: int

    def __post_init__(self) -> None:
        if self.num_rows <= 0 or len(self.data) % self.num_rows:
            raise ConfigError(
                f"prompt embeds: {len(self.data)} bytes do not split into {self.num_rows} rows"
            )

    def block_digest(self, start: int, end: int) -> bytes:
        """sha256 of rows ``[start, end)``."""
        row = len(self.data) // self.num_rows
        return hashlib.sha256(self.data[start * row : end * row]).digest()


@dataclass(frozen=True, slots=True)
class ExtraKeySpec:
    """Everything besides token ids that vLLM folds into block hashes, for one request."""

    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    mm_features: tuple[MultiModalSpan, ...] = ()
    prompt_embeds: PromptEmbeds | None = None
    extra_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        offsets = [f.offset for f in self.mm_features]
        if offsets != sorted(offsets):
            raise ConfigError("mm_features must be sorted by offset, as vLLM assumes")

    @property
    def per_block(self) -> bool:
        """Whether keys vary by block beyond the salt on block 0 (multimodal, prompt embeds)."""
        return bool(self.mm_features) or self.prompt_embeds is not None

    def _constant(self, salted: bool) -> ExtraKeys:
        keys: list[object] = []
        if self.lora_name is not None:
            path = self.lora_name if self.lora_path is None else self.lora_path
            keys.append((LORA_TAG, self.lora_name, path))
        if salted and self.cache_salt:
            keys.append((SALT_TAG, self.cache_salt))
        keys.extend((EXTRA_TAG, key) for key in self.extra_keys)
        return tuple(keys) or None

    def block_keys(self, start: int, end: int) -> ExtraKeys:
        """Extra keys of the block covering tokens ``[start, end)``, in vLLM's order: LoRA,
        multimodal, salt, prompt embeds (then kvreuse's identity keys). O(features in block)."""
        if not self.per_block:
            return self._constant(start == 0)
        keys: list[object] = []
        if self.lora_name is not None:
            path = self.lora_name if self.lora_path is None else self.lora_path
            keys.append((LORA_TAG, self.lora_name, path))
        keys.extend(self._mm_keys(start, end))
        if start == 0 and self.cache_salt:
            keys.append((SALT_TAG, self.cache_salt))
        if self.prompt_embeds is not None:
            keys.append((EMBEDS_TAG, self.prompt_embeds.block_digest(start, end)))
        keys.extend((EXTRA_TAG, key) for key in self.extra_keys)
        return tuple(keys) or None

    def _mm_keys(self, start: int, end: int) -> list[tuple[str, str, int]]:
        """vLLM's ``_gen_mm_extra_hash_keys`` loop, entered at the first feature ending after
        ``start`` (as ``get_mm_features_in_window`` does)."""
        features = self.mm_features
        index = bisect.bisect_left(features, start + 1, key=lambda f: f.offset + f.length)
        keys: list[tuple[str, str, int]] = []
        while index < len(features):
            feature = features[index]
            if end <= feature.offset:
                break
            if start >= feature.offset + feature.length:
                index += 1
                continue
            keys.append((MM_TAG, feature.identifier, feature.offset - start))
            if end < feature.offset + feature.length:
                break
            index += 1
        return keys


NO_EXTRA_KEYS = ExtraKeySpec()


def event_extra_keys(keys: ExtraKeys) -> tuple[object, ...] | None:
    """vLLM's untagged per-block form in KV events (``to_event_extra_keys``): bare LoRA name and
    salt, ``(identifier, offset)`` pairs, bare prompt-embeds digests."""
    if keys is None:
        return None
    untagged: list[object] = []
    for key in keys:
        assert isinstance(key, tuple) and key, f"extra key {key!r} is not a tagged tuple"
        untagged.append(key[1:] if key[0] == MM_TAG else key[1])
    return tuple(untagged)


def canonical_extra_keys(keys: ExtraKeys) -> ExtraKeys:
    """``keys`` with each known tag replaced by this module's tag object, so the pickle-based
    algorithms memoise repeated tags as vLLM's code constants do (equal but distinct tag strings,
    e.g. decoded from JSON, would otherwise pickle, and hash, differently). O(keys)."""
    if keys is None:
        return None
    return tuple(
        (_TAGS.get(key[0], key[0]), *key[1:])
        if isinstance(key, tuple) and key and isinstance(key[0], str)
        else key
        for key in keys
    )
