"""Unit tests for the routing policies, one behaviour each."""

from __future__ import annotations

import random

import pytest

from kvreuse.errors import ConfigError
from kvreuse.identity import CacheIdentity
from kvreuse.routing import (
    POLICIES,
    ApproxTrees,
    CacheAware,
    ConsistentRing,
    CostModel,
    CostRouting,
    EstimatorPolicy,
    FleetView,
    KvCleared,
    KvRemoved,
    KvStored,
    LeastLoad,
    PrefixHash,
    RandomChoice,
    ReplicaLoad,
    RequestView,
    RoundRobin,
    RoutingDecision,
    SessionAffinity,
    TenantPinned,
    build_policy,
    prefix_key,
)
from kvreuse.tokens import pack


def fleet(*queued: int, in_flight: tuple[int, ...] | None = None, now: float = 0.0) -> FleetView:
    flights = in_flight or (0,) * len(queued)
    return FleetView(
        tuple(
            ReplicaLoad(f"r{i}", q, 1 if q else 0, f)
            for i, (q, f) in enumerate(zip(queued, flights, strict=True))
        ),
        now,
    )


def request(tokens: list[int], session: str | None = None, tenant: str | None = None,
            identity: CacheIdentity | None = None) -> RequestView:
    return RequestView("q", pack(tokens), len(tokens), identity or CacheIdentity(), tenant, session)


def routed(policy: object, req: RequestView, view: FleetView) -> RoutingDecision:
    decision = policy.route(req, view)  # type: ignore[attr-defined]
    assert decision is not None
    policy.on_routed(req, decision, view.now)  # type: ignore[attr-defined]
    return decision


def test_round_robin_cycles_in_view_order() -> None:
    """Round robin visits every replica once per cycle, in order."""
    policy = RoundRobin()
    picks = [routed(policy, request([1]), fleet(0, 0, 0)).replica for _ in range(6)]
    assert picks == ["r0", "r1", "r2", "r0", "r1", "r2"]


def test_random_is_reproducible_with_a_seeded_rng() -> None:
    """Two random policies with equally seeded rngs choose identically."""
    a = RandomChoice(random.Random(7))
    b = RandomChoice(random.Random(7))
    view = fleet(0, 0, 0, 0)
    picks_a = [routed(a, request([1]), view).replica for _ in range(50)]
    picks_b = [routed(b, request([1]), view).replica for _ in range(50)]
    assert picks_a == picks_b and len(set(picks_a)) == 4


def test_least_load_picks_smallest_queue_delay() -> None:
    """Least load goes to the replica with the fewest queued prefill tokens."""
    assert routed(LeastLoad(), request([1]), fleet(500, 100, 900)).replica == "r1"


def test_empty_fleet_is_backpressure() -> None:
    """Every policy returns None when no replica is eligible."""
    for name in POLICIES:
        assert build_policy(name).route(request([1, 2, 3]), FleetView(())) is None


def test_ring_is_stable_and_moves_few_keys_when_growing() -> None:
    """Adding a fifth replica moves roughly a fifth of the keys, and only to the newcomer."""
    ring = ConsistentRing(["a", "b", "c", "d"])
    keys = [prefix_key(pack([k, k + 1]), 2, CacheIdentity()) for k in range(2000)]
    before = [ring.first(k) for k in keys]
    ring.add("e")
    after = [ring.first(k) for k in keys]
    moved = [(x, y) for x, y in zip(before, after, strict=True) if x != y]
    assert all(y == "e" for _, y in moved)
    assert 0.1 < len(moved) / len(keys) < 0.32


def test_prefix_hash_sends_equal_prefixes_to_one_replica() -> None:
    """Requests sharing their first k tokens land together regardless of their tails."""
    policy = PrefixHash(k=4, overload=None)
    view = fleet(0, 0, 0, 0)
    picks = {routed(policy, request([9, 8, 7, 6, tail]), view).replica for tail in range(30)}
    assert len(picks) == 1


def test_prefix_hash_spills_like_seeds_choose() -> None:
    """Over overload x mean queued tokens the next ring replica takes the request."""
    policy = PrefixHash(k=4, overload=1.25)
    req = request([1, 2, 3, 4, 5])
    home = routed(policy, req, fleet(0, 0, 0)).replica
    queued = [100, 100, 100]
    queued[int(home[1:])] = 1000  # mean 400, bound 500: home is over it
    decision = routed(policy, req, fleet(*queued))
    assert decision.replica != home and decision.branch == "spill"


def test_session_affinity_keeps_a_session_together() -> None:
    """Every turn of a session goes to the same replica even as its prompt changes."""
    policy = SessionAffinity()
    view = fleet(0, 0, 0, 0, 0)
    picks = {routed(policy, request(list(range(t + 3)), session="s1"), view).replica
             for t in range(20)}
    assert len(picks) == 1


def test_cache_aware_follows_the_longest_routed_prefix() -> None:
    """After a prompt is routed somewhere, its continuation goes there too."""
    policy = CacheAware(estimator=ApproxTrees(), cache_threshold=0.3)
    first = routed(policy, request(list(range(100))), fleet(0, 0, 0))
    follow = routed(policy, request(list(range(120))), fleet(0, 0, 0))
    assert follow.replica == first.replica and follow.branch == "affinity"
    assert follow.predicted_cached_tokens == 100


@pytest.mark.parametrize("name", ["cache_aware", "cache_aware_sglang", "cost", "relative_spill"])
def test_policies_read_an_estimator_a_gateway_swapped_in(name: str) -> None:
    """An estimator replaced after construction (a shared index) is the one every decision
    uses."""
    policy = build_policy(name)
    shared = build_policy(name)
    routed(shared, request(list(range(100))), fleet(0, 0, 0, now=1.0))
    held_by = routed(shared, request(list(range(100))), fleet(0, 0, 0, now=2.0)).replica
    policy.estimator = shared.estimator  # type: ignore[attr-defined]  # as shared_index.attach
    decision = routed(policy, request(list(range(120))), fleet(0, 0, 0, now=3.0))
    assert decision.replica == held_by and decision.predicted_cached_tokens == 100


def test_cache_aware_below_threshold_goes_to_least_loaded() -> None:
    """A weak match (ratio under cache_threshold) is routed by load."""
    policy = CacheAware(estimator=ApproxTrees(), cache_threshold=0.5)
    routed(policy, request(list(range(10))), fleet(0, 0, 0))
    decision = routed(policy, request(list(range(10)) + list(range(500, 600))), fleet(50, 0, 80))
    assert decision.branch == "miss_least_load" and decision.replica == "r1"


def test_cache_aware_spills_only_past_the_threshold() -> None:
    """The holder keeps the request unless its predicted TTFT is spill_threshold_s worse."""
    policy = CacheAware(estimator=ApproxTrees(), spill_threshold_s=0.2,
                        cost=CostModel(10_000.0, 0.0))
    tokens = list(range(1000))
    holder = routed(policy, request(tokens), fleet(0, 0)).replica
    other = "r1" if holder == "r0" else "r0"
    # 1,000 uncached tokens elsewhere cost 0.1 s; a 0.25 s queue on the holder stays within it.
    near = [0, 0]
    near[int(holder[1:])] = 2500
    assert routed(policy, request(tokens), fleet(*near)).replica == holder
    far = [0, 0]
    far[int(holder[1:])] = 5000
    decision = routed(policy, request(tokens), fleet(*far))
    assert decision.replica == other and decision.branch == "spill"


def test_sglang_rule_turns_affinity_off_fleet_wide_when_imbalanced() -> None:
    """With in-flight spread > abs and ratio > rel, every request goes to the least loaded."""
    policy = build_policy("cache_aware_sglang")
    tokens = list(range(200))
    holder = routed(policy, request(tokens), fleet(0, 0, 0)).replica
    loads = [10, 10, 10]
    loads[int(holder[1:])] = 5
    loads[(int(holder[1:]) + 1) % 3] = 200
    decision = routed(policy, request(tokens), fleet(0, 0, 0, in_flight=tuple(loads)))
    assert decision.branch == "imbalance" and decision.replica == holder
    loads[int(holder[1:])] = 100
    decision = routed(policy, request(tokens), fleet(0, 0, 0, in_flight=tuple(loads)))
    assert decision.branch == "imbalance" and decision.replica != holder


def test_smg_rule_keeps_affinity_and_sends_misses_by_load() -> None:
    """cache_aware_smg: a strong match stays on its holder; a new prefix goes to the replica
    with the fewest requests in flight although another one's tree is smaller."""
    policy = build_policy("cache_aware_smg")
    tokens = list(range(200))
    first = routed(policy, request(tokens), fleet(0, 0, 0, in_flight=(0, 0, 0)))
    assert (first.replica, first.branch) == ("r0", "miss_least_load")
    follow = routed(policy, request(tokens + [7] * 20), fleet(0, 0, 0, in_flight=(5, 0, 0)))
    assert (follow.replica, follow.branch) == ("r0", "affinity")
    fresh = routed(policy, request(list(range(1000, 1200))), fleet(0, 0, 0, in_flight=(0, 2, 1)))
    assert (fresh.replica, fresh.branch) == ("r0", "miss_least_load")


def test_exact_learns_only_from_kv_events() -> None:
    """The exact policy predicts what events said was stored, cut by removals and clears."""
    policy = build_policy("exact", block_size=4)
    assert policy.uses_kv_events
    tokens = pack(list(range(40)))
    view = fleet(0, 0)
    req = RequestView("q", tokens, 40)
    assert routed(policy, req, view).predicted_cached_tokens == 0
    policy.on_kv_event(KvStored("r1", tokens))
    decision = routed(policy, req, view)
    assert decision.replica == "r1" and decision.predicted_cached_tokens == 40
    policy.on_kv_event(KvRemoved("r1", tokens, keep_tokens=22))
    assert routed(policy, req, view).predicted_cached_tokens == 20
    policy.on_kv_event(KvCleared("r1"))
    assert routed(policy, req, view).predicted_cached_tokens == 0


def test_cost_prefers_a_short_queue_over_a_small_hit() -> None:
    """Cost routing picks the smaller predicted TTFT, not the longer match."""
    policy = CostRouting(estimator=ApproxTrees(), cost=CostModel(10_000.0, 0.015))
    tokens = list(range(1000))
    holder = routed(policy, request(tokens[:100]), fleet(0, 0)).replica
    queued = [0, 0]
    queued[int(holder[1:])] = 20_000  # 2 s of queue to save 10 ms of prefill
    assert routed(policy, request(tokens), fleet(*queued)).replica != holder


def test_tenant_pinning_restricts_the_fleet() -> None:
    """A pinned tenant only ever lands on its replicas; others see the whole fleet."""
    policy = TenantPinned(RoundRobin(), {"acme": ["r2", "r3"]})
    view = fleet(0, 0, 0, 0)
    acme = {routed(policy, request([1], tenant="acme"), view).replica for _ in range(8)}
    other = {routed(policy, request([1], tenant="globex"), view).replica for _ in range(8)}
    assert acme == {"r2", "r3"} and other == {"r0", "r1", "r2", "r3"}


def test_identities_do_not_share_affinity_or_trees() -> None:
    """Equal tokens under different salts are different prefixes to cache-aware routing."""
    policy = CacheAware(estimator=ApproxTrees())
    tokens = list(range(100))
    routed(policy, request(tokens, identity=CacheIdentity(cache_salt="a")), fleet(0, 0))
    other = routed(policy, request(tokens, identity=CacheIdentity(cache_salt="b")), fleet(0, 0))
    assert other.predicted_cached_tokens == 0


def test_registry_rejects_unknown_names_and_options() -> None:
    """Bad policy names and options raise ConfigError naming the choices."""
    with pytest.raises(ConfigError, match="choose one of"):
        build_policy("nope")
    with pytest.raises(ConfigError, match="accepts"):
        build_policy("round_robin", k=3)
    assert isinstance(build_policy("exact", spill_threshold_s=0.1), CacheAware)


def test_pins_to_nothing_are_rejected() -> None:
    """An empty replica list for a tenant is a configuration error."""
    with pytest.raises(ConfigError, match="acme"):
        TenantPinned(RoundRobin(), {"acme": []})


@pytest.mark.parametrize(("name", "options"), [
    ("exact", {}), ("relative_spill", {"estimator": "exact"}), ("cost", {"estimator": "exact"}),
    ("dynamo_kv", {}),
])
def test_kv_event_policies_route_suspect_replicas_on_their_fallback_trees(
    name: str, options: dict[str, object]
) -> None:
    """With a fallback set, a suspect replica is predicted from the prompts sent to it, the
    others still from KV events, whichever policy reads the events."""
    policy = build_policy(name, block_size=4, **options)
    assert isinstance(policy, EstimatorPolicy) and policy.uses_kv_events
    policy.fallback = ApproxTrees()
    tokens = pack(list(range(40)))
    req = RequestView("q", tokens, 40)
    view = fleet(0, 0)
    policy.on_kv_event(KvStored("r0", tokens))  # r0's events claim it all (stale)
    policy.on_routed(req, RoutingDecision("r1", "test", 0), 0.0)  # sent to r1 before
    assert policy.predict(req, view) == {"r0": 40, "r1": 0}
    policy.suspects = frozenset({"r0"})
    assert policy.predict(req, view) == {"r0": 0, "r1": 0}
    policy.suspects = frozenset({"r0", "r1"})
    assert policy.predict(req, view) == {"r0": 0, "r1": 40}


def test_approx_trees_keep_each_replica_within_its_own_capacity() -> None:
    """set_capacity caps one replica's tree, trims it at once, and record keeps it there."""
    trees = ApproxTrees()
    for i in range(20):
        for replica in ("r0", "r1"):
            trees.record(request([1000 * i + t for t in range(10)]), replica, float(i))
    assert trees.tree_tokens("r0") == trees.tree_tokens("r1") == 200
    trees.set_capacity("r0", 50)
    assert trees.tree_tokens("r0") == 50 and trees.tree_tokens("r1") == 200
    for i in range(20, 40):
        trees.record(request([1000 * i + t for t in range(10)]), "r0", float(i))
        assert trees.tree_tokens("r0") <= 50
    assert trees.capacity_of("r0") == 50 and trees.capacity_of("r1") is None
    newest = request([39_000 + t for t in range(10)])
    assert trees.predict(newest, ("r0",), 41.0) == {"r0": 10}
    trees.check_invariants()
