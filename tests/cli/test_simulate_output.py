"""What `kvreuse simulate` prints: every run's full label, every figure uncut through a pipe and
at 80 and 100 columns, policy options, baselines, `--json -`, and the reasons of OUT OF RANGE."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvreuse.cli.main import main
from kvreuse.cli.tables import PIPE_WIDTH

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _cells(run: dict[str, Any]) -> list[str]:
    """The figures of a JSON run as the table formats them."""
    return [
        f"{run['token_hit_rate']:.1%}", f"{run['request_hit_rate']:.1%}",
        f"{run['prefill_gpu_s_per_1k']:.1f}", f"{run['ttft_p50_s']:.3f}",
        f"{run['ttft_p95_s']:.3f}", f"{run['max_over_mean_load']:.2f}",
        f"{run['evicted_tokens']:,}", f"{run['requests']:,}",
    ]


@pytest.fixture(scope="module")
def mission_four(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Mission four at a quarter of its window: seven spill thresholds plus a baseline."""
    out = tmp_path_factory.mktemp("m4") / "m4.json"
    assert main(["simulate", "--scenario", "mission-4", "--scale", "0.25",
                 "--json", str(out)]) == 0
    payload: dict[str, Any] = json.loads(out.read_text())
    return payload


@pytest.mark.parametrize("columns", [None, 80, 100])
def test_every_label_and_figure_survives_a_pipe_at_any_width(
    mission_four: dict[str, Any], columns: int | None,
    piped: Callable[[list[str], int | None], str]
) -> None:
    """Through a pipe, unset COLUMNS (120), 80 and 100: each run's full label on one line,
    every figure whole, no ellipsis, no line wider than the width."""
    text = piped(["simulate", "--scenario", "mission-4", "--scale", "0.25"], columns)
    lines = text.splitlines()
    assert "…" not in text
    assert max(len(line) for line in lines) <= (columns or PIPE_WIDTH)
    for run in mission_four["runs"]:
        label = f"{run['label']} x{run['replicas']}"
        row = next((i for i, line in enumerate(lines) if label in line), None)
        assert row is not None, f"{label} missing at {columns}"
        # the figures are on the label's line (a table) or in the lines of its block
        block = " ".join(lines[row: row + 3])
        for cell in _cells(run):
            assert cell in block, (label, cell, columns)


def test_mission_four_labels_every_spill_threshold(mission_four: dict[str, Any]) -> None:
    """Seven exact rows, each named by its threshold, and the no-cache baseline of exact."""
    labels = [run["label"] for run in mission_four["runs"]]
    assert labels[:7] == [
        f"exact[spill_threshold_s={s}]" for s in ("0.0", "0.05", "0.1", "0.2", "0.4", "0.8", "inf")
    ]
    assert labels[7:] == ["exact (no_cache)"]
    baseline = mission_four["runs"][7]
    assert baseline["token_hit_rate"] == 0.0 and baseline["variant"] == "no_cache"


def test_contract_library_rows_carry_their_options(capsys: pytest.CaptureFixture[str]) -> None:
    """The three prefix_hash rows differ by their options, and the table says which."""
    assert main(["simulate", "--scenario", "contract-library", "--scale", "0.1",
                 "--no-baseline"]) == 0
    out = capsys.readouterr().out
    for label in ("prefix_hash x8", "prefix_hash[overload=None] x8",
                  "prefix_hash[load_metric=in_flight] x8"):
        assert label in out


def test_policy_options_in_brackets_and_by_flag_give_the_same_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """prefix_hash[overload=None] and --policy-option overload=null are one run, and it is the
    scenario's unbounded affinity run (its stated range is checked)."""
    runs = []
    for args in (["--policy", "prefix_hash[overload=None]"],
                 ["--policy", "prefix_hash", "--policy-option", "overload=null"]):
        assert main(["simulate", "--scenario", "contract-library", "--scale", "0.1",
                     "--no-baseline", "--json", "-", *args]) == 0
        runs.append(json.loads(capsys.readouterr().out)["runs"])
    assert runs[0] == runs[1]
    assert [r["label"] for r in runs[0]] == ["prefix_hash[overload=None]"]


def test_an_option_no_chosen_policy_takes_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """--policy-option naming nothing any chosen policy takes: exit 1 naming the flag."""
    assert main(["simulate", "--scenario", "belgavi", "--policy", "round_robin",
                 "--policy-option", "overload=2"]) == 1
    err = capsys.readouterr().err
    assert "--policy-option overload=2" in err and "round_robin" in err
    assert main(["simulate", "--scenario", "belgavi", "--policy", "round_robin[k=1]"]) == 1
    assert "has no option 'k'" in capsys.readouterr().err


def test_json_dash_writes_json_to_stdout(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--json - prints the JSON alone on stdout (the table goes to stderr), no file named -."""
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--scenario", "six-turn", "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["scenario"] == "six-turn"
    assert "six-turn" in captured.err
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize(("flag", "policy", "seconds"), [
    ("first_byte_lag", "cost", 0.002), ("last_byte_lag", "cache_aware_smg", 0.008)])
def test_a_router_lag_reaches_the_fleet_and_needs_the_router_view(
    capsys: pytest.CaptureFixture[str], flag: str, policy: str, seconds: float
) -> None:
    """--first-byte-lag and --last-byte-lag are recorded with the run's parameters under
    --load-view router, and refused with a message naming the flag they need without it."""
    args = ["simulate", "--scenario", "belgavi", "--scale", "0.05", "--policy", policy,
            "--replicas", "3", "--no-baseline", f"--{flag.replace('_', '-')}", str(seconds),
            "--json", "-"]
    assert main([*args, "--load-view", "router"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"][flag] == seconds
    assert main(args) == 1
    assert "--load-view router" in capsys.readouterr().err


def test_out_of_range_lines_say_why(capsys: pytest.CaptureFixture[str]) -> None:
    """With the block cache instead of the radix tree, six-turn's radix figure leaves its range
    and the line names the flag responsible."""
    assert main(["simulate", "--scenario", "six-turn", "--cache-kind", "block"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    verdicts = out.split("OUT OF RANGE")[1:]
    assert verdicts, out
    for verdict in verdicts:
        assert "60 above the range, because --cache-kind block" in verdict.split(" in range ")[0]


def test_scale_is_named_as_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    """Three seconds of belgavi leave ranges (seeded, so always the same ones), and each such
    line names --scale."""
    assert main(["simulate", "--scenario", "belgavi", "--scale", "0.05", "--no-baseline"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    verdicts = out.split("OUT OF RANGE")[1:]
    assert len(verdicts) == 3
    for verdict in verdicts:
        assert "because --scale 0.05 measures 5% of the scenario's window" in verdict


def test_the_bounds_say_what_pooled_lru_is_not(capsys: pytest.CaptureFixture[str]) -> None:
    """The pooled LRU figure is called a reference, not a ceiling, and is given per fleet size:
    on belgavi, SGLang's rule on 3 replicas beats the pooled LRU of 3 replicas' memory."""
    assert main(["simulate", "--scenario", "belgavi", "--no-baseline", "--json", "-"]) == 0
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())
    assert "a ceiling, no routing reuses more" in err and "a reference, not a ceiling" in err
    payload = json.loads(captured.out)
    by_size = {b["replicas"]: b for b in payload["bounds_by_replicas"]}
    assert sorted(by_size) == [3, 6] and payload["bounds"] == by_size[6]
    assert f"x3: pooled LRU of 3 x 10,892 tokens {by_size[3]['pooled_lru_hit_rate']:.1%}" in err
    sglang = next(r for r in payload["runs"] if r["policy"] == "cache_aware_sglang")
    assert sglang["token_hit_rate"] > by_size[3]["pooled_lru_hit_rate"]
    for bounds in by_size.values():
        assert all(r["token_hit_rate"] <= bounds["infinite_hit_rate"] for r in payload["runs"])


def test_a_100_column_terminal_gets_whole_figures(mission_four: dict[str, Any]) -> None:
    """In a real (pseudo-)terminal 100 columns wide, with no COLUMNS set, rich reads the width
    from the terminal: still every label and figure whole, no ellipsis."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 100, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env["TERM"] = "xterm"  # rich takes a "dumb" terminal for 80 columns whatever its size
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kvreuse.cli.main import main; sys.exit(main())",
         "simulate", "--scenario", "mission-4", "--scale", "0.25"],
        stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert child.wait(timeout=300) == 0
    os.close(master)
    raw = b"".join(chunks).decode("utf-8", "replace").replace("\r", "")
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw)  # colours and cursor codes
    assert "…" not in text
    for run in mission_four["runs"]:
        line = next(line for line in text.splitlines() if f"{run['label']} x4" in line)
        assert all(cell in line for cell in _cells(run)), (line, _cells(run))


def test_prefill_speeds_reach_the_fleet_padded_to_its_size(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--prefill-speeds 0.25 slows the first replica of any fleet size (the rest at 1): the
    run's parameters record it, its p95 rises over the same run without it, and the out-of-range
    lines name the flag."""
    args = ["simulate", "--scenario", "belgavi", "--scale", "0.1", "--policy", "round_robin",
            "--replicas", "3", "--no-baseline", "--json", "-"]
    assert main(args) == 0
    even = json.loads(capsys.readouterr().out)
    assert main([*args, "--prefill-speeds", "0.25", "--speed-view", "known"]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert slow["parameters"]["prefill_speeds"] == [0.25]
    assert slow["parameters"]["speed_view"] == "known"
    assert slow["runs"][0]["ttft_p95_s"] > even["runs"][0]["ttft_p95_s"]
    assert main(["simulate", "--scenario", "belgavi", "--scale", "0.1", "--no-baseline",
                 "--prefill-speeds", "0.25"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "OUT OF RANGE" in out
    assert "--prefill-speeds 0.25 makes replicas prefill at other speeds" in out


@pytest.mark.parametrize("given", ["0", "-1", "nan", "inf", "fast", "1,,2"])
def test_a_speed_that_is_not_a_positive_number_is_refused(
        capsys: pytest.CaptureFixture[str], given: str) -> None:
    """argparse names the bad speed; nothing runs."""
    with pytest.raises(SystemExit):
        main(["simulate", "--scenario", "belgavi", "--prefill-speeds", given])
    assert "--prefill-speeds" in capsys.readouterr().err


def test_a_speed_view_without_speeds_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """--speed-view alone says nothing: the error says to give --prefill-speeds or
    --speed-change."""
    assert main(["simulate", "--scenario", "belgavi", "--scale", "0.05", "--policy",
                 "round_robin", "--speed-view", "known"]) == 1
    assert "give --prefill-speeds or --speed-change too" in capsys.readouterr().err


def test_speed_changes_run_and_are_reported(capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path) -> None:
    """--speed-change throttles a replica mid-run: the run is slower than without it, and
    the JSON's parameters list the changes."""
    args = ["simulate", "--scenario", "belgavi", "--policy", "round_robin", "--replicas", "3",
            "--no-baseline", "--scale", "0.5"]
    plain, throttled = tmp_path / "plain.json", tmp_path / "throttled.json"
    assert main([*args, "--json", str(plain)]) == 0
    capsys.readouterr()
    assert main([*args, "--json", str(throttled), "--speed-change", "25:r0:0.25",
                 "--speed-change", "40:0:1"]) == 0
    before, after = (json.loads(path.read_text()) for path in (plain, throttled))
    assert after["parameters"]["speed_change"] == [[25.0, 0, 0.25], [40.0, 0, 1.0]]
    assert after["runs"][0]["ttft_p95_s"] > before["runs"][0]["ttft_p95_s"]


@pytest.mark.parametrize(("flag", "says"), [
    ("25:r0", "give AT:REPLICA:SPEED"), ("-1:r0:0.5", "the time must be >= 0"),
    ("25:gpu0:0.5", "an index such as 2 or r2"), ("25:r0:0", "must be > 0"),
    ("25:r9:0.5", "names replica r9, but a fleet of 3 has r0 to r2"),
    ("25:r0:1e-9", "a speed change's speed must be a number from 0.001"),
])
def test_a_bad_speed_change_is_refused_naming_what_to_give(
        flag: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each malformed --speed-change is a one-line error saying what to change."""
    try:
        code = main(["simulate", "--scenario", "belgavi", "--scale", "0.05", "--policy",
                     "round_robin", "--replicas", "3", f"--speed-change={flag}"])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code in (1, 2)
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
