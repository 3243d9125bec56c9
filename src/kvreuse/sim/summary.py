"""Turning a run's records into the figures the CLI, the JSON and the report show.

Only measured requests (after warm-up) count. Denominators, stated:

* ``token_hit_rate`` = cached prompt tokens / all prompt tokens (seed 000's number to watch),
  through :class:`kvreuse.metrics.ReuseMeter`;
* ``request_hit_rate`` = requests with any cached token / requests (flattering, shown because
  dashboards show it);
* ``prefill_gpu_s_per_1k`` = 1000 × mean over requests of ``overhead_s + prefilled / rate``
  (seed 001's "GPU-seconds per thousand requests");
* ``ttft_p50_s`` / ``ttft_p95_s`` — nearest-rank percentiles of time to first token;
* ``max_over_mean_load`` — the busiest replica's prefill GPU-seconds over the mean;
* ``evicted_tokens`` — tokens evicted from replica caches over the whole run, warm-up included.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvreuse.metrics import DEFAULT_BANDS, RequestObservation, ReuseMeter, band_label
from kvreuse.sim.requests import FleetRun, RequestRecord


def percentile(values: Sequence[float], fraction: float, empty: float = 0.0) -> float:
    """Nearest-rank percentile (``fraction`` in [0, 1]); ``empty`` for no values. O(n log n)."""
    if not values:
        return empty
    ordered = sorted(values)
    rank = max(math.ceil(fraction * len(ordered)), 1)
    return ordered[rank - 1]


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One policy on one fleet size: the fields of a ``runs`` entry in ``--json`` output."""

    policy: str
    replicas: int
    requests: int
    token_hit_rate: float
    request_hit_rate: float
    prefill_gpu_s_per_1k: float
    ttft_p50_s: float
    ttft_p95_s: float
    max_over_mean_load: float
    evicted_tokens: int
    prompt_tokens: int
    cached_tokens: int

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "policy": self.policy,
            "replicas": self.replicas,
            "token_hit_rate": self.token_hit_rate,
            "request_hit_rate": self.request_hit_rate,
            "prefill_gpu_s_per_1k": self.prefill_gpu_s_per_1k,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p95_s": self.ttft_p95_s,
            "max_over_mean_load": self.max_over_mean_load,
            "evicted_tokens": self.evicted_tokens,
            "requests": self.requests,
        }


def measured(run: FleetRun) -> list[RequestRecord]:
    return [r for r in run.records if r.measured]


def prefill_cost_s(run: FleetRun, record: RequestRecord) -> float:
    """The seconds ``record``'s prefill took on its replica (at that replica's speed). O(1)."""
    durations = run.prefill_s_by_request
    if durations is not None:  # speeds changed mid-run: the time each prefill took
        return durations[record.request_id]
    replica = run.config.replica
    speeds = run.config.prefill_speeds
    rate = replica.prefill_tokens_per_s * (1.0 if speeds is None else speeds[record.replica])
    return replica.overhead_s + record.prefilled_tokens / rate


def summarize(run: FleetRun, label: str | None = None) -> RunSummary:
    """The headline figures of ``run``. O(n log n)."""
    records = measured(run)
    meter = ReuseMeter()
    for record in records:
        meter.observe(RequestObservation(record.prompt_tokens, record.cached_tokens))
    overall = meter.overall()
    per_replica = [0.0] * run.config.replicas
    for record in records:
        per_replica[record.replica] += prefill_cost_s(run, record)
    total_gpu_s = sum(per_replica)
    mean = total_gpu_s / len(per_replica)
    ttfts = [r.ttft_s for r in records]
    return RunSummary(
        policy=label or run.policy,
        replicas=run.config.replicas,
        requests=len(records),
        token_hit_rate=overall.token_hit_rate,
        request_hit_rate=overall.request_hit_rate,
        prefill_gpu_s_per_1k=1000.0 * total_gpu_s / len(records) if records else 0.0,
        ttft_p50_s=percentile(ttfts, 0.50),
        ttft_p95_s=percentile(ttfts, 0.95),
        max_over_mean_load=max(per_replica) / mean if mean > 0 else 0.0,
        evicted_tokens=sum(run.evicted_tokens),
        prompt_tokens=overall.prompt_tokens,
        cached_tokens=overall.cached_tokens,
    )


@dataclass(frozen=True, slots=True)
class TimePoint:
    """Token hit rate of the requests arriving in ``[start_s, start_s + width)``."""

    start_s: float
    token_hit_rate: float
    requests: int


def hit_rate_over_time(run: FleetRun, width_s: float = 1.0) -> list[TimePoint]:
    """Per-bucket token hit rate, measured requests only (a timestamp step shows here)."""
    buckets: dict[int, list[int]] = {}
    for record in measured(run):
        slot = buckets.setdefault(int(record.arrival_s // width_s), [0, 0, 0])
        slot[0] += record.cached_tokens
        slot[1] += record.prompt_tokens
        slot[2] += 1
    return [
        TimePoint(k * width_s, (c / p) if p else 0.0, n)
        for k, (c, p, n) in sorted(buckets.items())
    ]


@dataclass(frozen=True, slots=True)
class BandPoint:
    """TTFT percentiles and hit rate of one prompt-length band."""

    band: str
    requests: int
    ttft_p50_s: float
    ttft_p95_s: float
    token_hit_rate: float


def ttft_by_band(run: FleetRun, bands: tuple[int, ...] = DEFAULT_BANDS) -> list[BandPoint]:
    """Seed 004: evaluate cached tokens and TTFT by prompt-length band."""
    groups: dict[str, list[RequestRecord]] = {}
    for record in measured(run):
        groups.setdefault(band_label(record.prompt_tokens, bands), []).append(record)
    order = [band_label(0, bands)] + [band_label(b, bands) for b in bands]
    out = []
    for band in order:
        group = groups.get(band)
        if not group:
            continue
        prompt = sum(r.prompt_tokens for r in group)
        out.append(
            BandPoint(
                band,
                len(group),
                percentile([r.ttft_s for r in group], 0.5),
                percentile([r.ttft_s for r in group], 0.95),
                sum(r.cached_tokens for r in group) / prompt if prompt else 0.0,
            )
        )
    return out


def load_per_replica(run: FleetRun) -> list[float]:
    """Prefill GPU-seconds each replica spent on measured requests."""
    per_replica = [0.0] * run.config.replicas
    for record in measured(run):
        per_replica[record.replica] += prefill_cost_s(run, record)
    return per_replica
