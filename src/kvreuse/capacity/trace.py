"""Hot working set from a Mooncake-format trace (parsed by :mod:`kvreuse.trace.format`).

``hash_ids`` name the prompt's 512-token blocks and equal ids mean equal prefixes. A block is
*hot* in a window when at least two requests in it use it: those are the blocks a cache must
hold for reuse to happen. The hot set is the largest such set over tumbling windows (and its
median, to show how steady it is).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvreuse.errors import InputFormatError
from kvreuse.trace.format import DEFAULT_BLOCK_TOKENS, TraceRecord


@dataclass(frozen=True, slots=True)
class TraceHotSet:
    """Hot blocks per window: the maximum (what must fit) and the median, in tokens."""

    requests: int
    duration_seconds: float
    windows: int
    window_seconds: float
    max_hot_tokens: int
    median_hot_tokens: float
    distinct_tokens: int
    block_tokens: int
    per_window: tuple[tuple[float, int], ...] = ()
    """``(window start in seconds from the first request, hot tokens)`` for each window that
    has requests, in time order: the hot working set over time."""

    def describe(self) -> str:
        return (
            f"{self.requests:,} requests over {self.duration_seconds:,.0f} s; hot blocks (used "
            f"by 2+ requests within {self.window_seconds:g} s): up to "
            f"{self.max_hot_tokens:,} tokens, median {self.median_hot_tokens:,.0f} over "
            f"{self.windows} windows; {self.distinct_tokens:,} distinct block tokens in all"
        )


def trace_hot_set(
    requests: Sequence[TraceRecord],
    window_seconds: float = 300.0,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> TraceHotSet:
    """O(total hash ids)."""
    if not window_seconds >= 0.001:  # a window under the timestamps' millisecond means nothing
        raise InputFormatError(f"window must be at least 0.001 s (traces count milliseconds), "
                               f"got {window_seconds}", where="--window")
    ordered = sorted(requests, key=lambda r: r.timestamp_ms)
    start = ordered[0].timestamp_ms
    window_ms = window_seconds * 1000.0
    counts: dict[int, Counter[int]] = {}
    distinct: set[int] = set()
    for request in ordered:
        window = int((request.timestamp_ms - start) // window_ms)
        counter = counts.setdefault(window, Counter())
        # A request uses each of its blocks once; repeats inside one prompt are not reuse.
        counter.update(set(request.hash_ids))
        distinct.update(request.hash_ids)
    series = tuple(
        (window * window_seconds, sum(1 for c in counter.values() if c >= 2) * block_tokens)
        for window, counter in sorted(counts.items())
    )
    hot = [tokens for _, tokens in series]
    duration = (ordered[-1].timestamp_ms - start) / 1000.0
    return TraceHotSet(
        requests=len(ordered),
        duration_seconds=duration,
        windows=len(hot),
        window_seconds=window_seconds,
        max_hot_tokens=max(hot),
        median_hot_tokens=statistics.median(hot),
        distinct_tokens=len(distinct) * block_tokens,
        block_tokens=block_tokens,
        per_window=series,
    )
