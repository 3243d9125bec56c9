"""benchmarks/requests_of_death.py at a small size: what its kvreuse rows claim holds."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import ModuleType

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "requests_of_death.py"


def test_a_request_of_death_costs_other_clients_nothing_through_kvreuse(
        bench: ModuleType, tmp_path: Path) -> None:
    """On a quiet fleet (where each peer opened every circuit), an SDK call with the same
    request of death every 0.3 s fails no ordinary request, and the request of death reaches
    the three upstreams once each whatever the number of calls."""
    args = argparse.Namespace(seconds=4.0, attack_at=0.5, attack_every=0.3)
    outcome = bench.run("kvreuse", 2.0, args, tmp_path)
    assert outcome.ordinary == 8 and outcome.served == 8 and outcome.failed == 0
    assert outcome.attacker_calls >= 5
    assert outcome.reached_upstreams == 3
