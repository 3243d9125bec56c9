"""Synthetic traces in Mooncake's format, for capacity tests and examples.

Requests draw one of ``documents`` shared prefixes (Zipf-skewed: a few documents take most of
the traffic), each ``prefix_blocks`` blocks of 512 tokens, and add private blocks of their own.
Seeded, so the same arguments always give the same trace.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from typing import Any


def synthetic_mooncake(**options: Any) -> list[str]:
    """JSONL lines: timestamp (ms), input_length, output_length, hash_ids; ``options`` are
    :func:`iter_synthetic_mooncake`'s."""
    return list(iter_synthetic_mooncake(**options))


def iter_synthetic_mooncake(
    *,
    seed: int = 0,
    requests: int = 600,
    requests_per_second: float = 2.0,
    documents: int = 40,
    prefix_blocks: int = 12,
    private_blocks: int = 1,
    skew: float = 1.1,
) -> Iterator[str]:
    """The lines of a synthetic trace, one at a time (for traces too big to hold)."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** skew for rank in range(documents)]
    # What choices() would accumulate on every call: the same draws, computed once.
    cumulative = list(itertools.accumulate(weights))
    population = range(documents)
    next_private = documents * prefix_blocks
    t_ms = 0.0
    for _ in range(requests):
        t_ms += rng.expovariate(requests_per_second) * 1000.0
        document = rng.choices(population, cum_weights=cumulative)[0]
        ids = [document * prefix_blocks + b for b in range(prefix_blocks)]
        ids += list(range(next_private, next_private + private_blocks))
        next_private += private_blocks
        row = {
            "timestamp": int(t_ms),
            "input_length": len(ids) * 512 - rng.randrange(0, 400),
            "output_length": rng.randrange(20, 400),
            "hash_ids": ids,
        }
        yield json.dumps(row)
