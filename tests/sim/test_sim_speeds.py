"""Replicas of different prefill speeds, and what the router knows of them."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest

from kvreuse.errors import ConfigError
from kvreuse.identity import CacheIdentity
from kvreuse.routing import RequestView, build_policy
from kvreuse.sim import FleetConfig, FleetSimulator, ReplicaConfig, SimRequest
from kvreuse.sim.scenarios import get_scenario
from kvreuse.sim.summary import prefill_cost_s, summarize
from kvreuse.tokens import pack

REPLICA = ReplicaConfig(pool_tokens=1_000_000, prefill_tokens_per_s=10_000.0, overhead_s=0.01,
                        time_per_output_token_s=0.0)


def unique_requests(count: int, every_s: float, tokens: int = 1000,
                    model: str = "") -> list[SimRequest]:
    """``count`` requests of ``tokens`` unique tokens each, ``every_s`` apart."""
    identity = CacheIdentity(model=model)
    return [SimRequest(i, i * every_s, pack(range(i * tokens, (i + 1) * tokens)), tokens, 1,
                       identity=identity)
            for i in range(count)]


class LoadWatcher:
    """Wraps a policy and notes every candidate's load at each arrival."""

    def __init__(self, name: str = "round_robin") -> None:
        self.inner = build_policy(name, rng=random.Random(0))
        self.loads: list[Any] = []

    def route(self, request: RequestView, fleet: Any) -> Any:
        self.loads.append(fleet.replicas)
        return self.inner.route(request, fleet)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_slow_replica_prefills_at_its_multiple_of_the_rate() -> None:
    """At speed 0.25, 1,000 tokens take 0.4 s after the overhead instead of 0.1 s."""
    config = FleetConfig(2, REPLICA, prefill_speeds=(0.25, 1.0))
    run = FleetSimulator(config, build_policy("round_robin")).run(unique_requests(2, 1.0))
    assert [r.replica for r in run.records] == [0, 1]
    assert [r.ttft_s for r in run.records] == pytest.approx([0.41, 0.11])


@pytest.mark.parametrize("speeds", [(1.0,), (1.0, 1.0, 1.0), (1.0, 0.0), (1.0, -1.0),
                                    (1.0, float("nan")), (1.0, float("inf")), (1.0, 1e-320),
                                    (1.0, 1e4)])
def test_speeds_must_be_one_positive_number_per_replica(speeds: tuple[float, ...]) -> None:
    """The error says what to give."""
    with pytest.raises(ConfigError, match="prefill_speeds"):
        FleetConfig(2, REPLICA, prefill_speeds=speeds)


def test_an_unknown_speed_view_is_a_config_error() -> None:
    """The error names the choices."""
    with pytest.raises(ConfigError, match="speed_view must be one of"):
        FleetConfig(2, REPLICA, speed_view="guessed")


def test_a_known_speed_divides_the_load_the_router_sees() -> None:
    """The slow replica's queue shows as four times its tokens and carries its speed, as an
    upstream declared with weight=0.25 does in the gateway."""
    config = FleetConfig(2, REPLICA, prefill_speeds=(0.25, 1.0), speed_view="known")
    watcher = LoadWatcher()
    # Two requests at once on each replica: the second arrivals see the first still queued.
    requests = [SimRequest(i, 0.0, pack(range(i * 1000, i * 1000 + 1000)), 1000, 1)
                for i in range(3)]
    FleetSimulator(config, watcher).run(requests)  # type: ignore[arg-type]
    slow, fast = watcher.loads[2]
    assert (slow.queued_prefill_tokens, slow.queued_requests, slow.prefill_speed) == (
        4000, 4, 0.25)
    assert (fast.queued_prefill_tokens, fast.prefill_speed) == (1000, 1.0)


def test_the_alike_view_shows_loads_as_counted() -> None:
    """With speed_view alike the router sees every replica at speed 1 (--fixed-prefill)."""
    config = FleetConfig(2, REPLICA, prefill_speeds=(0.25, 1.0), speed_view="alike")
    watcher = LoadWatcher()
    requests = [SimRequest(i, 0.0, pack(range(i * 1000, i * 1000 + 1000)), 1000, 1)
                for i in range(3)]
    simulator = FleetSimulator(config, watcher)  # type: ignore[arg-type]
    simulator.run(requests)
    slow, _ = watcher.loads[2]
    assert (slow.queued_prefill_tokens, slow.prefill_speed) == (1000, 1.0)
    assert simulator.measured_speeds() == {"r0": 1.0, "r1": 1.0}


@pytest.mark.parametrize("load_view", ["replica", "router"])
def test_a_measuring_router_finds_the_slow_replica(load_view: str) -> None:
    """Round robin over a replica at 0.25 and one at 1: after 100 answers the speeds the
    router measured stand within 25 % of 0.25 to each other."""
    lag = 0.002 if load_view == "router" else 0.0
    config = FleetConfig(2, REPLICA, prefill_speeds=(0.25, 1.0), load_view=load_view,
                         first_byte_lag_s=lag)
    simulator = FleetSimulator(config, build_policy("round_robin"))
    simulator.run(unique_requests(100, 0.3))
    speeds = simulator.measured_speeds()
    assert speeds["r0"] / speeds["r1"] == pytest.approx(0.25, rel=0.25)
    assert speeds["r0"] * speeds["r1"] == pytest.approx(1.0)  # centred: geometric mean 1


def test_each_model_measures_its_own_replicas() -> None:
    """Two models on disjoint replicas: each model's pair is measured against itself, so
    the fast replica of the slow pair is not dragged down by the other model's replicas."""
    config = FleetConfig(4, REPLICA, prefill_speeds=(0.25, 1.0, 0.25, 0.25),
                         models=(("a",), ("a",), ("b",), ("b",)))
    requests = sorted(unique_requests(60, 0.6, model="a")
                      + [SimRequest(1000 + r.request_id, r.arrival_s + 0.3, r.tokens,
                                    r.prompt_len, 1, identity=CacheIdentity(model="b"))
                         for r in unique_requests(60, 0.6, model="b")],
                      key=lambda r: r.arrival_s)
    simulator = FleetSimulator(config, build_policy("random", rng=random.Random(1)))
    simulator.run(requests)
    speeds = simulator.measured_speeds("a")
    assert speeds["r0"] / speeds["r1"] == pytest.approx(0.25, rel=0.25)
    speeds = simulator.measured_speeds("b")
    assert speeds["r2"] == pytest.approx(1.0, rel=0.1)  # alike within model b
    assert speeds["r3"] == pytest.approx(1.0, rel=0.1)
    # Model b never timed them: they read as its fastest timed replica.
    assert speeds["r0"] == speeds["r1"] == max(speeds["r2"], speeds["r3"])


def test_a_replica_of_two_models_is_seen_at_each_model_s_speed() -> None:
    """r1 serves a (beside a slow r0) and b (beside a fast r2): a's requests see it faster
    than average, b's see it average, and each model's loads carry its own speeds."""
    config = FleetConfig(3, REPLICA, prefill_speeds=(0.25, 1.0, 1.0),
                         models=(("a",), ("a", "b"), ("b",)))
    requests = sorted(unique_requests(80, 0.6, model="a")
                      + [SimRequest(1000 + r.request_id, r.arrival_s + 0.3, r.tokens,
                                    r.prompt_len, 1, identity=CacheIdentity(model="b"))
                         for r in unique_requests(80, 0.6, model="b")],
                      key=lambda r: r.arrival_s)
    watcher = LoadWatcher("random")
    simulator = FleetSimulator(config, watcher)  # type: ignore[arg-type]
    simulator.run(requests)
    assert simulator.measured_speeds("a")["r1"] > 1.5
    assert simulator.measured_speeds("b")["r1"] == pytest.approx(1.0, rel=0.1)
    last_a = next(loads for loads in reversed(watcher.loads) if loads[0].replica_id == "r0")
    last_b = next(loads for loads in reversed(watcher.loads) if loads[0].replica_id == "r1")
    assert {load.replica_id: load.prefill_speed > 1.5 for load in last_a} == {
        "r0": False, "r1": True}
    assert last_b[0].prefill_speed == pytest.approx(1.0, rel=0.1)


@pytest.mark.parametrize("view", ["known", "measured"])
def test_a_router_that_knows_sends_the_slow_replica_less(view: str) -> None:
    """least_load on uniform unique prompts: knowing (or measuring) the slow replica's speed,
    it sends it fewer requests than seeing it as alike, and the p95 wait drops."""
    requests = unique_requests(400, 0.05)
    served, waits = {}, {}
    for seen in ("alike", view):
        config = FleetConfig(3, REPLICA, prefill_speeds=(0.25, 1.0, 1.0), speed_view=seen)
        run = FleetSimulator(config, build_policy("least_load")).run(requests)
        served[seen] = run.requests_per_replica[0]
        waits[seen] = sorted(r.ttft_s for r in run.records)[int(0.95 * len(run.records))]
    assert served[view] < served["alike"]
    assert waits[view] < waits["alike"]


def test_a_fast_replica_timed_after_the_slow_one_is_sent_its_share() -> None:
    """Multi-model, r0 at a quarter speed, the default measuring (seed 0): model a's fast
    replicas, timed after the slow one, are assumed fast until timed, and the run is as good
    as with the true speeds. Assumed at the timed replicas' mean instead, r2 took no model-a
    request for 53 s and the p95 was 38 s against 4.8 s."""
    scenario = get_scenario("multi-model")
    requests = scenario.requests(0, "", 1.0)
    options = dict(scenario.policy_options.get("relative_spill", {}))
    summaries = {}
    for view in ("known", "measured"):
        config = replace(scenario.fleet(4, ""), prefill_speeds=(0.25, 1.0, 1.0, 1.0),
                         speed_view=view)
        policy = build_policy("relative_spill", rng=random.Random(0), **options)
        summaries[view] = summarize(FleetSimulator(config, policy).run(requests), view)
    known, measured = summaries["known"], summaries["measured"]
    assert measured.token_hit_rate >= known.token_hit_rate - 0.01, (measured, known)
    assert measured.ttft_p95_s <= 2 * known.ttft_p95_s, (measured, known)


def test_a_fleet_of_speed_one_runs_as_before() -> None:
    """Speeds of 1 seen alike give the very run of a fleet without speeds (belgavi, the
    default policy, seeded): the old configurations stay bit-identical."""
    scenario = get_scenario("belgavi")
    requests = scenario.requests(0, "", 0.2)
    base = scenario.fleet(3, "")
    runs = []
    for config in (base, FleetConfig(3, base.replica, prefill_speeds=(1.0, 1.0, 1.0),
                                     speed_view="alike", kv_event_lag_s=base.kv_event_lag_s)):
        policy = build_policy("relative_spill", rng=random.Random(0))
        runs.append(FleetSimulator(config, policy).run(requests).records)
    assert runs[0] == runs[1]


def test_prefill_time_is_counted_at_each_replica_s_speed() -> None:
    """A request's prefill GPU-seconds in the summary are the time its replica took, so they
    add up to each replica's busy time."""
    config = FleetConfig(2, REPLICA, prefill_speeds=(0.25, 1.0))
    run = FleetSimulator(config, build_policy("round_robin")).run(unique_requests(2, 1.0))
    assert [prefill_cost_s(run, r) for r in run.records] == pytest.approx([0.41, 0.11])
    assert [prefill_cost_s(run, r) for r in run.records] == pytest.approx(run.prefill_busy_s)


# ---------------------------------------------------------------------------- speed changes


@pytest.mark.parametrize("changes", [((1.0, 0),), ((-1.0, 0, 0.5),), ((float("inf"), 0, 0.5),),
                                     ((1.0, 2, 0.5),), ((1.0, -1, 0.5),), ((1.0, 0, 0.0),),
                                     ((1.0, 0, float("nan")),), ((1.0, "r0", 0.5),)])
def test_a_malformed_speed_change_is_a_config_error(changes: Any) -> None:
    """Each change must be (seconds >= 0, a replica's index, a speed within bounds)."""
    with pytest.raises(ConfigError, match="speed change"):
        FleetConfig(2, REPLICA, speed_changes=changes)


def test_a_speed_change_applies_to_prefills_started_from_its_time() -> None:
    """r0 throttled to a quarter at 1 s: a prompt there before it takes 0.11 s, one after it
    0.41 s; back at 1 from 3 s, 0.11 s again."""
    config = FleetConfig(1, REPLICA, speed_changes=((1.0, 0, 0.25), (3.0, 0, 1.0)))
    run = FleetSimulator(config, build_policy("round_robin")).run(unique_requests(3, 2.0))
    assert [r.ttft_s for r in run.records] == pytest.approx([0.11, 0.41, 0.11])


def test_a_prefill_in_progress_keeps_its_speed() -> None:
    """A change halfway through a prefill leaves it at its speed; the next one takes the new."""
    config = FleetConfig(1, REPLICA, speed_changes=((0.05, 0, 0.25),))
    requests = [SimRequest(i, at, pack(range(i * 1000, i * 1000 + 1000)), 1000, 1)
                for i, at in enumerate((0.0, 0.0, 1.0))]
    run = FleetSimulator(config, build_policy("round_robin")).run(requests)
    assert [r.ttft_s for r in run.records] == pytest.approx([0.11, 0.11 + 0.41, 0.41])


def test_prefill_time_follows_the_speed_each_prefill_ran_at() -> None:
    """With changes, each request's prefill seconds in the summary are the time it took, and
    they add up to each replica's busy time."""
    config = FleetConfig(2, REPLICA, speed_changes=((2.0, 0, 0.25), (5.0, 1, 0.5)))
    run = FleetSimulator(config, build_policy("round_robin")).run(unique_requests(8, 1.0))
    costs = [prefill_cost_s(run, r) for r in run.records]
    assert costs[:4] == pytest.approx([0.11, 0.11, 0.41, 0.11])
    assert costs[5] == pytest.approx(0.21)  # r1 at half speed from 5 s
    per_replica = [sum(c for c, r in zip(costs, run.records, strict=True) if r.replica == i)
                   for i in range(2)]
    assert per_replica == pytest.approx(run.prefill_busy_s)


def test_a_known_view_is_told_each_change_at_once() -> None:
    """The router knowing the speeds sees r0's load at 0.25 from the change's instant."""
    config = FleetConfig(2, REPLICA, speed_changes=((1.0, 0, 0.25),), speed_view="known")
    watcher = LoadWatcher()
    FleetSimulator(config, watcher).run(unique_requests(4, 0.6))  # type: ignore[arg-type]
    assert [loads[0].prefill_speed for loads in watcher.loads] == [1.0, 1.0, 0.25, 0.25]


@pytest.mark.parametrize("load_view", ["replica", "router"])
def test_a_measuring_router_follows_a_throttle_and_a_recovery(load_view: str) -> None:
    """least_load on unique prompts, r0 at a quarter speed from 20 s to 40 s: the measured
    ratio falls under 0.4 while throttled and is back within 25 % of 1 by the end."""
    lags = {"first_byte_lag_s": 0.002} if load_view == "router" else {}
    config = FleetConfig(2, REPLICA, speed_changes=((20.0, 0, 0.25), (40.0, 0, 1.0)),
                         load_view=load_view, **lags)  # type: ignore[arg-type]
    simulator = FleetSimulator(config, build_policy("least_load"))
    ratios: list[tuple[float, float]] = []
    timed = simulator._first_token

    def watch(job: Any, index: int, now: float) -> None:
        timed(job, index, now)
        speeds = simulator.measured_speeds()
        ratios.append((now, speeds["r0"] / speeds["r1"]))

    for replica in simulator.replicas:
        replica._on_first_token = watch
    simulator.run(unique_requests(600, 0.1))
    throttled = [ratio for now, ratio in ratios if 35.0 <= now < 40.0]
    assert throttled and max(throttled) < 0.4, throttled
    assert ratios[-1][1] == pytest.approx(1.0, rel=0.25), ratios[-10:]


def test_changes_after_the_last_arrival_never_run() -> None:
    """A change after the last arrival (here while the last request is still prefilled) leaves
    the run, its end time included, as without it."""
    requests = unique_requests(20, 0.5)
    runs = [FleetSimulator(FleetConfig(2, REPLICA, speed_changes=changes),
                           build_policy("round_robin")).run(requests)
            for changes in ((), ((1e9, 0, 0.25),))]
    assert runs[0].records == runs[1].records
    assert runs[0].end_time_s == runs[1].end_time_s
    assert runs[0].prefill_s_by_request is None and runs[1].prefill_s_by_request is not None
