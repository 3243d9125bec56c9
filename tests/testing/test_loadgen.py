"""The load generator: its latency summary, its pacing and its stop."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterator

from kvreuse.testing.loadgen import CANCELLED, Call, LatencySummary, Result, run_stream
from kvreuse.testing.servers import answering_server, trickle


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


def test_a_call_sent_behind_its_time_says_how_late() -> None:
    """A sender whose loop was busy when a call fell due marks that call late by the delay;
    calls it got out on time are not late."""
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    def calls() -> Iterator[Call]:
        yield Call(0.0, "/v1/completions", b"{}")
        yield Call(0.1, "/v1/completions", b"{}")
        time.sleep(0.5)  # a generator that blocks the loop, as building a huge body would
        yield Call(0.2, "/v1/completions", b"{}")

    results: list[Result] = []
    with answering_server(lambda conn: conn.sendall(ok)) as target:
        asyncio.run(run_stream(calls(), lambda i, call: target, results.append, timeout_s=5))
    late = sorted((r.call.at_s, r.late_s) for r in results)
    assert [at for at, _ in late] == [0.0, 0.1, 0.2]
    assert late[0][1] < 0.05 and late[1][1] < 0.05 and late[2][1] >= 0.35


def test_calls_in_flight_when_a_stream_is_cancelled_each_get_a_cancelled_result() -> None:
    """Stopping a run (Ctrl-C cancels it) gives every call sent exactly one result: those still
    waiting for an answer say they were cancelled instead of vanishing."""
    results: list[Result] = []

    async def stop_midway(target: str) -> None:
        run = asyncio.create_task(run_stream(
            (Call(n * 0.05, "/v1/completions", b"{}") for n in range(100)),
            lambda i, call: target, results.append, timeout_s=30))
        await asyncio.sleep(0.5)
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run

    with answering_server(trickle) as target:
        asyncio.run(stop_midway(target))
    assert 5 <= len(results) < 100
    assert all(r.error.startswith(CANCELLED) for r in results)
    assert len({r.call.at_s for r in results}) == len(results)
