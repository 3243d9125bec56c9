"""Leading-token fingerprints: a non-sensitive identity for the cacheable head of a prompt.

Seed 004: store "a non-sensitive fingerprint of the tokenizer revision, template revision, model
revision, and leading token blocks with each observation", so a hit-rate change can be attributed
without logging prompt text. A fingerprint hashes the first ``n`` token ids (default 2,048),
aligned down to whole cache blocks because only full blocks are cached, together with the three
revisions. It also keeps a short hash per block, chained like vLLM's block hashes, so two
fingerprints tell *where* two prompts part (the first differing block) without any text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.tokens import pack

DEFAULT_PREFIX_TOKENS = 2048
DEFAULT_BLOCK_SIZE = 16
BLOCK_DIGEST_HEX = 16
"""Hex digits kept per block hash: 64 bits, enough to tell blocks apart, too short to matter."""

_DOMAIN = b"kvreuse-prefix-fingerprint-v1"


@dataclass(frozen=True, slots=True)
class Revisions:
    """What, besides token ids, decides whether a cached prefix can be reused."""

    tokenizer: str = ""
    template: str = ""
    model: str = ""

    def changed_fields(self, other: Revisions) -> list[str]:
        """Names of the revisions that differ (``tokenizer``, ``template``, ``model``)."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


@dataclass(frozen=True, slots=True)
class PrefixFingerprint:
    """The fingerprint of a prompt's first ``tokens`` token ids (a whole number of blocks).

    ``digest`` covers token ids and revisions; ``tokens_digest`` the token ids alone, so a golden
    check can tell "the tokens changed" from "only a revision label changed". ``block_digests``
    are chained per-block hashes (block i's depends on blocks 0..i).
    """

    digest: str
    tokens_digest: str
    tokens: int
    prompt_tokens: int
    block_size: int
    revisions: Revisions
    block_digests: tuple[str, ...] = field(default=())

    def first_different_block(self, other: PrefixFingerprint) -> int | None:
        """Index of the first block whose chained hash differs; ``None`` if all shared blocks
        match (one fingerprint may still cover more blocks than the other)."""
        if self.block_size != other.block_size:
            raise ConfigError(
                f"cannot compare fingerprints with block sizes {self.block_size} and "
                f"{other.block_size}; record both with the same --block-size"
            )
        for index, (mine, theirs) in enumerate(
            zip(self.block_digests, other.block_digests, strict=False)
        ):
            if mine != theirs:
                return index
        return None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (no prompt text in it)."""
        return {
            "fingerprint": self.digest,
            "tokens_sha256": self.tokens_digest,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "block_size": self.block_size,
            "tokenizer_revision": self.revisions.tokenizer,
            "template_revision": self.revisions.template,
            "model_revision": self.revisions.model,
            "block_hashes": list(self.block_digests),
        }

    @classmethod
    def from_json(cls, data: object, where: str = "fingerprint") -> PrefixFingerprint:
        """Inverse of :meth:`to_json`; errors name the missing or mistyped field."""
        if not isinstance(data, dict):
            raise InputFormatError("expected an object", where=where)
        try:
            blocks = data.get("block_hashes", [])
            if not isinstance(blocks, list) or not all(isinstance(b, str) for b in blocks):
                raise InputFormatError("must be a list of hex strings", f"{where}.block_hashes")
            return cls(
                digest=str(data["fingerprint"]),
                tokens_digest=str(data["tokens_sha256"]),
                tokens=int(data["tokens"]),
                prompt_tokens=int(data["prompt_tokens"]),
                block_size=int(data["block_size"]),
                revisions=Revisions(
                    tokenizer=str(data.get("tokenizer_revision", "")),
                    template=str(data.get("template_revision", "")),
                    model=str(data.get("model_revision", "")),
                ),
                block_digests=tuple(blocks),
            )
        except KeyError as exc:
            raise InputFormatError(f"missing field {exc.args[0]!r}", where=where) from None
        except (TypeError, ValueError) as exc:
            raise InputFormatError(f"bad value: {exc}", where=where) from None


def aligned_length(prompt_tokens: int, n: int, block_size: int) -> int:
    """How many leading tokens a fingerprint covers: ``min(n, prompt)`` rounded down to blocks."""
    return min(n, prompt_tokens) // block_size * block_size


def fingerprint(
    token_ids: Sequence[int],
    *,
    n: int = DEFAULT_PREFIX_TOKENS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    revisions: Revisions | None = None,
) -> PrefixFingerprint:
    """Fingerprint the first ``n`` token ids of a prompt. O(n).

    ``n`` must be a positive multiple of ``block_size``: a cache stores whole blocks, so a
    fingerprint boundary inside a block would promise reuse no engine delivers.
    """
    if block_size <= 0:
        raise ConfigError(f"block size must be positive, got {block_size}")
    if n <= 0 or n % block_size:
        raise ConfigError(
            f"--tokens {n} must be a positive multiple of the block size {block_size} "
            f"(for example {max(1, n // block_size) * block_size})"
        )
    revisions = revisions or Revisions()
    covered = aligned_length(len(token_ids), n, block_size)
    packed = pack(token_ids[:covered])
    tokens_digest = hashlib.sha256(packed).hexdigest()
    whole = hashlib.sha256(_DOMAIN)
    for part in (revisions.tokenizer, revisions.template, revisions.model):
        whole.update(len(part).to_bytes(4, "little") + part.encode("utf-8"))
    whole.update(block_size.to_bytes(4, "little"))
    whole.update(packed)
    block_digests: list[str] = []
    parent = hashlib.sha256(_DOMAIN + block_size.to_bytes(4, "little")).digest()
    step = block_size * 4
    for start in range(0, len(packed), step):
        parent = hashlib.sha256(parent + packed[start : start + step]).digest()
        block_digests.append(parent.hex()[:BLOCK_DIGEST_HEX])
    return PrefixFingerprint(
        digest=whole.hexdigest(),
        tokens_digest=tokens_digest,
        tokens=covered,
        prompt_tokens=len(token_ids),
        block_size=block_size,
        revisions=revisions,
        block_digests=tuple(block_digests),
    )
