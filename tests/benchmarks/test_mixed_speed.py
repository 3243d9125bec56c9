"""benchmarks/mixed_speed.py at a tiny size: the kvreuse gateways run through the real CLI."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "mixed_speed.py"


def test_a_tiny_run_prints_every_kvreuse_router_and_their_means(
        bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """Two engines, one slow, 12 requests: three rows and three means, nothing failed, the
    measuring gateway's speed ratio printed and under 1."""
    assert bench.main(["--engines", "2", "--slow", "1", "--requests", "12", "--rps", "20",
                       "--seeds", "1", "--peers", ""]) == 0
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
