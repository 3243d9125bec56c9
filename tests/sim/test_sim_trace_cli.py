"""Trace parsing (and its errors), the bounds, and the two CLI commands."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest

from kvreuse.cli.main import main
from kvreuse.errors import InputFormatError
from kvreuse.routing import DEFAULT_POLICY, build_policy
from kvreuse.sim import FleetConfig, FleetSimulator, ReplicaConfig, summarize
from kvreuse.sim.requests import SimRequest
from kvreuse.sim.trace import compute_bounds
from kvreuse.tokens import TOKEN_BYTES
from kvreuse.trace import parse_trace_lines, trace_requests

TRACE = Path(__file__).resolve().parents[2] / "../shared/data/mooncake_synthetic_trace.jsonl"
needs_trace = pytest.mark.skipif(not TRACE.exists(), reason="shared Mooncake trace not present")

GOOD = '{"timestamp": 5, "input_length": 1000, "output_length": 3, "hash_ids": [7, 8]}'


def parse_trace(lines: list[str], source: str = "trace") -> list[SimRequest]:
    """Token-granular requests: each id expanded into its 512 tokens."""
    return trace_requests(parse_trace_lines(lines, source), 512, "token", source)[0]


def head(n: int) -> list[str]:
    with TRACE.open() as lines:
        return list(islice(lines, n))


def test_blocks_become_shared_prefixes() -> None:
    """Two prompts sharing their first hash id share exactly that block's tokens."""
    lines = [GOOD, GOOD.replace("[7, 8]", "[7, 9]").replace('"timestamp": 5', '"timestamp": 9')]
    a, b = parse_trace(lines)
    assert a.prompt_len == 1000 and len(a.tokens) == 1000 * TOKEN_BYTES
    assert a.tokens[: 512 * 4] == b.tokens[: 512 * 4] and a.tokens[512 * 4] != b.tokens[512 * 4]
    assert b.arrival_s == pytest.approx(0.009)


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("{not json", "not valid JSON"),
        ('{"input_length": 1000, "output_length": 3, "hash_ids": [7, 8]}', "timestamp"),
        (GOOD.replace('"input_length": 1000', '"input_length": "1000"'), "input_length"),
        (GOOD.replace('"output_length": 3', '"output_length": -1'), "output_length"),
        (GOOD.replace("[7, 8]", "[7]"), "hash_ids"),
        (GOOD.replace("[7, 8]", '[7, "x"]'), "hash_ids"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_lines_name_line_and_field(line: str, field: str) -> None:
    """A malformed line raises InputFormatError naming the line number and the field."""
    with pytest.raises(InputFormatError) as err:
        parse_trace([GOOD, "", line], source="t.jsonl")
    assert "t.jsonl:3" in str(err.value) and field in str(err.value)


@needs_trace
def test_real_trace_bounds_dominate_every_policy() -> None:
    """The infinite cache is a ceiling over pooled LRU and every router (first 600 requests).
    Pooled LRU is only a reference: routers may beat it (belgavi does, see
    tests/cli/test_simulate_output.py), so nothing is asserted between them."""
    requests = parse_trace(head(600))
    bounds = compute_bounds(requests, 4, 200_000)
    assert bounds.infinite_hit_rate >= bounds.pooled_lru_hit_rate > 0
    for name in ("round_robin", "cache_aware"):
        config = FleetConfig(4, ReplicaConfig(pool_tokens=200_000))
        rate = summarize(FleetSimulator(config, build_policy(name)).run(requests)).token_hit_rate
        assert rate <= bounds.infinite_hit_rate + 1e-9


def test_scenarios_command_lists_every_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvreuse scenarios` prints one row per scenario."""
    assert main(["scenarios"]) == 0
    out = capsys.readouterr().out
    for name in ("six-turn", "belgavi", "contract-library", "mission-4"):
        assert name in out


def test_simulate_json_has_the_issue_schema(tmp_path: Path) -> None:
    """--json writes scenario, seed, parameters, runs (with every field) and bounds (the widest
    fleet's, and one per fleet size)."""
    out = tmp_path / "r.json"
    assert main(["simulate", "--scenario", "six-turn", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"scenario", "seed", "parameters", "runs", "bounds", "bounds_by_replicas"}
    fields = {"policy", "replicas", "token_hit_rate", "request_hit_rate", "prefill_gpu_s_per_1k",
              "ttft_p50_s", "ttft_p95_s", "max_over_mean_load", "evicted_tokens", "requests"}
    assert all(fields <= set(run) for run in data["runs"])
    assert {"infinite_hit_rate", "pooled_lru_hit_rate"} <= set(data["bounds"])
    assert data["runs"][1]["token_hit_rate"] == pytest.approx(1 - 2400 / 15900)


def test_simulate_policy_and_replica_overrides(tmp_path: Path) -> None:
    """--policy and --replicas replace the scenario's runs by their cross product."""
    out = tmp_path / "r.json"
    args = ["simulate", "--scenario", "belgavi", "--policy", "round_robin,prefix_hash",
            "--replicas", "2,3", "--scale", "0.1", "--json", str(out)]
    assert main(args) == 0
    runs = json.loads(out.read_text())["runs"]
    pairs = {(r["policy"], r["replicas"], r["variant"]) for r in runs}
    assert ("prefix_hash", 2, "no_cache") in pairs and ("round_robin", 3, "") in pairs
    assert len(runs) == 8


def test_simulate_rejects_unknown_policy(capsys: pytest.CaptureFixture[str]) -> None:
    """A bad --policy exits 1 with the valid choices."""
    assert main(["simulate", "--scenario", "belgavi", "--policy", "nope"]) == 1
    assert "round_robin" in capsys.readouterr().err


def test_simulate_trace_with_report(tmp_path: Path) -> None:
    """--trace replays a file; --report writes an HTML page with embedded PNG plots, among
    them relative_spill's hit rate / p95 curve over its slack."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(head(150) if TRACE.exists() else [GOOD]) + "\n")
    report = tmp_path / "r.html"
    out = tmp_path / "r.json"
    args = ["simulate", "--trace", str(trace), "--replicas", "2", "--cache-tokens", "200000",
            "--policy", "round_robin,cache_aware", "--json", str(out), "--report", str(report)]
    assert main(args) == 0
    page = report.read_text()
    assert page.count("data:image/png;base64,") == 6
    assert "relative_spill: hit rate vs p95 TTFT as slack varies" in page
    assert json.loads(out.read_text())["bounds"]["replicas"] == 2


def test_simulate_trace_runs_round_robin_and_the_default_policy(tmp_path: Path) -> None:
    """Without --policy a trace replay compares round robin with the default policy,
    relative_spill, each with its no-cache baseline."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(head(60) if TRACE.exists() else [GOOD]) + "\n")
    out = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(trace), "--replicas", "2",
                 "--cache-tokens", "200000", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert DEFAULT_POLICY == "relative_spill"
    assert {(r["policy"], r["variant"]) for r in runs} == {
        ("round_robin", ""), ("relative_spill", ""),
        ("round_robin", "no_cache"), ("relative_spill", "no_cache")}


def test_simulate_trace_needs_cache_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--trace without --cache-tokens is an error that names the flag."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD + "\n")
    assert main(["simulate", "--trace", str(trace)]) == 1
    assert "--cache-tokens" in capsys.readouterr().err


def test_simulate_trace_bad_line_exits_with_its_location(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad trace line is reported with file, line and field."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD + "\n" + GOOD.replace("[7, 8]", "[7]") + "\n")
    assert main(["simulate", "--trace", str(trace), "--cache-tokens", "5000"]) == 1
    err = capsys.readouterr().err
    assert "t.jsonl:2" in err and "hash_ids" in err


def test_scenario_report_links_each_run_to_the_lab(tmp_path: Path) -> None:
    """A belgavi report links each run to the lab view of the same run."""
    report = tmp_path / "b.html"
    args = ["simulate", "--scenario", "belgavi", "--policy", "cache_aware", "--replicas", "3",
            "--scale", "0.2", "--report", str(report)]
    assert main(args) == 0
    page = report.read_text()
    assert "open in lab" in page
    assert "http://127.0.0.1:8765/?routing=cache_aware&amp;replicas=3" in page


def test_trace_report_has_no_lab_link(tmp_path: Path) -> None:
    """Trace runs cannot be shown in the lab, so their rows say so instead of linking."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD + "\n")
    report = tmp_path / "r.html"
    args = ["simulate", "--trace", str(trace), "--replicas", "1", "--cache-tokens", "100000",
            "--policy", "round_robin", "--report", str(report)]
    assert main(args) == 0
    assert "open in lab" not in report.read_text()
