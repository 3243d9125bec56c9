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
