"""What the `kvreuse plan` tests share: a small grid, synthetic traces, a plan run here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvreuse.cli.main import main
from kvreuse.testing.mooncake import synthetic_mooncake

GRID = ["--policy", "round_robin,cache_aware", "--replicas", "1,2", "--cache-tokens",
        "60000,200000", "--knob", "0.2,1.0", "--slo", "ttft_p95=0.6"]


def write_trace(tmp_path_factory: pytest.TempPathFactory, requests: int) -> Path:
    """A synthetic Mooncake trace of ``requests`` requests (3 a second, 10 documents)."""
    path = tmp_path_factory.mktemp("plan") / "t.jsonl"
    lines = synthetic_mooncake(requests=requests, requests_per_second=3.0, documents=10)
    path.write_text("\n".join(lines) + "\n")
    return path


def plan(trace: Path, out: Path, *extra: str) -> dict[str, Any]:
    """`kvreuse plan` over ``trace`` and :data:`GRID`, which must exit 0; its ``--json``."""
    assert main(["plan", "--trace", str(trace), *GRID, "--json", str(out), *extra]) == 0
    data: dict[str, Any] = json.loads(out.read_text())
    return data
