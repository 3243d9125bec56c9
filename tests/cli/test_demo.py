"""`kvreuse demo`: the six-turn table through both indexes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvreuse.cli.main import main
from kvreuse.six_turn import ChatShape, run_six_turn


def test_six_turn_totals_match_the_seed() -> None:
    """15,900 prefill tokens without cache, 2,400 with the radix tree (seed 001)."""
    result = run_six_turn()
    assert [r.prompt_tokens for r in result.rows] == [1650, 2050, 2450, 2850, 3250, 3650]
    assert result.total_prompt_tokens == 15_900
    assert result.total_radix_prefilled == 2_400


def test_block_index_recomputes_partial_blocks() -> None:
    """With 16-token blocks each warm turn recomputes its 12-token partial block too."""
    result = run_six_turn()
    assert [r.block_prefilled for r in result.rows] == [1650, 162, 162, 162, 162, 162]


def test_block_size_one_equals_radix_except_last_token_rule() -> None:
    """With 1-token blocks the block index matches the radix tree on this chat."""
    result = run_six_turn(ChatShape(block_size=1))
    assert [r.block_prefilled for r in result.rows] == [r.radix_prefilled for r in result.rows]


def test_demo_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints the rows and totals."""
    assert main(["demo", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["total_prompt_tokens"] == 15_900
    assert data["total_radix_prefilled"] == 2_400
    assert len(data["rows"]) == 6


def test_demo_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    """The default output is a table with the totals."""
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "15,900" in out and "2,400" in out


def test_demo_rejects_non_positive_sizes() -> None:
    """A zero block size is a usage error naming the flag."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvreuse.cli.main", "demo", "--block-size", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert "--block-size" in proc.stderr and ">= 1" in proc.stderr
