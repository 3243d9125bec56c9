"""benchmarks/prefill_speed.py at a tiny size: both gateways run through the real CLI."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "prefill_speed.py"


def test_a_tiny_run_prints_a_measuring_and_a_fixed_row(
        bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """One repeat: the measuring gateway reports a measured speed, the fixed one the default."""
    assert bench.main(["--repeats", "1", "--warmup", "8", "--burst", "6",
                       "--burst-rate", "50", "--prefix-tokens", "200"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith(("| measuring", "| --fixed-prefill"))]
    assert len(rows) == 2, rows
    assert "(measured)" in rows[0] and "(assumed)" in rows[1], rows
    # Six burst requests placed, whichever engines took them.
    for row in rows:
        placed = row.split("|")[3]
        assert sum(int(n) for n in placed.split(",")) == 6, row


def test_the_prompt_text_has_the_asked_token_count(bench: ModuleType) -> None:
    """text_of makes exactly 4 bytes a token, as the engines count."""
    assert len(bench.text_of(137, "seed")) == 4 * 137
