"""The plan's search: cells, SLOs, the choice and the Pareto front (pure)."""

from __future__ import annotations

import pytest

from kvreuse.errors import ConfigError
from kvreuse.sim.config import ReplicaConfig
from kvreuse.sim.plan import Cell, CellResult, Slo, choose, grid, pareto_front, parse_slo, run_cell
from kvreuse.testing.mooncake import synthetic_mooncake
from kvreuse.trace import parse_trace_lines, trace_requests


def result(policy: str, replicas: int, gpu: float, p95: float, cache: int = 1000) -> CellResult:
    return CellResult(Cell(policy, replicas, cache), 10, 0.5, gpu, p95 / 2, p95, p95 * 2, 0.01)


def test_parse_slo_accepts_the_three_metrics_and_names_them_on_error() -> None:
    """ttft_p95/ttft_p99/mean_queue parse; anything else names the accepted metrics."""
    assert parse_slo("ttft_p95=0.5") == Slo("ttft_p95", 0.5)
    assert parse_slo("mean_queue=0.1").metric == "mean_queue"
    for bad in ("ttft=0.5", "ttft_p95", "ttft_p95=nan", "ttft_p95=inf", "ttft_p95=-1"):
        with pytest.raises(ConfigError, match="ttft_p95"):
            parse_slo(bad)


def test_grid_crosses_policies_sizes_caches_and_knobs() -> None:
    """Knobbed policies get one cell per knob value; others one per size and cache."""
    cells = grid(["round_robin", "cache_aware"], [2, 4], [1000, 2000])
    assert len(cells) == 2 * 2 + 2 * 2 * 3
    assert {c.knob for c in cells if c.policy == "cache_aware"} == {0.1, 0.2, 0.5}
    assert grid(["cache_aware"], [2], [1000], [0.3]) == [Cell("cache_aware", 2, 1000, 0.3)]
    assert Cell("cache_aware", 2, 1000, 0.3).options() == {"spill_threshold_s": 0.3}
    with pytest.raises(ConfigError, match="unknown policy"):
        grid(["nope"], [2], [1000])


def test_choose_prefers_fewest_replicas_then_least_gpu_time() -> None:
    """Among cells meeting the SLO: fewest replicas wins, then least prefill GPU time."""
    results = [result("a", 4, 10.0, 0.2), result("b", 2, 50.0, 0.4), result("c", 2, 40.0, 0.45),
               result("d", 1, 5.0, 3.0)]
    best = choose(results, [Slo("ttft_p95", 0.5)])
    assert best is not None and best.cell.policy == "c"
    assert choose(results, [Slo("ttft_p95", 0.1)]) is None
    assert choose(results, [Slo("ttft_p95", 0.5), Slo("ttft_p99", 0.85)]) == results[1]


def test_pareto_front_drops_dominated_cells() -> None:
    """A cell beaten on replicas, GPU time and the SLO metric at once is not on the front."""
    results = [result("a", 2, 10.0, 1.0), result("b", 2, 12.0, 1.2), result("c", 4, 8.0, 0.5)]
    front = pareto_front(results, [Slo("ttft_p95", 0.5)])
    assert [r.cell.policy for r in front] == ["a", "c"]


def test_run_cell_is_deterministic_and_round_trips() -> None:
    """The same cell on the same traffic gives an equal result, and survives as_dict."""
    lines = synthetic_mooncake(requests=200, requests_per_second=4.0)
    requests, units = trace_requests(parse_trace_lines(lines), 512)
    cell = Cell("cache_aware", 2, 100_000, 0.2)
    first = run_cell(cell, requests, units, ReplicaConfig())
    assert first == run_cell(cell, requests, units, ReplicaConfig())
    assert CellResult.from_dict(first.as_dict()) == first
    assert first.requests == 200 and 0 < first.token_hit_rate < 1
    assert first.ttft_p50_s <= first.ttft_p95_s <= first.ttft_p99_s
    assert 0 <= first.mean_queue_s <= first.ttft_p99_s


def test_a_cell_of_mixed_speeds_is_its_own_cell_and_round_trips() -> None:
    """Speeds name the cell (cache files, ties), reach the fleet (more prefill time than the
    alike fleet's) and survive as_dict."""
    lines = synthetic_mooncake(requests=200, requests_per_second=4.0)
    requests, units = trace_requests(parse_trace_lines(lines), 512)
    alike, mixed = Cell("relative_spill", 2, 100_000, 8.0), Cell("relative_spill", 2, 100_000,
                                                                  8.0, (0.5,))
    assert alike.key() != mixed.key() and mixed.key().endswith("speeds=0.5")
    slow = run_cell(mixed, requests, units, ReplicaConfig())
    assert slow.prefill_gpu_s > run_cell(alike, requests, units, ReplicaConfig()).prefill_gpu_s
    assert CellResult.from_dict(slow.as_dict()) == slow
    assert grid(["round_robin"], [3], [1000], prefill_speeds=(0.5,))[0].prefill_speeds == (0.5,)
    with pytest.raises(ConfigError, match="prefill_speeds must be a number from"):
        grid(["round_robin"], [3], [1000], prefill_speeds=(1e5,))
