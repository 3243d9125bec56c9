"""The contract both prefix indexes honour, so the simulator and the gateway can use either.

A prefix index answers one question: given a prompt (token ids under a cache identity), how many
leading tokens already have KV in memory? A hit must match from the first token, because the keys
at position 500 depend on every earlier token (seed 000).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from kvreuse.identity import CacheIdentity
from kvreuse.tokens import Tokens

Clock = Callable[[], float]
"""A source of time, injected; indexes never read the wall clock themselves."""


class PrefixMatch(Protocol):
    """The result of :meth:`PrefixIndex.match`."""

    @property
    def length(self) -> int:
        """Number of leading prompt tokens whose KV is reusable."""
        ...

    @property
    def handle(self) -> Any:
        """What to pass to :meth:`PrefixIndex.lock` to pin the matched KV."""
        ...


class PrefixIndex(Protocol):
    """A cache of KV for token prefixes, with reference counts and eviction."""

    def match(
        self, tokens: Tokens, identity: CacheIdentity | None = None, now: float | None = None
    ) -> PrefixMatch:
        """Called when a request is scheduled: returns the longest reusable prefix and touches it
        (access time, hit count) so eviction sees the use."""
        ...

    def insert(
        self, tokens: Tokens, identity: CacheIdentity | None = None, now: float | None = None
    ) -> int:
        """Called when KV for ``tokens`` has been computed (a request finished, or a prefill
        chunk completed): stores it and returns how many tokens were newly stored."""
        ...

    def lock(self, handle: Any) -> None:
        """Called when a running request starts using matched KV: it may not be evicted until
        the matching :meth:`unlock`."""
        ...

    def unlock(self, handle: Any) -> None:
        """Called when that request finishes: the KV becomes evictable cache again."""
        ...

    def evict(self, num_tokens: int) -> int:
        """Called when memory is needed: frees at least ``num_tokens`` of unreferenced cache if
        possible and returns the tokens actually freed (may be more, never negative)."""
        ...

    @property
    def total_tokens(self) -> int:
        """Tokens held, referenced or not."""
        ...

    @property
    def evictable_tokens(self) -> int:
        """Tokens held that no running request references."""
        ...

    @property
    def protected_tokens(self) -> int:
        """Tokens held that a running request references (locked)."""
        ...

    def check_invariants(self) -> None:
        """O(n) self-check; raises AssertionError with a message on a broken invariant."""
        ...
