"""The cache-aware policies' per-request choice, given each replica's predicted cached prefix.

Rules described in :mod:`kvreuse.routing.cache_aware` and :mod:`kvreuse.routing.cost` (which
call them): ``bounded`` (ours: longest match unless its predicted TTFT is more than a spill
threshold over the fastest replica's), ``sglang`` (SGLang router's fleet-wide imbalance
fallback) and the shortest predicted TTFT. They are functions of plain inputs, apart from the
policy objects, because they run once per routed request and are part of the compiled core
(:mod:`kvreuse.native`), which policy classes are not: users subclass those, and the registry
reads their signatures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvreuse.routing.base import CostModel, ReplicaId, ReplicaLoad, RoutingDecision
from kvreuse.routing.ttft import prefill_s, queue_delay_s


def bounded_rule(
    matched: dict[ReplicaId, int],
    loads: Sequence[ReplicaLoad],
    prompt_tokens: int,
    cost: CostModel,
    cache_threshold: float,
    spill_threshold_s: float,
) -> RoutingDecision:
    """Longest match (ties to the shorter predicted TTFT); the least loaded replica when the
    best match is at most ``cache_threshold`` of the prompt; a spill to the best match within
    ``spill_threshold_s`` of the fastest replica's TTFT when the best one is slower than that.
    ``loads`` is not empty. O(replicas)."""
    rate, overhead = cost.prefill_tokens_per_s, cost.overhead_s
    # One pass: each replica's predicted TTFT, the longest match, the fastest, the least
    # loaded (queue delay, then in-flight requests). Scalar comparisons against sentinels every
    # replica beats, so the first replica wins ties.
    inf = float("inf")
    best_id = least_id = ""
    best_hit = least_hit = -1
    least_in_flight = -1
    best_ttft = fastest_ttft = least_delay = inf
    for load in loads:
        rid = load.replica_id
        hit = matched[rid]
        delay = queue_delay_s(load.queued_prefill_tokens, load.queued_requests, rate, overhead)
        ttft = delay + prefill_s(prompt_tokens - hit, rate * load.prefill_speed, overhead)
        if hit > best_hit or (hit == best_hit and ttft < best_ttft):
            best_id, best_hit, best_ttft = rid, hit, ttft
        if ttft < fastest_ttft:
            fastest_ttft = ttft
        if delay < least_delay or (delay == least_delay and load.in_flight < least_in_flight):
            least_id, least_hit, least_delay, least_in_flight = rid, hit, delay, load.in_flight
    if best_hit / max(prompt_tokens, 1) <= cache_threshold:
        return RoutingDecision(least_id, "miss_least_load", least_hit)
    limit = fastest_ttft + spill_threshold_s
    if best_ttft <= limit:
        return RoutingDecision(best_id, "affinity", best_hit)
    # Spill (rare): the longest match among replicas within the limit, ties to the faster.
    spill_id, spill_hit, spill_ttft = "", -1, inf
    for load in loads:
        hit = matched[load.replica_id]
        delay = queue_delay_s(load.queued_prefill_tokens, load.queued_requests, rate, overhead)
        ttft = delay + prefill_s(prompt_tokens - hit, rate * load.prefill_speed, overhead)
        if ttft <= limit and (hit > spill_hit or (hit == spill_hit and ttft < spill_ttft)):
            spill_id, spill_hit, spill_ttft = load.replica_id, hit, ttft
    return RoutingDecision(spill_id, "spill", spill_hit)


def min_ttft_rule(
    matched: dict[ReplicaId, int],
    loads: Sequence[ReplicaLoad],
    prompt_tokens: int,
    cost: CostModel,
) -> RoutingDecision:
    """The replica with the shortest predicted TTFT (the first one on ties), the ``cost``
    policy's rule. ``loads`` is not empty. O(replicas)."""
    rate, overhead = cost.prefill_tokens_per_s, cost.overhead_s
    best_id, best_ttft = loads[0].replica_id, float("inf")
    for load in loads:
        rid = load.replica_id
        delay = queue_delay_s(load.queued_prefill_tokens, load.queued_requests, rate, overhead)
        ttft = delay + prefill_s(max(prompt_tokens - matched[rid], 0),
                                 rate * load.prefill_speed, overhead)
        if ttft < best_ttft:
            best_id, best_ttft = rid, ttft
    return RoutingDecision(best_id, "min_ttft", matched[best_id])


def sglang_rule(
    matched: dict[ReplicaId, int],
    loads: Sequence[ReplicaLoad],
    prompt_tokens: int,
    cached_size: Callable[[ReplicaId], int],
    cache_threshold: float,
    balance_abs_threshold: int,
    balance_rel_threshold: float,
    misses_to_least_loaded: bool = False,
) -> RoutingDecision:
    """SGLang router's rule: the least loaded replica (in-flight requests) while the fleet is
    imbalanced, else the longest match above ``cache_threshold`` of the prompt, else the replica
    whose cache (``cached_size``) is smallest, or with ``misses_to_least_loaded`` the least
    loaded one (the first wins ties). ``loads`` is not empty. O(replicas)."""
    # One pass: highest and lowest load (the first least loaded wins ties) and the longest
    # match (the first wins ties), as sgl-router's iteration order decides.
    first = loads[0]
    high = low = first.in_flight
    least = best = first.replica_id
    best_hit = matched[best]
    for load in loads:
        in_flight = load.in_flight
        if in_flight > high:
            high = in_flight
        elif in_flight < low:
            low, least = in_flight, load.replica_id
        hit = matched[load.replica_id]
        if hit > best_hit:
            best, best_hit = load.replica_id, hit
    if high - low > balance_abs_threshold and high > low * balance_rel_threshold:
        return RoutingDecision(least, "imbalance", matched[least])
    if prompt_tokens and best_hit / prompt_tokens > cache_threshold:
        return RoutingDecision(best, "affinity", best_hit)
    if misses_to_least_loaded:
        return RoutingDecision(least, "miss_least_load", matched[least])
    smallest, smallest_size = least, -1
    for load in loads:
        held = cached_size(load.replica_id)
        if smallest_size < 0 or held < smallest_size:
            smallest, smallest_size = load.replica_id, held
    return RoutingDecision(smallest, "miss_smallest_tree", matched[smallest])
