"""Keyed, chained block ids: what a recorded trace says about a prompt instead of its text.

A prompt's tokens are cut into ``block``-token blocks (the last may be partial) and block ``i``
gets ``HMAC-SHA256(secret, parent_i || namespace_len || namespace || tokens_i)``, where
``parent_0`` is the HMAC of a fixed label and ``parent_i`` the previous block's full digest:
chained like vLLM's block hashes, so equal ids at equal positions mean equal prefixes (under the
same cache namespace, i.e. the cache salt, which is only ever mixed in, never written). The id
written is the digest's first 63 bits. Without the secret, ids reveal nothing about the tokens
(HMAC is a PRF), and a dictionary of guessed prompts cannot be tested against them; gateways
given the same secret agree on every id. The tenant is written as a keyed hash too
(:meth:`KeyedIds.tenant`). Pure: no clock, no I/O.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator

from kvreuse.errors import ConfigError, require_at_least
from kvreuse.tokens import TOKEN_BYTES

_LABEL = b"kvreuse-trace-v1"
MIN_SECRET_BYTES = 16


class KeyedIds:
    """Block ids and tenant hashes under one secret. Thread-safe (no state after init)."""

    __slots__ = ("_root", "_secret", "block")

    def __init__(self, secret: bytes, block: int) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"the trace secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}"
            )
        require_at_least("--record-block-size", block, 1)
        self._secret = secret
        self.block = block
        self._root = hmac.digest(secret, _LABEL, "sha256")

    def _chain(self, tokens: bytes, namespace: bytes) -> Iterator[bytes]:
        step = self.block * TOKEN_BYTES
        secret = self._secret
        prefix = len(namespace).to_bytes(2, "big") + namespace
        parent = self._root
        for start in range(0, len(tokens), step):
            parent = hmac.digest(secret, parent + prefix + tokens[start : start + step], "sha256")
            yield parent

    def block_ids(self, tokens: bytes, namespace: str | None = None) -> list[int]:
        """One id in [0, 2**63) per block of the packed ``tokens``. O(tokens)."""
        space = b"" if namespace is None else namespace.encode("utf-8", "surrogatepass")[:1024]
        return [int.from_bytes(d[:8], "big") >> 1 for d in self._chain(tokens, space)]

    def tenant(self, name: str) -> str:
        """A tenant's name as 16 hex digits, stable under this secret."""
        data = b"tenant\0" + name.encode("utf-8", "surrogatepass")
        return hmac.digest(self._secret, data, "sha256")[:8].hex()

    def session(self, session_id: str) -> str:
        """A client's session id, keyed like the tenant: the grouping survives, the id does not
        (a session id may carry a user name)."""
        data = b"session\0" + session_id.encode("utf-8", "surrogatepass")
        return hmac.digest(self._secret, data, "sha256")[:8].hex()
