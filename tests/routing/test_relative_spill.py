"""relative_spill's rule: affinity within a bound relative to the request's fleet prefill time,
spills, misses to the least busy and smallest cache nearby, ties, and candidate subsets."""

from __future__ import annotations

import math

import pytest

from kvreuse.errors import ConfigError
from kvreuse.identity import CacheIdentity
from kvreuse.routing import (
    ApproxTrees,
    CacheMirror,
    CostModel,
    FleetView,
    KvStored,
    ReplicaLoad,
    RequestView,
    RoutingDecision,
    TenantPinned,
    build_policy,
)
from kvreuse.routing.relative_spill import (
    ALTERNATIVE_SLACK,
    COPY_EVIDENCE_S,
    COPY_UTILISATION,
    DEMAND_MIN_REQUESTS,
    SLACKS,
    EvictionModel,
    PrefixDemand,
    RelativeSpill,
    relative_spill_rule,
)
from kvreuse.tokens import pack

COST = CostModel(prefill_tokens_per_s=1000.0, overhead_s=0.0)
"""1,000 tokens/s and no overhead: every predicted time below is tokens / 1000."""


def loads(*queued: int, in_flight: tuple[int, ...] | None = None) -> tuple[ReplicaLoad, ...]:
    flights = in_flight or (0,) * len(queued)
    return tuple(ReplicaLoad(f"r{i}", q, 0, f) for i, (q, f) in enumerate(zip(queued, flights,
                                                                             strict=True)))


def rule(matched: list[int], queued: list[int], prompt: int, slack: float,
         sizes: list[int] | None = None, in_flight: tuple[int, ...] | None = None,
         threshold: float = 0.1, bounds: list[int | None] | None = None,
         alternative_slack: float = ALTERNATIVE_SLACK, prefix_demand: float = 0.0,
         copy_utilisation: float = COPY_UTILISATION) -> RoutingDecision:
    names = [f"r{i}" for i in range(len(queued))]
    size = dict(zip(names, sizes or [0] * len(queued), strict=True))
    bound = dict(zip(names, bounds or [None] * len(queued), strict=True))
    return relative_spill_rule({f"r{i}": m for i, m in enumerate(matched)},
                               loads(*queued, in_flight=in_flight), prompt, COST,
                               size.__getitem__, threshold, slack, bound.__getitem__,
                               alternative_slack=alternative_slack,
                               prefix_demand=prefix_demand,
                               copy_utilisation=copy_utilisation)


def test_affinity_while_the_wait_is_within_slack_times_the_fleet_prefill_time() -> None:
    """Prompt 1000, r0 holds 900 behind 1500 queued tokens: ttft 1.6 s against r1's 1.0 s;
    R = mean delay 0.75 + 1.0 = 1.75 s, so slack 1 allows 1.0 + 1.75 and keeps affinity."""
    decision = rule([900, 0], [1500, 0], 1000, slack=1.0)
    assert (decision.replica, decision.branch, decision.predicted_cached_tokens) == (
        "r0", "affinity", 900)


def test_spill_when_the_wait_exceeds_the_bound() -> None:
    """Slack 0.25, r1 idle holding 200: limit 0.8 + 0.25 x 1.75 = 1.24 s < r0's 1.6 s, so the
    request spills to r1 (20 % cached: a spill, not a miss)."""
    decision = rule([900, 200], [1500, 0], 1000, slack=0.25)
    assert (decision.replica, decision.branch, decision.predicted_cached_tokens) == (
        "r1", "spill", 200)


def test_spill_goes_to_the_longest_match_within_the_bound() -> None:
    """r0 (900 cached) is too slow; r1 holds 500 and r2 nothing, both within: r1 wins."""
    decision = rule([900, 500, 0], [3000, 0, 0], 1000, slack=0.5)
    assert (decision.replica, decision.branch, decision.predicted_cached_tokens) == (
        "r1", "spill", 500)


def test_the_bound_scales_with_the_prompt() -> None:
    """The same 1.5 s queue difference spills a 1,000-token prompt at slack 0.25 but not a
    10,000-token one (R = 0.75 + 10 s): long prompts stay with their cache."""
    short = rule([900, 0], [1500, 0], 1000, slack=0.25, threshold=0.0)
    long = rule([9000, 0], [1500, 0], 10_000, slack=0.25)
    assert (short.replica, long.replica) == ("r1", "r0")


def test_longest_match_ties_go_to_the_faster_then_fewer_in_flight() -> None:
    """Equal matches: the shorter predicted TTFT wins; equal TTFT, fewer requests in flight."""
    assert rule([500, 500], [300, 100], 1000, slack=1.0).replica == "r1"
    assert rule([500, 500], [0, 0], 1000, slack=1.0, in_flight=(4, 2)).replica == "r1"
    assert rule([500, 500], [0, 0], 1000, slack=1.0, in_flight=(2, 2)).replica == "r0"


def test_misses_go_to_the_smallest_cache_among_nearly_fastest_replicas() -> None:
    """No useful match (50 of 1000 is under 10 %): R = 1.1 s, window 0.22 s; r0 (0.1 s queue)
    and r1 (idle) qualify, r2 (1 s queue) does not; r0 caches least of the two."""
    decision = rule([50, 0, 0], [100, 0, 1000], 1000, slack=2.0, sizes=[10, 500, 0])
    assert (decision.replica, decision.branch) == ("r0", "miss")


def test_misses_go_to_the_smallest_cache_before_the_fewest_in_flight() -> None:
    """Both replicas idle of queued work, r0 caching less but serving three requests against
    r1's one: the smaller cache r0 takes the miss; with equal caches the less busy r1 does."""
    busy = rule([0, 0], [0, 0], 1000, slack=2.0, sizes=[10, 500], in_flight=(3, 1))
    assert (busy.replica, busy.branch) == ("r0", "miss")
    tied = rule([0, 0], [0, 0], 1000, slack=2.0, sizes=[500, 500], in_flight=(3, 1))
    assert tied.replica == "r1"


def test_in_flight_counts_only_among_the_nearly_fastest() -> None:
    """r2 serves nothing but has 1,000 tokens queued (1 s, outside the 0.22 s window): the miss
    goes to the busier r0, which is within it."""
    decision = rule([0, 0, 0], [0, 100, 1000], 1000, slack=2.0, sizes=[0, 0, 0],
                    in_flight=(2, 3, 0))
    assert decision.replica == "r0"


def test_miss_ties_on_cache_size_go_to_the_faster() -> None:
    """Equal requests in flight and cache sizes among near replicas: the shorter predicted TTFT
    wins."""
    assert rule([0, 0], [100, 0], 1000, slack=2.0, sizes=[7, 7]).replica == "r1"


def test_slack_zero_is_least_ttft_and_infinity_is_pure_affinity() -> None:
    """Slack 0 keeps only the fastest replicas; infinite slack never spills."""
    assert rule([900, 0], [5000, 0], 1000, slack=0.0, threshold=0.0).replica == "r1"
    assert rule([900, 0], [10**9, 0], 1000, slack=math.inf).branch == "affinity"


def test_the_default_slack_is_a_point_of_the_plotted_knob_curve() -> None:
    """``kvreuse simulate --report`` plots the curve at SLACKS: the default must be one of its
    points, or the report would not show where users stand on it."""
    assert RelativeSpill(estimator=ApproxTrees()).slack in SLACKS


@pytest.mark.parametrize("replicas", [2, 4])
def test_one_hot_replica_spills_past_24_times_the_others_prefill_time(replicas: int) -> None:
    """r0 holds 900 of 1,000 tokens, the others idle, r1 holding 200: slack 4 × R alone would
    wait forever on 2 or 4 replicas (R grows with r0's queue), but R_else = 1.0 s bounds the
    wait at 0.8 + 24 × 1.0 = 24.8 s: 24,600 queued tokens stay, 24,800 spill to r1."""
    matched = [900, 200] + [0] * (replicas - 2)
    idle = [0] * (replicas - 1)
    assert ALTERNATIVE_SLACK == 24.0
    assert rule(matched, [24_600, *idle], 1000, slack=4.0).branch == "affinity"
    spilled = rule(matched, [24_800, *idle], 1000, slack=4.0)
    assert (spilled.replica, spilled.branch) == ("r1", "spill")


def test_without_the_alternative_bound_one_hot_replica_queues_without_limit() -> None:
    """alternative_slack = inf is the rule before the bound: ten thousand seconds of queue on
    the prefix's replica and an idle other one, still affinity on 2 replicas at slack 4."""
    decision = rule([900, 200], [10**7, 0], 1000, slack=4.0, alternative_slack=math.inf)
    assert decision.branch == "affinity"


def test_the_alternative_bound_needs_a_replica_without_the_longest_prefix() -> None:
    """Every replica holds the same 900 tokens: there is no elsewhere, the fleet bound alone
    decides (R = 5,000 s + 1 s on both, so 10 million queued tokens stay)."""
    decision = rule([900, 900], [10**7, 10**7 - 1000], 1000, slack=4.0)
    assert (decision.replica, decision.branch) == ("r1", "affinity")


def test_a_prefix_wanted_by_more_than_its_holders_can_serve_is_copied_when_faster() -> None:
    """r0 holds 900 of 1,000 tokens behind 1,000 queued (ttft 1.1 s), r1 is idle (1.0 s): the
    prefix's traffic needs 1.4 replicas, more than 0.8 × its one holder, so r1 gets a copy;
    with no demand known the slack bounds keep it on r0."""
    copied = rule([900, 0], [1000, 0], 1000, slack=4.0, prefix_demand=1.4)
    assert (copied.replica, copied.branch) == ("r1", "miss")
    assert rule([900, 0], [1000, 0], 1000, slack=4.0).replica == "r0"
    assert rule([900, 0], [1000, 0], 1000, slack=4.0, prefix_demand=1.4,
                copy_utilisation=math.inf).replica == "r0"


def test_a_copy_is_made_only_where_it_is_faster() -> None:
    """The same hot prefix behind 50 queued tokens (ttft 0.15 s) stays: the idle replica
    without it would take 1.0 s."""
    assert rule([900, 0], [50, 0], 1000, slack=4.0, prefix_demand=1.4).replica == "r0"


def test_demand_its_holders_can_serve_makes_no_further_copy() -> None:
    """r0 and r1 hold the prefix, r2 is idle and faster: 1.5 replicas of demand is under
    0.8 × 2 holders, so the request stays on the faster holder; 1.7 is over and copies."""
    assert rule([900, 900, 0], [1100, 1200, 0], 1000, slack=4.0,
                prefix_demand=1.5).replica == "r0"
    assert rule([900, 900, 0], [1100, 1200, 0], 1000, slack=4.0,
                prefix_demand=1.7).replica == "r2"


def test_prefix_demand_of_a_steady_stream_is_its_rate_times_its_prefill() -> None:
    """Forty requests a second for 20 s sharing a 100-token prefix, each 0.035 s of prefill
    past it: 1.4 replicas' worth, within 5 %."""
    demand = PrefixDemand()
    shared = list(range(100))
    for i in range(800):
        count, seconds = demand.count(request([*shared, 1000 + i]), 100, i / 40)
    needed = PrefixDemand.replicas_needed(count, seconds, 1, 0.035)
    assert needed == pytest.approx(1.4, rel=0.05)


def test_prefix_demand_is_not_estimated_from_fewer_requests_than_the_minimum() -> None:
    """Three requests in a millisecond are too few to call a rate: no demand."""
    demand = PrefixDemand()
    for i in range(int(DEMAND_MIN_REQUESTS) - 1):
        count, seconds = demand.count(request([*list(range(50)), 99, i]), 50, i * 1e-4)
    assert PrefixDemand.replicas_needed(count, seconds, 1, 1.0) == 0.0


def test_a_burst_justifies_a_first_copy_but_not_a_third() -> None:
    """Twenty requests arriving together: a rate of thousands a second for the first copy,
    but a second one needs the demand measured over COPY_EVIDENCE_S, here 20 a second."""
    demand = PrefixDemand()
    for i in range(20):
        count, seconds = demand.count(request([*list(range(50)), 99, i]), 50, 1e-5 * i)
    assert PrefixDemand.replicas_needed(count, seconds, 1, 0.035) > 10
    assert COPY_EVIDENCE_S == 1.0
    at_two = PrefixDemand.replicas_needed(count, seconds, 2, 0.035)
    assert at_two == pytest.approx(20 / (10 * -math.expm1(-0.1)) * 0.035, rel=1e-3)
    assert at_two < COPY_UTILISATION * 2


def test_prefix_demand_is_counted_per_prefix_and_identity() -> None:
    """The same tokens under another identity (a tenant's salt), or a longer prefix of them,
    are other prefixes: each has its own count."""
    demand = PrefixDemand()
    tokens = list(range(60))
    salted = RequestView("s", pack(tokens), 60, CacheIdentity(cache_salt="tenant-b"))
    assert demand.count(request(tokens), 50, 0.0)[0] == 1.0
    assert demand.count(request(tokens), 50, 0.0)[0] == 2.0
    assert demand.count(salted, 50, 0.0)[0] == 1.0
    assert demand.count(request(tokens), 40, 0.0)[0] == 1.0
    assert len(demand) == 3


def test_prefix_demand_holds_a_bounded_table_under_a_flood_of_unique_prefixes() -> None:
    """Ten thousand unique prefixes into a table of 64: never more than 64 entries, and the
    prefix asked for last is still counted."""
    demand = PrefixDemand(max_prefixes=64)
    for i in range(10_000):
        demand.count(request([i, i + 1, i + 2]), 3, float(i))
        assert len(demand) <= 64
    assert demand.count(request([9_999, 10_000, 10_001]), 3, 10_000.0)[0] > 1.0


def test_the_policy_copies_a_hot_prefix_once_its_demand_is_seen() -> None:
    """Through the policy: one prefix asked 100 times a second, each request 200 own tokens
    (0.2 s of prefill, 20 replicas' worth) piles onto r0 only until its queue makes the idle r1
    faster; then r1 gets the copy. With copy_utilisation inf it never does (slack 4 × R
    grows with r0's queue on 2 replicas, and the alternative bound is 24 s away)."""
    for utilisation, copies in ((COPY_UTILISATION, True), (math.inf, False)):
        policy = RelativeSpill(estimator=ApproxTrees(), cost=COST,
                               copy_utilisation=utilisation)
        shared = list(range(1000))
        where = []
        for i in range(12):
            queued = 200 * sum(1 for w in where if w == "r0")
            fleet = FleetView((ReplicaLoad("r0", queued, 0, 0), ReplicaLoad("r1", 0, 0, 0)),
                              i / 100)
            view = request(shared + [10_000 + 200 * i + k for k in range(200)], f"q{i}")
            decision = policy.route(view, fleet)
            assert decision is not None
            policy.on_routed(view, decision, i / 100)
            where.append(decision.replica)
        assert ("r1" in where[1:]) is copies, where


def request(tokens: list[int], request_id: str = "q") -> RequestView:
    return RequestView(request_id, pack(tokens), len(tokens))


def test_policy_only_chooses_among_the_candidates_it_is_given() -> None:
    """A candidate subset (pins, a model's replicas) bounds the choice and the reference: r0
    holds the prompt but is not a candidate, so the request goes to a candidate."""
    policy = RelativeSpill(estimator=ApproxTrees(), cost=COST)
    prompt = list(range(100))
    policy.on_routed(request(prompt, "a"), RoutingDecision("r0", "affinity"), 0.0)
    full = FleetView(loads(0, 0, 0))
    assert policy.route(request(prompt, "b"), full).replica == "r0"  # type: ignore[union-attr]
    subset = full.restrict(["r1", "r2"])
    decision = policy.route(request(prompt, "c"), subset)
    assert decision is not None and decision.replica in ("r1", "r2")
    assert decision.branch == "miss"
    pinned = TenantPinned(RelativeSpill(estimator=ApproxTrees(), cost=COST), {"acme": ["r2"]})
    acme = RequestView("d", pack(prompt), len(prompt), tenant="acme")
    assert pinned.route(acme, full).replica == "r2"  # type: ignore[union-attr]


def test_exact_estimator_learns_from_kv_events() -> None:
    """With estimator 'exact' the policy follows the replicas' KV events, not its own record."""
    policy = RelativeSpill(estimator=CacheMirror(block_size=4), cost=COST)
    assert policy.uses_kv_events
    prompt = list(range(40))
    policy.on_kv_event(KvStored("r1", pack(prompt)))
    decision = policy.route(request(prompt), FleetView(loads(0, 0)))
    assert decision is not None and (decision.replica, decision.predicted_cached_tokens) == (
        "r1", 40)


def test_empty_fleet_is_backpressure() -> None:
    """No candidate: None, as every policy answers."""
    assert RelativeSpill(estimator=ApproxTrees()).route(request([1, 2]), FleetView(())) is None


@pytest.mark.parametrize("options", [{"slack": -1.0}, {"slack": math.nan},
                                     {"alternative_slack": -1.0},
                                     {"alternative_slack": math.nan},
                                     {"copy_utilisation": 0.0},
                                     {"copy_utilisation": math.nan},
                                     {"cache_threshold": 1.5}, {"estimator": "psychic"}])
def test_bad_options_are_configuration_errors(options: dict[str, object]) -> None:
    """A negative or NaN slack or alternative slack, a copy utilisation not above 0, a
    threshold outside [0, 1] or an unknown estimator is refused."""
    with pytest.raises(ConfigError):
        build_policy("relative_spill", **options)


def test_full_caches_tie_and_the_least_busy_takes_the_miss() -> None:
    """Bounds of 1,000 tokens, both caches would overflow: they tie at the bound, and r1, with
    one request in flight against r0's four, takes the miss although it holds more."""
    full = rule([0, 0], [0, 0], 100, slack=2.0, sizes=[920, 950], bounds=[1000, 1000],
                in_flight=(4, 1))
    assert (full.replica, full.branch) == ("r1", "miss")


def test_full_caches_tie_and_the_fastest_takes_the_miss() -> None:
    """Bounds of 1,000 tokens, a 100-token miss: r0 (920 held, 10 ms queued, within the miss
    window) and r1 (950 held, idle) would both overflow, so they tie at the bound and the faster
    r1 wins; unbounded, the smaller cache r0 wins."""
    full = rule([0, 0], [10, 0], 100, slack=2.0, sizes=[920, 950], bounds=[1000, 1000])
    assert (full.replica, full.branch) == ("r1", "miss")
    unbounded = rule([0, 0], [10, 0], 100, slack=2.0, sizes=[920, 950])
    assert unbounded.replica == "r0"


def test_a_cache_with_room_beats_a_full_one() -> None:
    """r1 has room for the prompt (800 + 100 <= 1000), r0 would overflow (950): r1 takes the
    miss although r0 is as fast; a full cache counts as its bound, so it still beats an
    unbounded one holding more."""
    decision = rule([0, 0], [0, 0], 100, slack=2.0, sizes=[950, 800], bounds=[1000, 1000])
    assert decision.replica == "r1"
    mixed = rule([0, 0], [0, 0], 100, slack=2.0, sizes=[950, 1200], bounds=[1000, None])
    assert mixed.replica == "r0"


def sized(*queued: int, capacity: int | None = 100) -> tuple[ReplicaLoad, ...]:
    """Idle-but-queued replicas whose KV capacity is ``capacity`` tokens (None: not known)."""
    return tuple(ReplicaLoad(f"r{i}", q, 0, 0, capacity) for i, q in enumerate(queued))


def sent(policy: RelativeSpill, start: int, length: int, replica: str, at: float,
         cached: int = 0) -> None:
    """The router sent a ``length``-token prompt (tokens from ``start``) to ``replica``."""
    prompt = request(list(range(start, start + length)), f"{start}@{at}")
    policy.on_routed(prompt, RoutingDecision(replica, "affinity", cached), at)


def miss_at(policy: RelativeSpill, fleet: tuple[ReplicaLoad, ...], at: float,
            length: int = 50) -> str:
    """Where a new ``length``-token prompt nobody holds goes at ``at``."""
    decision = policy.route(request(list(range(90_000, 90_000 + length)), "new"),
                            FleetView(fleet, at))
    assert decision is not None and decision.branch == "miss"
    return decision.replica


def test_a_miss_goes_to_a_cache_with_room_before_a_smaller_full_one() -> None:
    """r1 holds 90 of its 100 tokens of KV, r0 600 of 1,000: the old order (smallest cache)
    would pick r1, but a 50-token prompt evicts nothing only on r0."""
    policy = RelativeSpill(estimator=ApproxTrees(), cost=COST)
    fleet = (ReplicaLoad("r0", 0, 0, 0, 1000), ReplicaLoad("r1", 0, 0, 0, 100))
    policy.evictions.observe(fleet)
    sent(policy, 0, 600, "r0", 0.0)
    sent(policy, 10_000, 90, "r1", 0.0)
    assert miss_at(policy, fleet, 1.0) == "r0"


def test_when_every_cache_is_full_the_oldest_lru_prefix_takes_the_miss() -> None:
    """Both caches full for a 50-token prompt; r0's least recently used prefix was last used
    40 s ago, r1's 20 s ago: r0 takes the miss although its tree is larger. Capacities unknown,
    the old order (smaller tree) picks r1."""
    for capacity, expected in ((100, "r0"), (None, "r1")):
        policy = RelativeSpill(estimator=ApproxTrees(), cost=COST)
        policy.evictions.observe(sized(0, 0, capacity=capacity))
        sent(policy, 0, 70, "r0", 0.0)
        sent(policy, 10_000, 60, "r1", 20.0)
        assert miss_at(policy, sized(0, 0, capacity=capacity), 40.0) == expected


def test_equally_old_lru_prefixes_send_the_miss_where_fewer_cached_tokens_were_served() -> None:
    """Both full, LRU prefixes used 8 and 9 s ago (the same 10 s step); r0 just served 70
    cached tokens, r1 none: r1 takes the miss although its tree is larger."""
    policy = RelativeSpill(estimator=ApproxTrees(), cost=COST)
    policy.evictions.observe(sized(0, 0))
    sent(policy, 0, 70, "r0", 0.0)
    sent(policy, 0, 70, "r0", 1.0, cached=70)
    sent(policy, 10_000, 80, "r1", 2.0)
    assert miss_at(policy, sized(0, 0), 10.0) == "r1"


def test_a_full_cache_miss_waits_at_most_the_full_miss_window() -> None:
    """r0 has the oldest LRU prefix. A 50-token prompt (prefill 0.05 s): with r0 0.05 s behind,
    the window is min(0.7 x R = 0.0525 s, 3 x 0.05 s), so r0 takes it (the 0.2 x R window of
    caches with room would not reach it); 0.1 s behind (window 0.07 s), r1 does."""
    for queued, expected in ((50, "r0"), (100, "r1")):
        policy = RelativeSpill(estimator=ApproxTrees(), cost=COST)
        policy.evictions.observe(sized(0, 0))
        sent(policy, 0, 70, "r0", 0.0)
        sent(policy, 10_000, 70, "r1", 30.0)
        assert miss_at(policy, sized(queued, 0), 40.0) == expected


def test_the_eviction_model_never_holds_more_than_its_bound() -> None:
    """A replica reporting an absurd capacity (a forged /metrics) keeps at most max_tokens in
    the model, so a flood of unique prompts cannot grow it without bound."""
    model = EvictionModel(max_tokens=500)
    model.observe((ReplicaLoad("r0", 0, 0, 0, 10**12),))
    for i in range(100):
        model.record(request(list(range(i * 1000, i * 1000 + 40)), f"q{i}"), "r0", 0, float(i))
    assert model.lru.tree_tokens("r0") <= 500
    assert model.has_room("r0", 1000)  # the reported capacity still says what fits
    model.lru.check_invariants()


def test_a_miss_avoids_a_replica_whose_own_prefill_is_slow() -> None:
    """Two idle replicas, the one caching less prefilling at a quarter speed (4 s for 1,000
    tokens, outside the miss window of 0.2 x R = 0.2 s): the miss goes to the other; at alike
    speeds it goes to the smaller cache."""
    names = {"r0": 10, "r1": 500}
    alike = relative_spill_rule({"r0": 0, "r1": 0}, loads(0, 0), 1000, COST, names.__getitem__,
                                0.1, 2.0)
    slow = (ReplicaLoad("r0", prefill_speed=0.25), ReplicaLoad("r1"))
    degraded = relative_spill_rule({"r0": 0, "r1": 0}, slow, 1000, COST, names.__getitem__,
                                   0.1, 2.0)
    assert (alike.replica, degraded.replica) == ("r0", "r1")
    assert degraded.branch == "miss"


def test_affinity_weighs_the_holders_prefill_at_its_speed() -> None:
    """r0 holds 900 of 10,000 tokens at a tenth of the speed (91 s of prefill), r1 holds 800
    at full speed (9.2 s): slack 1 (R = 10 s) lets the request go to r1; at alike speeds the
    longest match r0 keeps it."""
    matched = {"r0": 900, "r1": 800}
    sizes = {"r0": 0, "r1": 0}
    alike = relative_spill_rule(matched, loads(0, 0), 10_000, COST, sizes.__getitem__, 0.0,
                                1.0)
    slow = (ReplicaLoad("r0", prefill_speed=0.1), ReplicaLoad("r1"))
    spilled = relative_spill_rule(matched, slow, 10_000, COST, sizes.__getitem__, 0.0, 1.0)
    assert (alike.replica, alike.branch) == ("r0", "affinity")
    assert (spilled.replica, spilled.branch) == ("r1", "spill")
