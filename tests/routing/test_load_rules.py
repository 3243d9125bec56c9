"""The cache-aware rules as plain functions: each branch, and how ties break."""

from __future__ import annotations

import pytest

from kvreuse.routing import CostModel, ReplicaLoad
from kvreuse.routing.load_rules import bounded_rule, min_ttft_rule, sglang_rule

COST = CostModel(10_000.0, 0.0)


def loads(*queued: int, in_flight: tuple[int, ...] | None = None) -> tuple[ReplicaLoad, ...]:
    flights = in_flight or (0,) * len(queued)
    return tuple(
        ReplicaLoad(f"r{i}", q, 1 if q else 0, f)
        for i, (q, f) in enumerate(zip(queued, flights, strict=True))
    )


def test_bounded_equal_matches_go_to_the_faster_replica() -> None:
    """Two replicas hold the same prefix: the one with the shorter queue gets the request."""
    decision = bounded_rule({"r0": 500, "r1": 500}, loads(800, 100), 1000, COST, 0.3, 0.2)
    assert (decision.replica, decision.branch, decision.predicted_cached_tokens) == (
        "r1", "affinity", 500,
    )


def test_bounded_weak_match_goes_to_the_least_loaded() -> None:
    """A match of at most cache_threshold of the prompt is routed by queue delay."""
    decision = bounded_rule({"r0": 300, "r1": 0}, loads(50, 10), 1000, COST, 0.3, 0.2)
    assert (decision.replica, decision.branch, decision.predicted_cached_tokens) == (
        "r1", "miss_least_load", 0,
    )


def test_bounded_spill_takes_the_best_match_within_the_limit() -> None:
    """Past the spill threshold the best match among replicas fast enough is chosen."""
    matched = {"r0": 900, "r1": 400, "r2": 0}
    decision = bounded_rule(matched, loads(9000, 500, 0), 1000, COST, 0.3, 0.2)
    # r0: 0.9 + 0.01 s; r2 (fastest): 0.1 s, limit 0.3 s; r1: 0.05 + 0.06 s is within it.
    assert (decision.replica, decision.branch, decision.predicted_cached_tokens) == (
        "r1", "spill", 400,
    )


def test_sglang_balanced_fleet_follows_the_longest_match() -> None:
    """No imbalance and a match over cache_threshold: affinity."""
    decision = sglang_rule(
        {"r0": 10, "r1": 80}, loads(0, 0, in_flight=(3, 4)), 100, lambda r: 0, 0.3, 64, 1.5
    )
    assert (decision.replica, decision.branch) == ("r1", "affinity")


def test_sglang_weak_match_goes_to_the_smallest_cache() -> None:
    """No imbalance and a weak match: the replica caching the least, first on ties."""
    sizes = {"r0": 500, "r1": 200, "r2": 200}
    decision = sglang_rule(
        {"r0": 10, "r1": 0, "r2": 0}, loads(0, 0, 0), 100, sizes.__getitem__, 0.3, 64, 1.5
    )
    assert (decision.replica, decision.branch, decision.predicted_cached_tokens) == (
        "r1", "miss_smallest_tree", 0,
    )


def test_smg_weak_match_goes_to_the_least_loaded_not_the_smallest_cache() -> None:
    """smg's rule (misses_to_least_loaded): a weak match goes to the fewest in flight, first
    on ties, whatever the caches hold (smg 1.13 select_worker_with_text)."""
    sizes = {"r0": 500, "r1": 200, "r2": 900}
    flights = (4, 3, 3)
    decision = sglang_rule({"r0": 10, "r1": 0, "r2": 0}, loads(0, 0, 0, in_flight=flights), 100,
                           sizes.__getitem__, 0.3, 64, 1.5, True)
    assert (decision.replica, decision.branch, decision.predicted_cached_tokens) == (
        "r1", "miss_least_load", 0,
    )
    decision = sglang_rule({"r0": 10, "r1": 0, "r2": 0}, loads(0, 0, 0, in_flight=(4, 5, 3)),
                           100, sizes.__getitem__, 0.3, 64, 1.5, True)
    assert decision.replica == "r2"


def test_sglang_needs_both_thresholds_for_imbalance() -> None:
    """A spread over abs but a ratio under rel keeps affinity on."""
    matched = {"r0": 90, "r1": 0}
    flights = (200, 130)  # spread 70 > 64, but 200 < 130 x 1.6
    decision = sglang_rule(matched, loads(0, 0, in_flight=flights), 100, lambda r: 0, 0.3, 64, 1.6)
    assert decision.branch == "affinity"
    decision = sglang_rule(matched, loads(0, 0, in_flight=flights), 100, lambda r: 0, 0.3, 64, 1.5)
    assert (decision.replica, decision.branch) == ("r1", "imbalance")


def test_bounded_rule_weighs_each_replicas_own_prefill_at_its_speed() -> None:
    """r0 holds 500 of 1000 at a quarter speed (0.2 s of prefill), r1 holds 450 at full speed
    (0.055 s): past a 0.1 s spill threshold the request goes to r1; at alike speeds r0 keeps
    it (0.05 s against 0.055 s)."""
    matched = {"r0": 500, "r1": 450}
    alike = bounded_rule(matched, loads(0, 0), 1000, COST, 0.3, 0.1)
    slow = (ReplicaLoad("r0", prefill_speed=0.25), ReplicaLoad("r1"))
    assert (alike.replica, alike.branch) == ("r0", "affinity")
    assert bounded_rule(matched, slow, 1000, COST, 0.3, 0.1).replica == "r1"


def test_min_ttft_counts_a_slow_replicas_prefill_at_its_speed() -> None:
    """r0 caches 1,000 of 3,000 tokens but prefills at a quarter speed (0.8 s), r1 nothing at
    full speed (0.3 s): r1; at alike speeds r0 (0.2 s)."""
    matched = {"r0": 1000, "r1": 0}
    assert min_ttft_rule(matched, loads(0, 0), 3000, COST).replica == "r0"
    slow = (ReplicaLoad("r0", prefill_speed=0.25), ReplicaLoad("r1"))
    assert min_ttft_rule(matched, slow, 3000, COST).replica == "r1"


def test_a_load_at_a_speed_divides_its_queue_and_carries_the_speed() -> None:
    """at_speed(0.5) doubles every queue count and keeps the capacity (tokens rounded down,
    requests to the nearest); at 1 it is the very load; weighting a weighted load is a broken
    invariant."""
    load = ReplicaLoad("r", queued_prefill_tokens=1001, queued_requests=3, in_flight=5,
                       kv_capacity_tokens=4096)
    assert load.at_speed(0.5) == ReplicaLoad("r", 2002, 6, 10, 4096, 0.5)
    assert load.at_speed(3.0) == ReplicaLoad("r", 333, 1, 2, 4096, 3.0)
    assert load.at_speed(1.0) is load
    with pytest.raises(AssertionError, match="weighted twice"):
        load.at_speed(0.5).at_speed(0.5)


@pytest.mark.parametrize("speed", [0.9, 0.98, 1.02, 1.1, 1.4])
def test_a_busy_replica_near_the_fleets_speed_is_not_read_as_idle(speed: float) -> None:
    """One request queued and in flight stays one at the speeds measured on alike replicas
    (truncating made it 0 at any speed over 1)."""
    weighted = ReplicaLoad("r", 500, 1, 1).at_speed(speed)
    assert (weighted.queued_requests, weighted.in_flight) == (1, 1)
