"""benchmarks/gateway_streams.py: routers.py's workloads over seeded streams, simulated."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "gateway_streams.py"


def test_routers_map_to_the_rules_the_simulator_runs(bench: ModuleType) -> None:
    """kvreuse:NAME plays NAME, the Rust peers play cache_aware_smg, others are refused."""
    assert bench.policy_of("kvreuse:relative_spill") == "relative_spill"
    assert bench.policy_of("smg") == bench.policy_of("sglang-router") == "cache_aware_smg"
    with pytest.raises(ValueError, match="vllm-router-kv"):
        bench.policy_of("vllm-router-kv")


def test_report_counts_the_streams_the_candidate_leads(bench: ModuleType) -> None:
    """Seed 1: candidate 0.50 vs 0.40; seed 2: 0.50 vs 0.55; one stream of two, means +2.5
    points and -20 ms."""
    figures = {("a", 1): bench.StreamFigures(0.50, 100.0), ("b", 1): bench.StreamFigures(0.40, 150),
               ("a", 2): bench.StreamFigures(0.50, 100.0), ("b", 2): bench.StreamFigures(0.55, 90)}
    lines = bench.report("contracts", (1, 2), ["a", "b"], figures)
    assert "| mean of 2 | 50.0% / 100 ms | 47.5% / 120 ms |" in lines
    assert lines[-1] == ("contracts: a at or above b's hit rate on 1 of 2 streams; means "
                         "+2.50 points, p95 -20 ms")


def test_a_short_run_prints_a_row_per_stream(bench: ModuleType,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Two short contracts streams, two routers: a row per seed, the means, the count."""
    assert bench.main(["--seeds", "1,2", "--scenarios", "contracts", "--replays", "1",
                       "--warmup", "1", "--duration", "2", "--cache-tokens", "12288",
                       "--routers", "kvreuse:relative_spill,smg"]) == 0
    out = capsys.readouterr().out
    assert "| 1 | " in out and "| 2 | " in out and "| mean of 2 | " in out
    assert "contracts: kvreuse:relative_spill at or above smg's hit rate on " in out


@pytest.mark.parametrize("argv", [["--routers", "kvreuse:relative_spill,nginx"],
                                  ["--scenarios", "chats"], ["--replays", "0"],
                                  ["--seeds", "x"], ["--cache-tokens", "0"], ["--replicas", "0"],
                                  ["--rate", "0"], ["--duration", "nan"], ["--max-tokens", "0"]])
def test_bad_arguments_are_usage_errors(bench: ModuleType, argv: list[str],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown router or scenario, no replay, a bad seed list or a fleet or stream that cannot
    exist exits 2 with a message."""
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err
