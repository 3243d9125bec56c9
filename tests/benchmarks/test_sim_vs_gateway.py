"""benchmarks/sim_vs_gateway.py's ranking measure: Kendall's tau-b with a tie band."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

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


def test_rankings_agree_when_both_sides_tie_every_pair(bench: ModuleType) -> None:
    """Every router within the band on both sides (tau-b 0/0) ranks alike, and says so."""
    band = lambda x, y: 1.0  # noqa: E731
    orders = bench.pair_orders([84.0, 84.3, 84.1], [84.1, 84.3, 84.1], band, band)
    assert math.isnan(orders.tau_b)
    assert orders.agrees(0.8)
    assert orders.shown() == "all pairs tied in both"


def test_rankings_disagree_when_one_side_orders_what_the_other_ties(bench: ModuleType) -> None:
    """A pair tied by one side only is ordered, so it counts against the target."""
    orders = bench.pair_orders([1.0, 1.0], [1.0, 5.0])
    assert math.isnan(orders.tau_b)
    assert not orders.agrees(0.8)
    assert orders.shown().startswith("undefined")
    mixed = bench.pair_orders([1.0, 1.0, 3.0], [1.0, 5.0, 9.0])
    assert math.isclose(mixed.tau_b, 2 / math.sqrt(6))
    assert not mixed.agrees(0.9)
    assert mixed.shown() == "0.82"


def test_pair_orders_say_which_pairs_lower_the_tau(bench: ModuleType) -> None:
    """(1,2,3,0) against (5,5,6,7): two pairs ordered alike, three opposite ways (each pair
    with the last value), one tied in the second sample only; tau-b comes from those counts."""
    orders = bench.pair_orders([1, 2, 3, 0], [5, 5, 6, 7])
    assert (orders.concordant, orders.discordant, orders.ties_a, orders.ties_b) == (2, 3, 0, 1)
    assert math.isclose(orders.tau_b, -1 / math.sqrt(5 * 6))
    assert orders.tau_b == bench.kendall_tau([1, 2, 3, 0], [5, 5, 6, 7])


def _run(path: Path, seed: int, figures: dict[str, tuple[float, float, float]]) -> Path:
    # Rows as routers.py --json writes them (the figures not compared set to plain values).
    other = {"p50_ms": 1.0, "max_over_mean": 1.0, "requests": 10, "lost": 0}
    rows = [{"scenario": "belgavi", "router": router, "error": "", "hit_rate": hit,
             "p95_ms": p95, "router_ms": router_ms, **other}
            for router, (hit, p95, router_ms) in figures.items()]
    rows.append({"scenario": "belgavi", "router": "smg", "error": "refused", "hit_rate": 0.0,
                 "p95_ms": 0.0, "router_ms": 0.0, **other})
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
    with pytest.raises(SystemExit, match=r"streams of seeds \[7, 8\]"):
        bench.merged_runs([runs[0], other])


def test_the_stream_replayed_is_the_one_the_rows_measured(bench: ModuleType,
                                                          tmp_path: Path) -> None:
    """A routers.py --seeds 3 file keeps --seed's default 7 among its arguments, but its rows
    measured seed 3's stream: that is the stream the comparison rebuilds."""
    path = _run(tmp_path / "s3.json", 7, {"kvreuse:cost": (0.8, 90.0, 4.0)})
    data = json.loads(path.read_text())
    for row in data["runs"]:
        row["seed"] = 3
    path.write_text(json.dumps(data))
    args, _ = bench.merged_runs([path])
    assert args["seed"] == "3"


def _requests(lengths: list[int]) -> list[Any]:
    from kvreuse.sim.requests import SimRequest
    from kvreuse.tokens import pack

    return [SimRequest(i, i * 0.1, pack(range(1000 * i, 1000 * i + n)), n, 2)
            for i, n in enumerate(lengths)]


def _recording(directory: Path, lines: list[tuple[int, str]]) -> Path:
    """A routers.py --record directory: one trace file of (prompt length, upstream) lines."""
    directory.mkdir()
    rows = [json.dumps({"timestamp": 10.0 * i, "input_length": n, "output_length": 2,
                        "hash_ids": list(range(-(-n // 16))), "upstream": upstream})
            for i, (n, upstream) in enumerate(lines)]
    (directory / "trace-1-1-00001.jsonl").write_text("\n".join(rows) + "\n")
    return directory


def test_recorded_placements_follow_the_gateway_through_a_reordered_arrival(
        bench: ModuleType, tmp_path: Path) -> None:
    """Two requests that reached the gateway in swapped order still get their own upstream;
    upstreams number in natural name order (engine2 is r0, engine10 r1)."""
    requests = _requests([100, 200, 300, 400])
    recording = _recording(tmp_path / "rec", [(100, "engine10"), (300, "engine2"),
                                              (200, "engine10"), (400, "engine2")])
    assert bench.recorded_placements(recording, requests) == ["r1", "r1", "r0", "r0"]


def test_a_recording_of_another_stream_is_refused(bench: ModuleType, tmp_path: Path) -> None:
    """A prompt length the scenario does not send near that position names the line; another
    request count is refused before matching."""
    requests = _requests([100, 200, 300])
    other = _recording(tmp_path / "other", [(100, "engine0"), (250, "engine1"),
                                            (300, "engine0")])
    with pytest.raises(SystemExit, match=r"line 2 \(250 prompt tokens"):
        bench.recorded_placements(other, requests)
    short = _recording(tmp_path / "short", [(100, "engine0")])
    with pytest.raises(SystemExit, match="1 recorded requests, the scenario sends 3"):
        bench.recorded_placements(short, requests)


def test_recorded_placement_sends_each_request_where_the_gateway_did(bench: ModuleType) -> None:
    """The simulator run on recorded placements puts every request on its recorded replica."""
    from kvreuse.sim.config import FleetConfig, ReplicaConfig
    from kvreuse.sim.fleet import FleetSimulator

    requests = _requests([100, 200, 300, 400, 500])
    placements = ["r2", "r0", "r2", "r1", "r0"]
    run = FleetSimulator(FleetConfig(3, ReplicaConfig(pool_tokens=4096)),
                         bench.RecordedPlacement(placements)).run(requests)
    assert [f"r{record.replica}" for record in run.records] == placements


def test_kvreuse_rows_run_with_the_gateways_index_budget(bench: ModuleType) -> None:
    """A kvreuse policy on its own trees forgets beyond 2 x the engines' reported cache (vLLM
    counts its null block), as kvreuse route's index budget does; a KV-event policy and a
    peer's rule keep unbounded trees."""
    from kvreuse.gateway.config import DEFAULT_INDEX_BUDGET_FACTOR

    assert bench.gateway_options("kvreuse:relative_spill", "relative_spill", 12288) == {
        "block_size": 16,
        "tree_capacity_tokens": int(DEFAULT_INDEX_BUDGET_FACTOR * (12288 + 16))}
    assert "tree_capacity_tokens" not in bench.gateway_options("kvreuse:exact", "exact", 12288)
    assert "tree_capacity_tokens" not in bench.gateway_options("smg", "cache_aware_smg", 12288)


def test_kvreuse_rows_are_simulated_on_the_engines_speed_unless_fixed(
        bench: ModuleType) -> None:
    """A measuring gateway routes on the engines' speed; fixed rows and peers on the default."""
    fleet = bench.gateway_fleet(4, 12_288, 20_000.0)
    cost = bench.gateway_cost("kvreuse:relative_spill", fleet, False)
    assert (cost.prefill_tokens_per_s, cost.overhead_s) == (20_000.0, 0.015)
    assert bench.gateway_cost("kvreuse:relative_spill", fleet, True) is None
    assert bench.gateway_cost("kvreuse:relative_spill/fixed-prefill", fleet, False) is None
    assert bench.gateway_cost("smg", fleet, False) is None
