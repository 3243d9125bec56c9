"""The README's prompt-stability and capacity examples run on examples/ and print what it shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvreuse.cli.main import main
from kvreuse.testing.mooncake import synthetic_mooncake

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "examples"
TEMPLATE = str(EXAMPLES / "prompts" / "qwen2.5-chat-template.jinja")
PROMPT_ARGS = ["--tokenizer", "o200k_base", "--template", TEMPLATE]
CONFIG = str(EXAMPLES / "capacity" / "llama-8b-config.json")


@pytest.fixture(autouse=True)
def _run_from_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def readme_block_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Prompt-stability tools") :]
    return section[section.index("```console") : section.index("```\n\n")].splitlines()


def test_readme_diff_output_is_what_the_command_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """Every line of the README's diff example appears in the real output."""
    code = main([
        "diff", "examples/prompts/unstable-a.json", "examples/prompts/unstable-b.json",
        *PROMPT_ARGS,
    ])
    out = capsys.readouterr().out.splitlines()
    lines = readme_block_lines()
    start = lines.index("shared prefix: 23 tokens")
    assert code == 0
    assert lines[start : start + 8] == out[2:10]


def test_readme_audit_example(capsys: pytest.CaptureFixture[str]) -> None:
    """The logged-request audit finds the timestamp and the tool order, and fails CI."""
    code = main(["audit", "examples/prompts/logged-requests.jsonl", *PROMPT_ARGS])
    out = capsys.readouterr().out.splitlines()
    shown = [line for line in readme_block_lines() if line.startswith("ERROR")]
    assert code == 1
    assert [line for line in out if line.startswith("ERROR")] == shown


def test_stable_examples_pass_audit_and_fixtures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The stable pair has no findings and checks clean against its own golden record."""
    stable = ["examples/prompts/stable-a.json", "examples/prompts/stable-b.json"]
    golden = str(tmp_path / "golden.json")
    assert main(["audit", *stable, *PROMPT_ARGS, "--fail-on", "note"]) == 0
    assert main(["fixtures", "record", *stable, "--golden", golden, *PROMPT_ARGS]) == 0
    assert main(["fixtures", "check", *stable, "--golden", golden, *PROMPT_ARGS,
                 "--rps", "30", "--prefixes", "6", "--replicas", "6"]) == 0
    assert "MISMATCH" not in capsys.readouterr().out


def test_capacity_reproduces_seed_000(capsys: pytest.CaptureFixture[str]) -> None:
    """128 KiB per token, 750 MiB per contract, 33 per replica, 264 per fleet, route by prefix."""
    assert main(["capacity", "--config", CONFIG, "--kv-pool-gib", "40", "--pinned-gib", "15",
                 "--workload", "examples/capacity/contract-library.json"]) == 0
    out = capsys.readouterr().out
    assert "(128 KiB)" in out
    assert "750 MiB prefix" in out
    assert "33 fit one replica's idle cache, 264 fit the fleet of 8" in out
    assert "verdict: route-by-prefix" in out


def test_capacity_json_for_seed_001(capsys: pytest.CaptureFixture[str]) -> None:
    """Open history 25-50 GiB across the fleet; a few GiB per replica cannot hold it."""
    assert main(["capacity", "--config", CONFIG, "--gpu-memory-gib", "24", "--weights-gib", "15",
                 "--pinned-gib", "2", "--workload", "examples/capacity/support-chat.json",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    history = report["hot_set"][1]
    assert 25 * 2**30 <= history["low_bytes"] <= history["high_bytes"] <= 50 * 2**30
    assert report["idle_cache_bytes_per_replica"] < 5 * 2**30
    assert report["verdict"]["decision"] == "add-replicas"


def test_capacity_from_the_example_trace(capsys: pytest.CaptureFixture[str]) -> None:
    """The Mooncake example is the seeded generator's output and sizes to a verdict."""
    example = EXAMPLES / "capacity" / "mooncake-sample.jsonl"
    assert example.read_text().splitlines() == synthetic_mooncake()
    decisions = []
    for pinned in ("15", "30", "39"):
        assert main(["capacity", "--config", CONFIG, "--kv-pool-gib", "40", "--pinned-gib",
                     pinned, "--replicas", "4", "--trace", str(example), "--window", "120",
                     "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["hot_set"][0]["high_tokens"] % 512 == 0
        assert report["hot_high_bytes"] == report["hot_set"][0]["high_tokens"] * 128 * 1024
        decisions.append(report["verdict"]["decision"])
    # 24 GiB hot: fits 25 GiB idle, needs the fleet at 10 GiB, exceeds 4 x 1 GiB.
    assert decisions == ["round-robin", "route-by-prefix", "add-replicas"]


def test_capacity_errors_name_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    """A workload but neither a pool nor GPU memory: exit 1 with the options to give."""
    workload = str(Path(CONFIG).parent / "contract-library.json")
    assert main(["capacity", "--config", CONFIG, "--workload", workload]) == 1
    assert "--kv-pool-gib" in capsys.readouterr().err


def test_capacity_config_alone_prints_the_kv_bytes_per_token(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--config alone: the KV bytes per token it can compute, and which flags add the budget."""
    assert main(["capacity", "--config", CONFIG]) == 0
    out = capsys.readouterr().out
    assert "131,072 bytes (128 KiB)" in out and "--kv-pool-gib" in out
