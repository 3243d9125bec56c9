"""benchmarks/default_vs_peers.py's noise estimate: jittered replays of a workload.

No simulation here beyond one tiny workload: the benchmark's figures are printed by the script.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from kvreuse.sim.requests import SimRequest
from kvreuse.tokens import pack

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "default_vs_peers.py"


def stream(count: int) -> list[SimRequest]:
    return [
        SimRequest(i, float(i), pack([i, i + 1]), 2, 1) for i in range(count)
    ]


def test_jitter_moves_each_arrival_by_at_most_the_width(bench: ModuleType) -> None:
    """Every request keeps its id and tokens; its arrival moves by at most ±width."""
    original = stream(50)
    moved = {r.request_id: r for r in bench.jittered(original, 3, 0.4)}
    assert sorted(moved) == [r.request_id for r in original]
    for request in original:
        shifted = moved[request.request_id]
        assert shifted.tokens == request.tokens
        assert abs(shifted.arrival_s - request.arrival_s) <= 0.4
        assert shifted.arrival_s >= 0.0
    assert any(moved[r.request_id].arrival_s != r.arrival_s for r in original)


def test_jittered_stream_is_in_arrival_order_and_seeded(bench: ModuleType) -> None:
    """The replay is sorted by arrival; one seed gives one stream, another seed another."""
    original = stream(50)
    first = bench.jittered(original, 1, 2.0)
    arrivals = [r.arrival_s for r in first]
    assert arrivals == sorted(arrivals)
    assert [r.arrival_s for r in bench.jittered(original, 1, 2.0)] == arrivals
    assert [r.arrival_s for r in bench.jittered(original, 2, 2.0)] != arrivals


def test_jitter_runs_print_the_spread_per_policy(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """--jitter-runs prints one spread row per policy for the workload it replays."""
    bench.main(["--workloads", "mission-3", "--jitter-runs", "1"])
    out = capsys.readouterr().out
    assert "mission-3: seed-0 run and 1 replays with arrivals jittered by ±0.5 s" in out
    spread = out.split("jittered by")[1]
    for policy in ("relative_spill", "cache_aware", "cache_aware_sglang", "llm_d", "dynamo_kv"):
        assert f"| {policy} | " in spread
    assert "(sd " in spread
