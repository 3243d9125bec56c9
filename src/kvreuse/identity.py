"""Cache identity: everything besides token ids that changes keys and values.

Seed 000: "anything that changes keys and values must be in the cache key, including adapter,
multimodal inputs and model revision". Two requests share cached KV only if their token ids match
from the first token *and* their identities are equal. Both indexes keep one namespace per identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CacheIdentity:
    """The namespace a prefix lives in.

    ``model``: model name and revision (weights); ``adapter``: LoRA adapter name, ``None`` for the
    base model; ``cache_salt``: vLLM's per-request salt (one per trust group, usually per tenant);
    ``tokenizer_revision`` / ``template_revision``: recorded so a change is attributable (token ids
    already differ when these change, but two revisions that produce equal ids must still not be
    mixed in reports); ``extra_keys``: anything else that changes KV, e.g. multimodal hashes.
    """

    model: str = ""
    adapter: str | None = None
    cache_salt: str | None = None
    tokenizer_revision: str = ""
    template_revision: str = ""
    extra_keys: tuple[str, ...] = field(default=())

    def label(self) -> str:
        """A short, non-secret label for reports (the salt is never printed)."""
        parts = [self.model or "model?"]
        if self.adapter:
            parts.append(f"adapter={self.adapter}")
        if self.cache_salt is not None:
            parts.append("salted")
        if self.extra_keys:
            parts.append(f"extra={len(self.extra_keys)}")
        return ",".join(parts)


DEFAULT_IDENTITY = CacheIdentity()
