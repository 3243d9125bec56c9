"""Eviction policies as sort keys.

An index evicts the unreferenced leaf with the *smallest* key first. Keys must never decrease
while a node lives (access times and hit counts only grow, priority is kept as a running maximum):
the radix index keeps a lazy heap and relies on that to stay exact without re-sorting on every hit.
Ties break on node creation order, oldest first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvreuse.errors import ConfigError


class EvictionSubject(Protocol):
    """What a policy may look at."""

    last_access: float
    hit_count: int
    created: float
    priority: int


EvictionKey = Callable[[EvictionSubject], tuple[float, ...]]


def lru_key(node: EvictionSubject) -> tuple[float, ...]:
    """Least recently used first (SGLang's default)."""
    return (node.last_access,)


def lfu_key(node: EvictionSubject) -> tuple[float, ...]:
    """Fewest hits first, then least recently used."""
    return (float(node.hit_count), node.last_access)


def fifo_key(node: EvictionSubject) -> tuple[float, ...]:
    """Oldest insertion first, regardless of use."""
    return (node.created,)


def priority_key(node: EvictionSubject) -> tuple[float, ...]:
    """Lowest request priority first, then least recently used."""
    return (float(node.priority), node.last_access)


EVICTION_POLICIES: dict[str, EvictionKey] = {
    "lru": lru_key,
    "lfu": lfu_key,
    "fifo": fifo_key,
    "priority": priority_key,
}


def eviction_policy(name: str) -> EvictionKey:
    """Look a policy up by name; raises :class:`ConfigError` naming the choices."""
    try:
        return EVICTION_POLICIES[name]
    except KeyError:
        choices = ", ".join(sorted(EVICTION_POLICIES))
        raise ConfigError(f"unknown eviction policy {name!r}; choose one of: {choices}") from None
