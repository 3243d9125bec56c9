"""benchmarks/routers.py's verdicts over repeated runs: medians, losses and errors."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "routers.py"


def row(bench: ModuleType, router: str, hit: float, p95: float, *, lost: int = 0,
        error: str = "", scenario: str = "contracts") -> Any:
    return bench.RunRow(scenario, router, hit, p95 / 2, p95, 1.2, 100, lost, error)


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
