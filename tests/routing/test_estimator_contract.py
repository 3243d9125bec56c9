"""The cache-estimator contract: every estimator honours it, the registry builds it from a
policy's options, and policies route on it exactly as they did when each chose its own."""

from __future__ import annotations

import hashlib
import random

import pytest

from kvreuse.errors import ConfigError
from kvreuse.gateway.shared_index import SharedPrefixIndex
from kvreuse.routing import (
    POLICIES,
    ApproxTrees,
    CacheEstimator,
    CacheMirror,
    EstimatorPolicy,
    KvStored,
    RequestView,
    build_estimator,
    build_policy,
)
from kvreuse.sim import FleetSimulator
from kvreuse.sim.scenarios import get_scenario
from kvreuse.tokens import pack

ESTIMATORS = {
    "approx": ApproxTrees,
    "exact": lambda: CacheMirror(block_size=4),
    "shared": lambda: SharedPrefixIndex(block_size=4),
}


def view(tokens: list[int]) -> RequestView:
    return RequestView("q", pack(tokens), len(tokens))


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_every_estimator_honours_the_contract(kind: str) -> None:
    """Each estimator is a CacheEstimator, learns from the hook its uses_kv_events names and
    ignores the other, and sizes what it learned consistently."""
    estimator = ESTIMATORS[kind]()
    assert isinstance(estimator, CacheEstimator)
    routed, published = list(range(40)), list(range(100, 140))
    estimator.record(view(routed), "r0", 1.0)
    estimator.apply(KvStored("r1", pack(published)))
    predicted = {
        "routed": estimator.predict(view(routed), ("r0", "r1"), 2.0),
        "published": estimator.predict(view(published), ("r0", "r1"), 2.0),
    }
    if estimator.uses_kv_events:
        assert predicted == {"routed": {"r0": 0, "r1": 0}, "published": {"r0": 0, "r1": 40}}
        learner = "r1"
    else:
        assert predicted == {"routed": {"r0": 40, "r1": 0}, "published": {"r0": 0, "r1": 0}}
        learner = "r0"
    assert estimator.tree_tokens(learner) == 40
    unit = 1 if isinstance(estimator, ApproxTrees) else 4
    assert estimator.cached_blocks(learner) == 40 // unit
    assert estimator.tree_tokens("r9") == estimator.cached_blocks("r9") == 0
    estimator.check_invariants()


def test_the_registry_builds_the_estimator_a_policy_names() -> None:
    """Each policy's default kind, and the kind and options given, make its estimator; the
    policy's uses_kv_events follows it."""
    for name, factory in POLICIES.items():
        policy = build_policy(name)
        if not getattr(factory, "estimator_options", ()):
            continue
        assert isinstance(policy, EstimatorPolicy)
        default = {"exact": CacheMirror, "approx": ApproxTrees}[factory.default_estimator]
        assert type(policy.estimator) is default, name
        assert policy.uses_kv_events == (default is CacheMirror), name
        exact = build_policy(name, estimator="exact", block_size=8)
        assert isinstance(exact, EstimatorPolicy) and exact.uses_kv_events, name
        assert isinstance(exact.estimator, CacheMirror) and exact.estimator.block_size == 8
    capped = build_policy("relative_spill", estimator="approx", tree_capacity_tokens=99)
    assert isinstance(capped, EstimatorPolicy) and isinstance(capped.estimator, ApproxTrees)
    assert capped.estimator.capacity_of("r0") == 99
    assert build_policy("relative_spill").estimator.capacity_of("r0") is None  # type: ignore[attr-defined]
    assert exact.estimator.capacity_of("r0") is None  # a mirror holds what events say
    assert SharedPrefixIndex(block_size=4, capacity_blocks=10).capacity_of("u0") == 40


def test_an_estimator_object_goes_to_the_policy_as_is() -> None:
    """A caller-built estimator (a shared index) is the policy's, not a copy."""
    index = SharedPrefixIndex(block_size=4)
    policy = build_policy("cost", estimator=index)
    assert isinstance(policy, EstimatorPolicy) and policy.estimator is index
    assert not policy.uses_kv_events


def test_estimator_options_a_policy_does_not_list_are_refused() -> None:
    """relative_spill's trees take no eviction interval; dynamo_kv's no capacity; an unknown
    kind is named."""
    with pytest.raises(ConfigError, match="eviction_interval_s"):
        build_policy("relative_spill", eviction_interval_s=10.0)
    with pytest.raises(ConfigError, match="tree_capacity_tokens"):
        build_policy("dynamo_kv", tree_capacity_tokens=100)
    with pytest.raises(ConfigError, match="'approx' or 'exact'"):
        build_estimator("psychic")


# (policy, estimator) -> digest of a seeded belgavi run (3 replicas, 4-token blocks), recorded
# with the code before the contract (e88488f), where each policy built its own estimator from
# a string and a shared index was swapped in through the policy's ``trees``.
BEFORE = {
    ("cache_aware", "approx"): "50b73f7e8bd03e34",
    ("cache_aware", "exact"): "7d2f5cab96f106e8",
    ("cache_aware", "shared"): "7a2268f34f0ad918",
    ("cache_aware_sglang", "approx"): "92d7e7ef6295e066",
    ("cache_aware_sglang", "exact"): "5cca6ec8dd873e15",
    ("cache_aware_sglang", "shared"): "2705c83161cfae52",
    ("exact", "exact"): "7d2f5cab96f106e8",
    ("cost", "approx"): "88e78e652d82266b",
    ("cost", "exact"): "a9dbf67d61b45d45",
    ("dynamo_kv", "approx"): "fab80d75fce57c34",
    ("dynamo_kv", "exact"): "d008ca2299579c95",
}


@pytest.mark.parametrize(("name", "kind"), sorted(BEFORE))
def test_registry_built_policies_route_as_before(name: str, kind: str) -> None:
    """Every decision of a seeded simulation is what the same policy and estimator made
    before the estimator became an object the registry builds."""
    scenario = get_scenario("belgavi")
    estimator: object = SharedPrefixIndex(block_size=4) if kind == "shared" else kind
    policy = build_policy(name, rng=random.Random(0), estimator=estimator, block_size=4)
    run = FleetSimulator(scenario.fleet(3, ""), policy).run(scenario.requests(0, "", 0.1))
    state = (run.records, run.evicted_tokens, run.requests_per_replica)
    assert hashlib.sha256(repr(state).encode()).hexdigest()[:16] == BEFORE[(name, kind)]
