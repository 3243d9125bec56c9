"""benchmarks/gateway_stop.py at a small size: what its table claims holds for each row."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import ModuleType

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "gateway_stop.py"


def test_without_a_drain_requests_are_refused_and_with_one_none_are(bench: ModuleType,
                                                                    tmp_path: Path) -> None:
    """A gateway stopped under load refuses the requests the balancer still sends it when it
    closes at once; draining for longer than the balancer takes to move off, it serves
    every one; no stream in flight is cut either way."""
    args = argparse.Namespace(rate=10.0, seconds=2.5, signal_at=0.5, propagation=0.8,
                              long_tokens=30)
    at_once = bench.run(0.0, args, tmp_path)
    drained = bench.run(2.0, args, tmp_path)
    assert sum(at_once.values()) == sum(drained.values()) == 25
    assert at_once["refused"] >= 4 and at_once["cut"] == 0
    assert drained == {"whole": 25, "cut": 0, "refused": 0}
