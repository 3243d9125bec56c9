"""Policies that learned a fleet's caches pickle and copy into policies that predict alike."""

from __future__ import annotations

import copy
import pickle
import random
from collections.abc import Callable

import pytest

from kvreuse.routing import RoutingPolicy, build_policy
from kvreuse.sim import FleetSimulator
from kvreuse.sim.scenarios import get_scenario

ROUND_TRIPS: dict[str, Callable[[RoutingPolicy], RoutingPolicy]] = {
    "pickle": lambda policy: pickle.loads(pickle.dumps(policy)),
    "deepcopy": copy.deepcopy,
}


@pytest.mark.parametrize("how", sorted(ROUND_TRIPS))
@pytest.mark.parametrize("name", ["cache_aware", "cache_aware_sglang", "exact"])
def test_a_trained_policy_copy_predicts_like_the_original(name: str, how: str) -> None:
    """After a belgavi run, the copy's per-replica predictions equal the original's."""
    scenario = get_scenario("belgavi")
    requests = scenario.requests(0, "", 0.1)
    policy = build_policy(name, rng=random.Random(0), **scenario.policy_options.get(name, {}))
    sim = FleetSimulator(scenario.fleet(3, ""), policy)
    sim.run(requests)
    twin = ROUND_TRIPS[how](policy)
    view = sim.fleet_view(sim.loop.now)
    predicted = [policy.predict(r.view, view) for r in requests[-50:]]  # type: ignore[attr-defined]
    assert any(sum(p.values()) for p in predicted)
    assert [twin.predict(r.view, view) for r in requests[-50:]] == predicted  # type: ignore[attr-defined]
