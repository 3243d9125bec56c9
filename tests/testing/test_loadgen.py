"""The load generator's latency summary."""

from __future__ import annotations

import math

from kvreuse.testing.loadgen import Call, LatencySummary, Result


def result(ttft_s: float | None, status: int = 200) -> Result:
    return Result(Call(0.0, "/v1/completions", b"{}"), "http://t", status=status, ttft_s=ttft_s)


def test_latency_summary_percentiles_are_in_milliseconds() -> None:
    """p50/p95/p99 are nearest-rank over the answered calls' TTFTs, in ms."""
    summary = LatencySummary.of([result(n / 8) for n in range(1, 101)] + [result(None, 0)])
    assert (summary.count, summary.lost) == (101, 1)
    assert (summary.p50_ms, summary.p95_ms, summary.p99_ms) == (50 * 125.0, 95 * 125.0,
                                                                  99 * 125.0)


def test_latency_summary_without_an_answer_is_nan() -> None:
    """When nothing was answered the percentiles are NaN, not a number that looks measured."""
    summary = LatencySummary.of([result(None, 0)])
    assert summary.lost == 1 and math.isnan(summary.p50_ms) and math.isnan(summary.p99_ms)


def test_engine_mean_ttft_is_the_delta_sum_over_the_delta_count() -> None:
    """Two engines' TTFT histograms between two scrapes: (0.3 + 0.5) s over 2 + 2 requests."""
    from kvreuse.testing.loadgen import EngineCounters, engine_mean_ttft_s

    before = {"a": EngineCounters(ttft_sum_s=1.0, ttft_count=4), "b": EngineCounters()}
    after = {"a": EngineCounters(ttft_sum_s=1.3, ttft_count=6),
             "b": EngineCounters(ttft_sum_s=0.5, ttft_count=2)}
    assert abs(engine_mean_ttft_s(before, after) - 0.2) < 1e-12
    assert math.isnan(engine_mean_ttft_s(after, after))
