"""What a trace allows, before any fleet is simulated (``kvreuse trace stats``).

* volume: requests, prompt and answer tokens, duration, sessions, tenants, models;
* the infinite-cache ceiling: the token hit rate of one cache that never forgets;
* the pooled-LRU reference for each replicas × cache size: one LRU cache of N × C tokens
  (:mod:`kvreuse.sim.trace`); a yardstick, not a ceiling: LRU is not the best eviction, and a
  router that keeps each prefix on one replica can beat it;
* the hot working set over time: per window, the tokens of blocks two or more requests use
  (:func:`kvreuse.capacity.trace.trace_hot_set`);
* reuse depth: per request, how many leading blocks an earlier request already had (ids are
  chained, so a seen id means its whole prefix was seen) — the depth distribution says whether
  reuse is a short system prompt or long shared documents and conversations;
* when the trace was recorded by ``kvreuse route --record``: the token hit rate the engines
  reported (``cached_tokens``) and the measured TTFT percentiles.

Pure: parsed records in, figures out. Bounds run at block granularity (one id = one unit).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from kvreuse.capacity.trace import TraceHotSet, trace_hot_set
from kvreuse.sim.summary import percentile
from kvreuse.sim.trace import fleet_bounds
from kvreuse.trace.format import TraceRecord
from kvreuse.trace.workload import trace_requests


@dataclass(frozen=True, slots=True)
class PooledBound:
    replicas: int
    cache_tokens: int
    hit_rate: float


@dataclass(frozen=True, slots=True)
class TraceStats:
    """See the module docstring. Rates are fractions; times seconds."""

    requests: int
    input_tokens: int
    output_tokens: int
    duration_s: float
    block: int
    sessions: int
    tenants: int
    models: tuple[str, ...]
    infinite_hit_rate: float
    pooled: tuple[PooledBound, ...]
    hot: TraceHotSet
    requests_with_reuse: int
    reuse_depth_blocks: tuple[int, ...]
    """Per request, the leading blocks already seen, in trace order."""
    recorded_hit_rate: float | None
    recorded_ttft_p50_s: float | None
    recorded_ttft_p95_s: float | None

    def depth_percentile(self, fraction: float) -> float:
        return percentile([float(d) for d in self.reuse_depth_blocks], fraction)

    def as_dict(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "duration_s": self.duration_s,
            "block_tokens": self.block,
            "sessions": self.sessions,
            "tenants": self.tenants,
            "models": list(self.models),
            "infinite_hit_rate": self.infinite_hit_rate,
            "pooled": [asdict(p) for p in self.pooled],  # replicas, cache_tokens, hit_rate
            "hot_window_s": self.hot.window_seconds,
            "hot_max_tokens": self.hot.max_hot_tokens,
            "hot_median_tokens": self.hot.median_hot_tokens,
            "hot_over_time": [[start, tokens] for start, tokens in self.hot.per_window],
            "distinct_tokens": self.hot.distinct_tokens,
            "requests_with_reuse": self.requests_with_reuse,
            "reuse_depth_blocks": {
                "p50": self.depth_percentile(0.5),
                "p90": self.depth_percentile(0.9),
                "p99": self.depth_percentile(0.99),
                "max": max(self.reuse_depth_blocks, default=0),
            },
            "recorded_hit_rate": self.recorded_hit_rate,
            "recorded_ttft_p50_s": self.recorded_ttft_p50_s,
            "recorded_ttft_p95_s": self.recorded_ttft_p95_s,
        }


def reuse_depths(records: Sequence[TraceRecord]) -> list[int]:
    """Leading blocks of each request that an earlier request had. O(total ids)."""
    seen: set[int] = set()
    depths = []
    for record in records:
        ids = record.hash_ids
        depth = 0
        for block_id in ids:
            if block_id not in seen:
                break
            depth += 1
        depths.append(depth)
        seen.update(ids)
    return depths


def trace_stats(
    records: Sequence[TraceRecord],
    block: int,
    replicas: Sequence[int],
    cache_tokens: Sequence[int],
    window_s: float = 60.0,
    on_replay: Callable[[int, int], None] | None = None,
) -> TraceStats:
    """Every figure of the module docstring; ``on_replay(done, total)`` follows each replay of
    the trace through a cache (:func:`kvreuse.sim.trace.fleet_bounds`, the bulk of the work).
    O(total ids × (1 + distinct pooled sizes))."""
    requests, units = trace_requests(records, block, "block")
    fleets = [(n, cache) for n in replicas for cache in cache_tokens]
    every = fleet_bounds(requests, fleets or [(1, block)], units, on_replay)
    infinite = every[0].infinite_hit_rate
    pooled = [PooledBound(b.replicas, b.cache_tokens, b.pooled_lru_hit_rate)
              for b in every] if fleets else []
    depths = reuse_depths(records)
    recorded = [r for r in records if r.cached_tokens is not None]
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    return TraceStats(
        requests=len(records),
        input_tokens=sum(r.input_length for r in records),
        output_tokens=sum(r.output_length for r in records),
        duration_s=(records[-1].timestamp_ms - records[0].timestamp_ms) / 1000.0,
        block=block,
        sessions=len({r.session_id for r in records if r.session_id is not None}),
        tenants=len({r.tenant for r in records if r.tenant is not None}),
        models=tuple(sorted({r.model for r in records if r.model is not None})),
        infinite_hit_rate=infinite,
        pooled=tuple(pooled),
        hot=trace_hot_set(records, window_s, block),
        requests_with_reuse=sum(1 for d in depths if d > 0),
        reuse_depth_blocks=tuple(depths),
        recorded_hit_rate=(
            sum(r.cached_tokens or 0 for r in recorded) / sum(r.input_length for r in recorded)
            if recorded else None
        ),
        recorded_ttft_p50_s=percentile(ttfts, 0.5) if ttfts else None,
        recorded_ttft_p95_s=percentile(ttfts, 0.95) if ttfts else None,
    )
