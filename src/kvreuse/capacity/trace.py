"""Hot working set from a Mooncake-format trace.

Each line is a request: ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}``, where ``hash_ids`` name the prompt's 512-token blocks and equal ids mean
equal prefixes (the published Mooncake traces). A block is *hot* in a window when at least two
requests in it use it: those are the blocks a cache must hold for reuse to happen. The hot set
is the largest such set over tumbling windows (and its median, to show how steady it is).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from kvreuse.errors import InputFormatError

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_mooncake(lines: Iterable[str], source: str = "trace") -> list[TraceRequest]:
    """Parse a Mooncake JSONL trace; errors name the file and line to fix."""
    requests = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputFormatError(f"not valid JSON: {exc.msg}", where=where) from None
        if not isinstance(row, dict):
            raise InputFormatError("each line must be a JSON object", where=where)
        ids = row.get("hash_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise InputFormatError("'hash_ids' must be a list of integers", where=where)
        try:
            requests.append(
                TraceRequest(
                    float(row["timestamp"]),
                    int(row["input_length"]),
                    int(row.get("output_length", 0)),
                    tuple(ids),
                )
            )
        except KeyError as exc:
            raise InputFormatError(f"missing field {exc.args[0]!r}", where=where) from None
        except (TypeError, ValueError) as exc:
            raise InputFormatError(f"bad value: {exc}", where=where) from None
    if not requests:
        raise InputFormatError("the trace holds no requests", where=source)
    return requests


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

    def describe(self) -> str:
        return (
            f"{self.requests:,} requests over {self.duration_seconds:,.0f} s; hot blocks (used "
            f"by 2+ requests within {self.window_seconds:g} s): up to "
            f"{self.max_hot_tokens:,} tokens, median {self.median_hot_tokens:,.0f} over "
            f"{self.windows} windows; {self.distinct_tokens:,} distinct block tokens in all"
        )


def trace_hot_set(
    requests: list[TraceRequest],
    window_seconds: float = 300.0,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> TraceHotSet:
    """O(total hash ids)."""
    if window_seconds <= 0:
        raise InputFormatError(f"window must be positive, got {window_seconds}", where="--window")
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
    hot = [sum(1 for c in counter.values() if c >= 2) * block_tokens for counter in counts.values()]
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
    )
