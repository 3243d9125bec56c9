"""Several models on partly overlapping replicas: policies route on each model's subset."""

from __future__ import annotations

import random

import pytest

from kvreuse.errors import ConfigError
from kvreuse.identity import CacheIdentity
from kvreuse.routing import (
    POLICIES,
    FleetView,
    PolicyBase,
    RequestView,
    RoutingDecision,
    build_policy,
)
from kvreuse.sim import FleetConfig, FleetSimulator, ReplicaConfig
from kvreuse.sim.requests import SimRequest
from kvreuse.sim.runner import run_scenario
from kvreuse.sim.scenario_params import multi_model_serving
from kvreuse.sim.scenarios import get_scenario
from kvreuse.tokens import pack

SCENARIO = get_scenario("multi-model")


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_picks_only_replicas_serving_the_model(policy: str) -> None:
    """Each request of every policy lands on a replica serving its model (from the records,
    not only the simulator's own check)."""
    requests = SCENARIO.requests(0, "", 0.2)
    fleet = SCENARIO.fleet(4, "")
    run = FleetSimulator(fleet, build_policy(policy, rng=random.Random(0))).run(requests)
    assert fleet.models is not None
    served = {requests[r.request_id].identity.model: set() for r in run.records}
    for record in run.records:
        model = requests[record.request_id].identity.model
        assert model in fleet.models[record.replica], (policy, model, record.replica)
        served[model].add(record.replica)
    assert served["model-a"] <= {0, 1, 2} and served["model-b"] <= {2, 3}
    if policy in ("round_robin", "random", "least_load"):  # these spread over the whole set
        assert served == {"model-a": {0, 1, 2}, "model-b": {2, 3}}, served


class OffTheList(PolicyBase):
    """A broken policy: always r0, whatever the view offers."""

    name = "off_the_list"

    def route(self, request: RequestView, fleet: FleetView) -> RoutingDecision | None:
        return RoutingDecision("r0", "broken")


def request(number: int, model: str, tokens: list[int]) -> SimRequest:
    buf = pack(tokens)
    return SimRequest(number, float(number), buf, len(tokens), 4,
                      identity=CacheIdentity(model=model))


def test_a_policy_leaving_the_subset_is_caught() -> None:
    """Routing a model-b request to a replica that only serves model-a breaks an invariant."""
    fleet = FleetConfig(2, ReplicaConfig(pool_tokens=4096), models=(("a",), ("b",)))
    with pytest.raises(AssertionError, match="r0, which does not serve it"):
        FleetSimulator(fleet, OffTheList()).run([request(0, "b", list(range(10)))])


def test_a_model_no_replica_serves_is_a_config_error() -> None:
    """A workload naming a model the fleet does not serve is refused by name."""
    fleet = FleetConfig(2, ReplicaConfig(pool_tokens=4096), models=(("a",), ("a", "b")))
    with pytest.raises(ConfigError, match="model 'c'"):
        FleetSimulator(fleet, build_policy("round_robin")).run([request(0, "c", [1, 2, 3])])


def test_models_must_be_given_per_replica() -> None:
    """A models tuple of the wrong length, or a replica serving nothing, is refused."""
    with pytest.raises(ConfigError, match="one tuple per replica"):
        FleetConfig(3, models=(("a",), ("b",)))
    with pytest.raises(ConfigError, match="at least one model"):
        FleetConfig(2, models=(("a",), ()))


def test_one_replica_keeps_two_models_caches_apart() -> None:
    """The same token ids under two models share nothing on a replica serving both."""
    fleet = FleetConfig(1, ReplicaConfig(pool_tokens=4096), models=(("a", "b"),))
    prompt = list(range(100, 400))
    run = FleetSimulator(fleet, build_policy("exact")).run(
        [request(0, "a", prompt), request(1, "b", prompt), request(2, "a", [*prompt, 7])])
    assert [r.cached_tokens for r in run.records] == [0, 0, 300]


def test_replica_sets_overlap_for_any_fleet_size() -> None:
    """Every size serves both models; from two replicas on, some replica serves both and
    neither model has the whole fleet."""
    for replicas in range(1, 9):
        sets = multi_model_serving(replicas)
        assert len(sets) == replicas and all(sets)
        holders = {m: {i for i, s in enumerate(sets) if m in s} for m in ("model-a", "model-b")}
        assert holders["model-a"] and holders["model-b"]
        if replicas >= 2:
            assert holders["model-a"] & holders["model-b"]
        if replicas >= 3:
            assert len(holders["model-a"]) < replicas and len(holders["model-b"]) < replicas
    assert multi_model_serving(4) == (("model-a",), ("model-a",), ("model-a", "model-b"),
                                      ("model-b",))


def test_prompts_of_both_models_share_token_ids() -> None:
    """The scenario sends the same system prompts to both models (only identity parts them),
    and cache-aware routing still beats round robin by far."""
    requests = SCENARIO.requests(0, "", 0.2)
    heads = {}
    for r in requests:
        heads.setdefault(r.identity.model, set()).add(bytes(r.tokens[:64]))
    assert heads["model-a"] & heads["model-b"]
    rows = {row.spec.policy: row.summary for row in run_scenario(SCENARIO, seed=0, scale=0.3)}
    assert rows["exact"].token_hit_rate > rows["round_robin"].token_hit_rate + 0.15
    assert rows["round_robin"].ttft_p95_s > 5 * rows["exact"].ttft_p95_s
