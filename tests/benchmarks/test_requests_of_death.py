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
    # Five calls at least however slow the host (a loaded CI machine made four in 4 s).
    args = argparse.Namespace(seconds=4.0, attack_at=0.5, attack_every=0.3, min_attacks=5)
    outcome = bench.run("kvreuse", 2.0, args, tmp_path)
    assert outcome.ordinary == 8 and outcome.served == 8 and outcome.failed == 0
    assert outcome.attacker_calls >= 5
    assert outcome.reached_upstreams == 3 and outcome.dead_engines == 0


def test_a_request_that_kills_engines_kills_two_of_three_through_kvreuse(
        bench: ModuleType, tmp_path: Path) -> None:
    """A request of death that kills each engine serving it, under busy ordinary traffic:
    through kvreuse it kills two (then the gateway stops and holds it), and the third serves
    every ordinary request, those the dead two failed included."""
    args = argparse.Namespace(seconds=3.0, attack_at=0.5, attack_every=0.3, min_attacks=0)
    outcome = bench.run("kvreuse", 10.0, args, tmp_path, "killer")
    assert outcome.ordinary == 30 and outcome.failed == 0
    assert outcome.reached_upstreams == 2 and outcome.dead_engines == 2
