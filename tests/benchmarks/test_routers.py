"""benchmarks/routers.py's verdicts over repeated runs: medians, losses and errors."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "routers.py"


def row(bench: ModuleType, router: str, hit: float, p95: float, *, lost: int = 0,
        error: str = "", scenario: str = "contracts", seed: int | None = None) -> Any:
    return bench.RunRow(scenario, router, hit, p95 / 2, p95, 1.2, 100, lost, error, seed=seed)


def test_median_rows_take_each_figure_s_median_per_router(bench: ModuleType) -> None:
    """Three runs of one router become one row holding the median hit rate and p95."""
    rows = [row(bench, "smg", 0.52, 210), row(bench, "smg", 0.56, 190),
            row(bench, "smg", 0.54, 250)]
    (merged,) = bench.median_rows(rows)
    assert (merged.router, merged.hit_rate, merged.p95_ms) == ("smg", 0.54, 210)


def test_a_loss_in_any_run_is_kept_by_the_median_row(bench: ModuleType) -> None:
    """One run that lost a request makes the merged row lose it, whatever the other runs."""
    rows = [row(bench, "kvreuse:relative_spill", 0.6, 100),
            row(bench, "kvreuse:relative_spill", 0.6, 100, lost=2),
            row(bench, "kvreuse:relative_spill", 0.6, 100)]
    (merged,) = bench.median_rows(rows)
    assert merged.lost == 2


def test_runs_with_errors_are_left_out_of_the_median(bench: ModuleType) -> None:
    """A failed start does not drag the median: only measured runs count."""
    rows = [row(bench, "smg", float("nan"), float("nan"), error="did not start"),
            row(bench, "smg", 0.5, 100), row(bench, "smg", 0.7, 300)]
    (merged,) = bench.median_rows(rows)
    assert (merged.error, merged.hit_rate, merged.p95_ms) == ("", 0.6, 200)


def test_verdict_judges_the_medians_not_the_best_run(bench: ModuleType) -> None:
    """A peer's one lucky run does not decide: the candidate passes on the medians."""
    rows = [row(bench, "smg", 0.58, 150), row(bench, "kvreuse:relative_spill", 0.55, 140),
            row(bench, "smg", 0.53, 200), row(bench, "kvreuse:relative_spill", 0.55, 140),
            row(bench, "smg", 0.54, 190), row(bench, "kvreuse:relative_spill", 0.56, 150)]
    (line,) = bench.verdicts(rows, {}, {}, "kvreuse:relative_spill")
    assert line.startswith("[PASS] contracts: kvreuse:relative_spill 55.0% vs best peer smg "
                           "54.0%")


def test_verdict_fails_on_medians_a_single_lucky_run_would_pass(bench: ModuleType) -> None:
    """The candidate's one good run does not pass it when its median is under the peer's."""
    rows = [row(bench, "smg", 0.55, 150), row(bench, "kvreuse:relative_spill", 0.58, 140),
            row(bench, "smg", 0.55, 150), row(bench, "kvreuse:relative_spill", 0.52, 140),
            row(bench, "smg", 0.55, 150), row(bench, "kvreuse:relative_spill", 0.53, 140)]
    (line,) = bench.verdicts(rows, {}, {}, "kvreuse:relative_spill")
    assert line.startswith("[FAIL]")


def test_verdicts_from_refuses_files_of_another_setup(bench: ModuleType,
                                                      tmp_path: Path) -> None:
    """Two saved runs at different cache sizes are not judged together; the message says so."""
    args = {"replicas": "4", "cache_tokens": "12288", "prefill_tokens_per_s": "20000.0",
            "rate": "16.0", "warmup": "10.0", "duration": "20.0", "max_tokens": "8",
            "seed": "7"}
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"args": args, "runs": []}))
    second.write_text(json.dumps({"args": {**args, "cache_tokens": "32768"}, "runs": []}))
    with pytest.raises(SystemExit, match="other cache_tokens"):
        bench.verdicts_from([first, second], "kvreuse:relative_spill")


def test_repeats_below_one_are_refused(bench: ModuleType,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """--repeats 0 is a usage error naming the flag, not an empty run."""
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeats", "0"])
    assert "--repeats must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("content", [None, "{bad", "[1, 2]", '{"args": {}}'])
def test_verdicts_from_names_a_file_it_cannot_read(bench: ModuleType, tmp_path: Path,
                                                   content: str | None) -> None:
    """A missing, malformed or foreign file is refused with its path, not a traceback."""
    path = tmp_path / "runs.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit, match=r"not a routers\.py --json file"):
        bench.verdicts_from([path], "kvreuse:relative_spill")


def test_seed_means_average_each_stream_s_median(bench: ModuleType) -> None:
    """Seed 1 run three times (median 0.54 / 210 ms) and seed 2 once (0.60 / 150 ms): the row
    judged is their mean, each stream counting once (0.57 / 180 ms)."""
    rows = [row(bench, "smg", 0.52, 210, seed=1), row(bench, "smg", 0.56, 190, seed=1),
            row(bench, "smg", 0.54, 250, seed=1), row(bench, "smg", 0.60, 150, seed=2)]
    (merged,) = bench.seed_means(rows)
    assert (merged.hit_rate, merged.p95_ms) == (pytest.approx(0.57), pytest.approx(180))


def test_a_stream_a_router_failed_on_keeps_it_from_the_mean(bench: ModuleType) -> None:
    """A router that measured nothing on one stream is not judged on the others alone."""
    rows = [row(bench, "smg", 0.6, 100, seed=1),
            row(bench, "smg", float("nan"), float("nan"), error="did not start", seed=2)]
    (merged,) = bench.seed_means(rows)
    assert merged.error == "did not start"


def test_a_router_missing_a_stream_is_not_judged_on_the_others(bench: ModuleType) -> None:
    """A peer run on seed 7 only is left out of the mean over seeds 1 and 7, with the reason."""
    rows = [row(bench, "vllm-router", 0.7, 100, seed=7), row(bench, "smg", 0.5, 200, seed=7),
            row(bench, "smg", 0.5, 200, seed=1)]
    merged = {r.router: r for r in bench.seed_means(rows)}
    assert merged["vllm-router"].error == "measured on 1 of the 2 streams (seeds 7)"
    assert merged["smg"].error == ""


def test_several_streams_are_judged_each_and_on_their_mean(bench: ModuleType) -> None:
    """The candidate loses seed 1 by one point and wins seed 2 by three: one verdict per
    stream, then PASS on the means (0.58 against 0.57) against the mean ceiling."""
    rows = [row(bench, "smg", 0.60, 200, seed=1), row(bench, "kvreuse:relative_spill", 0.59,
                                                      150, seed=1),
            row(bench, "smg", 0.54, 200, seed=2), row(bench, "kvreuse:relative_spill", 0.57,
                                                      150, seed=2)]
    ceilings = {("contracts", 1): 0.61, ("contracts", 2): 0.57}
    lines = bench.verdicts(rows, {}, ceilings, "kvreuse:relative_spill")
    assert [line.split(":")[0] for line in lines] == [
        "[FAIL] contracts, seed 1", "[PASS] contracts, seed 2",
        "[PASS] contracts, mean of seeds 1, 2"]
    assert "kvreuse:relative_spill 58.0% vs best peer smg 57.0%" in lines[2]
    assert "ceiling 59.0%" in lines[2]


def test_one_stream_keeps_the_single_verdict(bench: ModuleType) -> None:
    """Rows of one seed are judged as before: one line, no stream label."""
    rows = [row(bench, "smg", 0.5, 200, seed=7), row(bench, "kvreuse:relative_spill", 0.6, 150,
                                                     seed=7)]
    (line,) = bench.verdicts(rows, {}, {("contracts", 7): 0.7}, "kvreuse:relative_spill")
    assert line.startswith("[PASS] contracts: ")


def test_seeds_take_lists_and_ranges(bench: ModuleType) -> None:
    """``1,4-6,9`` names five streams, in that order."""
    assert bench.parse_seeds("1,4-6,9") == (1, 4, 5, 6, 9)


@pytest.mark.parametrize("value", ["1,x", "1,,2", "3,3", "1-3,2", "5-4"])
def test_bad_seeds_are_refused(bench: ModuleType, capsys: pytest.CaptureFixture[str],
                               value: str) -> None:
    """--seeds takes distinct integers; anything else is a usage error naming the flag."""
    with pytest.raises(SystemExit):
        bench.parse_args(["--seeds", value])
    assert "--seeds" in capsys.readouterr().err


def test_verdicts_from_judges_files_of_several_streams(bench: ModuleType, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """Saved runs of seeds 1 and 2 (rows from before rows carried their seed take their file's
    --seed) are judged per stream and on the mean, each stream's ceiling from its own traffic."""
    args = {"replicas": "4", "cache_tokens": "12288", "prefill_tokens_per_s": "20000.0",
            "rate": "16.0", "warmup": "2.0", "duration": "4.0", "max_tokens": "8"}
    paths = []
    for seed, (mine, peer) in {1: (0.59, 0.60), 2: (0.57, 0.54)}.items():
        runs = [{**bench.asdict(row(bench, name, hit, p95)), "seed": None}
                for name, hit, p95 in (("smg", peer, 200), ("kvreuse:relative_spill", mine, 150))]
        path = tmp_path / f"s{seed}.json"
        path.write_text(json.dumps({"args": {**args, "seed": str(seed)}, "runs": runs}))
        paths.append(path)
    assert bench.verdicts_from(paths, "kvreuse:relative_spill") == 0
    out = capsys.readouterr().out
    assert "contracts  seed 1: ceiling" in out and "contracts  seed 2: ceiling" in out
    assert "contracts, seed 1: kvreuse:relative_spill 59.0%" in out
    assert "contracts, mean of seeds 1, 2: kvreuse:relative_spill 58.0% vs best peer smg 57.0%" \
        in out


def test_a_fixed_prefill_variant_names_its_policy_and_the_flag(bench: ModuleType) -> None:
    """kvreuse:POLICY/fixed-prefill runs POLICY with --fixed-prefill; kvreuse:POLICY without."""
    assert bench.kvreuse_policy("kvreuse:relative_spill/fixed-prefill") == (
        "relative_spill", True)
    assert bench.kvreuse_policy("kvreuse:relative_spill") == ("relative_spill", False)


def test_the_prefill_report_names_each_upstream_s_routed_speed(
        bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """After streamed answers from two alike engines, the report prints the model's measured
    speed and both upstreams routed at 1 (within the alike band)."""
    import httpx

    from kvreuse.testing.processes import EngineSpec, Fleet

    with Fleet(tmp_path) as fleet:
        engines = fleet.start_engines(2, EngineSpec(events=False, tpot_ms=1))
        gateway = fleet.start_gateway("gw", engines, policy="relative_spill")
        for i in range(12):
            with httpx.stream("POST", gateway.url + "/v1/completions", timeout=30,
                              json={"model": "sim", "prompt": f"question {i} " * 40,
                                    "max_tokens": 2, "stream": True}) as response:
                assert response.status_code == 200
                response.read()
        bench.report_prefill_speed("kvreuse:relative_spill", gateway.url)
    out = capsys.readouterr().out
    assert "# kvreuse:relative_spill measured model " in out
    assert "first tokens timed" in out
    assert "# kvreuse:relative_spill routed upstreams at: engine0 1.000, engine1 1.000" in out
