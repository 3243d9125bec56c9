"""benchmarks/mixed_speed.py at a tiny size: the kvreuse gateways run through the real CLI."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "mixed_speed.py"


def test_a_tiny_run_prints_every_kvreuse_router_and_their_means(
        bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """Two engines, one slow, 12 requests: three rows and three means, nothing failed, the
    measuring gateway's speed ratio printed and under 1."""
    assert bench.main(["--engines", "2", "--slow", "1", "--requests", "12", "--rps", "20",
                       "--seeds", "1", "--peers", "", "--replays", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split("|") for line in lines if line.startswith("| kvreuse")]
    assert [row[1].strip() for row in rows] == [*bench.ROUTERS, *bench.ROUTERS], lines
    for row in rows:
        assert row[8].strip() == "0", row  # failed
    measured = float(rows[0][3])
    assert 0 < measured < 1, rows[0]
    assert rows[1][3].strip() == rows[2][3].strip() == "", rows  # not measured


def test_weights_are_added_to_the_named_upstreams_only(bench: ModuleType) -> None:
    """with_weights appends ,weight=W to the flags of the engines it names."""
    argv = ["kvreuse", "route", "--upstream", "http://a,name=e0", "--upstream",
            "http://b,name=e1,events=tcp://x", "--policy", "p"]
    assert bench.with_weights(argv, {"e1": 0.25}) == [
        "kvreuse", "route", "--upstream", "http://a,name=e0", "--upstream",
        "http://b,name=e1,events=tcp://x,weight=0.25", "--policy", "p"]


def test_the_workload_is_the_seeds_shape(bench: ModuleType) -> None:
    """Two streams of one seed arrive at the same times with prompts of the same sizes."""
    first, second = bench.workload(3, 50, 10.0), bench.workload(3, 50, 10.0)
    assert [c.at_s for c in first] == [c.at_s for c in second]
    assert [len(c.body) for c in first] == [len(c.body) for c in second]
    assert [c.at_s for c in bench.workload(4, 50, 10.0)] != [c.at_s for c in first]


def test_the_simulated_stream_is_the_warm_up_then_the_seeds_stream(bench: ModuleType) -> None:
    """48 unmeasured warm-up requests, then the seed's stream, measured, in arrival order."""
    args = argparse.Namespace(requests=30, rps=10.0)
    requests = bench.simulated_stream(2, args)
    assert [r.measured for r in requests] == [False] * 48 + [True] * 30
    assert [r.request_id for r in requests] == list(range(78))
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)
    assert [r.output_len for r in requests[47:49]] == [2, 8]


def test_the_simulator_finds_the_slow_engine_as_the_measuring_gateway_would(
        bench: ModuleType) -> None:
    """Simulated, the measuring router's speed ratio lands near the true 0.25 and it sends
    the slow engine a smaller share of tokens than the router that sees the engines alike;
    known weights send it less still."""
    args = argparse.Namespace(engines=4, slow=1, rate=10_000.0, slow_rate=2_500.0,
                              requests=120, rps=12.0)
    requests = bench.simulated_stream(1, args)
    rows = {router: bench.simulate_run(router, 1, requests, args, 0)
            for router in ("kvreuse", "kvreuse --fixed-prefill", "kvreuse weight=")}
    assert 0.15 < rows["kvreuse"].measured < 0.45
    assert rows["kvreuse --fixed-prefill"].measured is None
    assert (rows["kvreuse weight="].slow_share <= rows["kvreuse"].slow_share
            < rows["kvreuse --fixed-prefill"].slow_share)
