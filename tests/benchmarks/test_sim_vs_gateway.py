"""benchmarks/sim_vs_gateway.py's ranking measure: Kendall's tau-b with a tie band."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_vs_gateway.py"


def test_tau_is_one_for_the_same_order_and_minus_one_for_the_reverse(bench: ModuleType) -> None:
    """Exact ties only: same order 1, reversed order -1."""
    assert bench.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert bench.kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0


def test_tau_b_counts_a_pair_tied_on_one_side_against_the_order(bench: ModuleType) -> None:
    """(1,2,3) against (5,5,6): two concordant pairs, one tied only in b: 2 / sqrt(3 x 2)."""
    assert math.isclose(bench.kendall_tau([1, 2, 3], [5, 5, 6]), 2 / math.sqrt(6))


def test_a_difference_inside_the_band_is_a_tie_on_both_sides(bench: ModuleType) -> None:
    """A swap of two figures closer than the band does not count against the ranking."""
    def band(x: float, y: float) -> float:
        return 0.05 * max(x, y)

    gateway, simulator = [100.0, 102.0, 150.0], [101.0, 99.0, 149.0]
    assert bench.kendall_tau(gateway, simulator) < 0.5
    assert bench.kendall_tau(gateway, simulator, band, band) == 1.0


def test_tau_is_nan_when_no_pair_is_ordered(bench: ModuleType) -> None:
    """Everything tied in both samples: no ranking to compare."""
    assert math.isnan(bench.kendall_tau([1.0, 1.0], [2.0, 2.0]))


def test_pair_orders_say_which_pairs_lower_the_tau(bench: ModuleType) -> None:
    """(1,2,3,0) against (5,5,6,7): two pairs ordered alike, three opposite ways (each pair
    with the last value), one tied in the second sample only; tau-b comes from those counts."""
    orders = bench.pair_orders([1, 2, 3, 0], [5, 5, 6, 7])
    assert (orders.concordant, orders.discordant, orders.ties_a, orders.ties_b) == (2, 3, 0, 1)
    assert math.isclose(orders.tau_b, -1 / math.sqrt(5 * 6))
    assert orders.tau_b == bench.kendall_tau([1, 2, 3, 0], [5, 5, 6, 7])


def _run(path: Path, seed: int, figures: dict[str, tuple[float, float, float]]) -> Path:
    rows = [{"scenario": "belgavi", "router": router, "error": None, "hit_rate": hit,
             "p95_ms": p95, "router_ms": router_ms}
            for router, (hit, p95, router_ms) in figures.items()]
    rows.append({"scenario": "belgavi", "router": "smg", "error": "refused", "hit_rate": 0.0,
                 "p95_ms": 0.0, "router_ms": 0.0})
    path.write_text(json.dumps({"args": {"replicas": "4", "seed": str(seed), "json": str(path)},
                                "runs": rows}))
    return path


def test_several_runs_compare_as_their_medians(bench: ModuleType, tmp_path: Path) -> None:
    """Three runs of one setup give each row the median of its figures; a run that failed
    does not count; runs of another setup are refused, naming what differs."""
    runs = [_run(tmp_path / f"{i}.json", 7, {"kvreuse:cost": (hit, p95, 4.0 + i)})
            for i, (hit, p95) in enumerate([(0.80, 90.0), (0.83, 70.0), (0.83, 68.0)])]
    args, rows = bench.merged_runs(runs)
    assert args["seed"] == "7"
    assert rows == [{"scenario": "belgavi", "router": "kvreuse:cost", "error": None, "runs": 3,
                     "router_ms": 5.0, "hit_rate": 0.83, "p95_ms": 70.0}]
    other = _run(tmp_path / "other.json", 8, {"kvreuse:cost": (0.8, 90.0, 4.0)})
    with pytest.raises(SystemExit, match="other seed"):
        bench.merged_runs([runs[0], other])
