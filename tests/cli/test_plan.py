"""`kvreuse plan`: serial, process pool and Ray agree; cells are cached; the winner reproduces."""

from __future__ import annotations

import json
import os
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvreuse.cli.main import main
from kvreuse.cli.plan import CellCache
from kvreuse.cli.tables import PIPE_WIDTH
from kvreuse.sim.plan import CellResult
from kvreuse.testing.mooncake import synthetic_mooncake

from .plan_traces import GRID, plan


def test_serial_and_pool_give_identical_cells(trace: Path, tmp_path: Path) -> None:
    """The process pool (2 workers) and a serial run produce the same cells and winner."""
    serial = plan(trace, tmp_path / "s.json", "--serial", "--no-cache")
    pooled = plan(trace, tmp_path / "p.json", "--workers", "2", "--no-cache")
    assert len(serial["cells"]) == 2 * 2 + 2 * 2 * 2
    assert serial["cells"] == pooled["cells"] and serial["winner"] == pooled["winner"]
    assert serial["winner"] is not None and serial["winner"]["ttft_p95_s"] <= 0.6


def test_winner_is_the_fewest_replicas_meeting_the_slo(trace: Path, tmp_path: Path) -> None:
    """No cell meeting the SLO has fewer replicas, or as few and less prefill GPU time."""
    data = plan(trace, tmp_path / "w.json", "--serial", "--no-cache")
    winner = data["winner"]
    for cell in data["cells"]:
        if cell["meets_slo"]:
            assert (cell["replicas"], cell["prefill_gpu_s"]) >= (
                winner["replicas"], winner["prefill_gpu_s"])
    assert all(c in data["cells"] for c in data["front"])


def test_printed_command_reproduces_the_winning_cell(trace: Path, tmp_path: Path) -> None:
    """Running the command the plan prints gives the winner's exact figures."""
    data = plan(trace, tmp_path / "a.json", "--serial", "--no-cache")
    argv = [*shlex.split(data["command"])[1:], "--no-cache", "--json", str(tmp_path / "b.json")]
    assert main(argv) == 0
    again = json.loads((tmp_path / "b.json").read_text())
    assert again["cells"] == [data["winner"] | {"meets_slo": True}]


def test_finished_cells_are_cached_and_a_plan_resumes(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second run reads every cell from the cache; a lost cell is run again, alone."""
    cache = tmp_path / "cache"
    first = plan(trace, tmp_path / "1.json", "--serial", "--cache-dir", str(cache))
    files = sorted(cache.glob("*.json"))
    assert len(files) == len(first["cells"])
    files[0].unlink()
    files[1].write_text("{torn")
    capsys.readouterr()
    second = plan(trace, tmp_path / "2.json", "--serial", "--cache-dir", str(cache))
    assert f"{len(files) - 2} from the cache" in capsys.readouterr().out
    assert second["cells"] == first["cells"]


def test_report_has_the_plots(trace: Path, tmp_path: Path) -> None:
    """--report writes an HTML page with three inline PNG plots and the winner."""
    report = tmp_path / "plan.html"
    plan(trace, tmp_path / "r.json", "--serial", "--no-cache", "--report", str(report))
    page = report.read_text()
    assert page.count("data:image/png;base64,") == 3 and "Winner" in page


def test_bad_trace_names_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad trace line exits 1 with file, line and field."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(synthetic_mooncake(requests=2)[0] + '\n{"timestamp": NaN}\n')
    assert main(["plan", "--trace", str(bad), "--slo", "ttft_p95=1", "--no-cache"]) == 1
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err and "'timestamp'" in err


def test_a_cache_too_small_for_the_largest_request_is_left_out(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A cache size that cannot hold the largest request is left out, said so on the console
    and in the JSON; the other sizes are still searched."""
    largest = max(json.loads(text)["input_length"] + json.loads(text)["output_length"]
                  for text in trace.read_text().splitlines())
    small = largest // 2
    out = tmp_path / "plan.json"
    assert main(["plan", "--trace", str(trace), "--policy", "round_robin", "--replicas", "1",
                 "--cache-tokens", f"{small},200000", "--slo", "ttft_p95=10", "--no-cache",
                 "--serial", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {cell["cache_tokens"] for cell in data["cells"]} == {200000}
    assert list(data["left_out_cache_tokens"]) == [str(small)]
    assert "raise the cache size" in data["left_out_cache_tokens"][str(small)]
    assert f"left out --cache-tokens {small:,}" in capsys.readouterr().out


def test_no_cache_size_holding_the_largest_request_is_an_error(
    trace: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """When every cache size is too small the plan exits 1 saying which request needs what."""
    assert main(["plan", "--trace", str(trace), "--policy", "round_robin", "--replicas", "1",
                 "--cache-tokens", "1000,2000", "--slo", "ttft_p95=10", "--no-cache"]) == 1
    err = capsys.readouterr().err
    assert "no --cache-tokens value can hold the trace's largest request" in err
    assert "tokens of KV" in err


def test_bad_slo_is_refused(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown SLO metric exits 1 naming the accepted ones."""
    assert main(["plan", "--trace", str(trace), "--slo", "latency=1", "--no-cache"]) == 1
    assert "ttft_p99" in capsys.readouterr().err


@pytest.mark.ray
def test_ray_gives_the_serial_results(trace: Path, tmp_path: Path) -> None:
    """--ray on a local Ray instance (2 workers) produces the serial run's cells (Ray comes
    with the test install, `.[all,dev]`: no skip when it is missing)."""
    serial = plan(trace, tmp_path / "s.json", "--serial", "--no-cache")
    on_ray = plan(trace, tmp_path / "r.json", "--ray", "--workers", "2", "--no-cache")
    assert on_ray["cells"] == serial["cells"] and on_ray["winner"] == serial["winner"]


def test_simulate_command_gives_the_winners_figures(trace: Path, tmp_path: Path) -> None:
    """The plan's `kvreuse simulate` line for the winner reports the winner's hit rate and p95."""
    data = plan(trace, tmp_path / "a.json", "--serial", "--no-cache")
    out = tmp_path / "sim.json"
    argv = [*shlex.split(data["simulate_command"])[1:], "--json", str(out)]
    assert main(argv) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["token_hit_rate"] == data["winner"]["token_hit_rate"]
    assert run["ttft_p95_s"] == data["winner"]["ttft_p95_s"]


@pytest.mark.parametrize("columns", [None, 60, 200])
def test_piped_table_honours_columns_and_cuts_no_number(
    trace: Path, tmp_path: Path, columns: int | None,
    piped: Callable[[list[str], int | None], str],
) -> None:
    """Through a pipe, with COLUMNS unset (PIPE_WIDTH), narrow or wide, no line is wider than
    the width and every figure of the front appears whole."""
    out = tmp_path / "plan.json"
    stdout = piped(["plan", "--trace", str(trace), *GRID, "--serial", "--no-cache", "--json",
                    str(out)], columns)
    width = PIPE_WIDTH if columns is None else columns
    table = stdout.split("winner")[0]
    assert max(len(line) for line in table.splitlines()) <= width, table
    front = json.loads(out.read_text())["front"]
    assert front
    for cell in front:
        for figure in (f"{cell['cache_tokens']:,}", f"{cell['token_hit_rate']:.1%}",
                       f"{cell['prefill_gpu_s']:,.1f}", f"{cell['ttft_p95_s']:.3f}s"):
            assert figure in table, (figure, table)


def test_replicas_of_other_speeds_cost_more_and_reproduce(trace: Path, tmp_path: Path) -> None:
    """Every fleet's first replica at half speed: each cell records the speeds and spends
    more prefill time than the same fleet of alike replicas, and the printed commands carry
    the flag and reproduce the winner."""
    grid = [*GRID[:-1], "ttft_p95=1.0", "--serial", "--no-cache"]

    def planned(out: Path, *extra: str) -> dict[str, Any]:
        assert main(["plan", "--trace", str(trace), *grid, "--json", str(out), *extra]) == 0
        data: dict[str, Any] = json.loads(out.read_text())
        return data

    alike = planned(tmp_path / "a.json")
    slow = planned(tmp_path / "s.json", "--prefill-speeds", "0.5")
    assert {c["prefill_speeds"] == [0.5] for c in slow["cells"]} == {True}
    by_fleet = {(c["policy"], c["replicas"], c["cache_tokens"], c["knob_value"]): c
                for c in alike["cells"]}
    for cell in slow["cells"]:
        even = by_fleet[(cell["policy"], cell["replicas"], cell["cache_tokens"],
                         cell["knob_value"])]
        assert cell["prefill_gpu_s"] > even["prefill_gpu_s"]
    assert slow["winner"] is not None
    assert "--prefill-speeds 0.5" in slow["command"]
    assert "--prefill-speeds 0.5" in slow["simulate_command"]
    argv = [*shlex.split(slow["command"])[1:], "--no-cache", "--json", str(tmp_path / "b.json")]
    assert main(argv) == 0
    again = json.loads((tmp_path / "b.json").read_text())
    assert again["cells"] == [slow["winner"] | {"meets_slo": True}]


def test_the_printed_commands_keep_the_knob_in_brackets(
        trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The console lines say the same commands as the JSON: the knob's brackets are not taken
    for console styles."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--trace", str(trace), *GRID, "--serial", "--no-cache",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "[" in data["simulate_command"]
    assert f"or as a simulation: {data['simulate_command']}" in printed
    assert f"reproduce: {data['command']}" in printed


def test_a_cache_that_cannot_be_written_warns_once_and_the_plan_still_answers(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cache directory that cannot be made (a file stands in its way) is one warning, and the
    plan's cells are those of a plan without a cache."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    unwritable = plan(trace, tmp_path / "u.json", "--serial", "--cache-dir",
                      str(blocker / "cache"))
    out = capsys.readouterr().out
    assert out.count("cannot write the plan cache") == 1, out
    assert "Not a directory" in out
    assert unwritable["cells"] == plan(trace, tmp_path / "n.json", "--serial",
                                       "--no-cache")["cells"]


def test_the_cache_stops_writing_after_its_first_failure(trace: Path, tmp_path: Path) -> None:
    """A write that fails mid-plan (the directory gone, a full disk) is reported once with the
    count kept so far; later cells are not tried, and the stop message says what is kept."""
    plan(trace, tmp_path / "p.json", "--serial", "--cache-dir", str(tmp_path / "first"))
    some_file = next((tmp_path / "first").glob("*.json"))
    result = CellResult.from_dict(json.loads(some_file.read_text()))
    cell = result.cell
    cache = CellCache(tmp_path / "cache", "fingerprint")
    assert cache.store(result) is None
    assert cache.load(cell) == result
    shutil.rmtree(tmp_path / "cache")
    (tmp_path / "cache").write_text("")  # the directory replaced by a file
    problem = cache.store(result)
    assert problem is not None and "1 kept" in problem, problem
    assert cache.store(result) is None
    assert cache.stored == 1
    assert "1 of them are in" in cache.kept() and "writing more failed" in cache.kept()


def test_more_workers_than_cpus_run_as_many_as_the_cpus_said_so(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--workers beyond this machine's CPUs is one note naming both counts, and the cells are
    the serial run's."""
    cpus = len(os.sched_getaffinity(0))
    many = plan(trace, tmp_path / "m.json", "--workers", str(cpus + 1), "--no-cache")
    out = capsys.readouterr().out
    assert f"--workers {cpus + 1}: this machine gives the plan {cpus} CPUs" in out, out
    assert many["cells"] == plan(trace, tmp_path / "s.json", "--serial", "--no-cache")["cells"]
