"""Relative spill: stay where the longest cached prefix is unless waiting there costs more than a
share of what this request costs the fleet now; send misses to the least busy, emptiest cache
nearby.

For each eligible replica ``r`` (the candidates of :class:`FleetView`, whatever subset the
caller allows: tenant pins, a model's replicas)::

    hit(r)   = predicted cached prefix (the router's approximate trees, or KV events)
    ttft(r)  = queue_delay(r) + overhead + (prompt - hit(r)) / rate        (CostModel)
    R        = mean queue_delay over the candidates + overhead + prompt / rate
    limit    = min ttft + slack × R

``R`` is the fleet's current prefill time for this request: what it would wait and compute on an
average candidate with nothing cached. Then:

* **affinity**: the longest match (ties to the shorter ``ttft``, then fewer requests in flight,
  then view order) if its ``ttft <= limit``;
* **spill**: otherwise the longest match among replicas within ``limit`` (same ties);
* **miss**: when that choice's match is at most ``cache_threshold`` (10 %) of the prompt, among
  the replicas with ``ttft <= min ttft + MISS_WINDOW × R``, the one whose cache is smallest,
  then the one holding the fewest requests in flight (then the shorter ``ttft``): a new prefix
  goes where it evicts least, as SGLang's documented rule does. A cache the estimator bounds
  (``CacheEstimator.capacity_of``, a gateway's index budget) that this prompt would overflow is
  *full* and counts as that bound: full caches tie on size, and among them the least busy takes
  the miss.

Why the smallest cache before the fewest in flight. Requests in flight follow where hot
prefixes are being served, a cache's size counts each prefix once whatever its traffic; which
of the two places a fleet's first prefixes better depends on the stream. On
``benchmarks/routers.py``'s contracts at 12,288-token engines and its default stream (seed 7)
in flight first measured 56.0-56.8 % through the gateway against 50.8 % for size first (best
peer 55.9 %), and this rule was in flight first for a while. But over twelve seeded streams of
the same workload, replayed in the simulator as the gateway runs them, the two orders tie
(52.8 % and 52.9 % mean hit rate, both 3.6 points over smg's rule at 70 % of its p95), seed 7
being among the streams where smg's rule does best and the only one where size first trails it
there; through the gateway, on
seeds 1-3, size first beat the best peer by 3.3-12.3 points (docs/performance.md). On the chat
workloads (six system prompts, a few requests in flight during warm-up) the fewest in flight
put three of belgavi's six prompts on one replica in one replay of ten (p95 0.4 s to 4.6 s),
where the smallest cache spreads them two by two: over ten replays of every simulator
workload, size first passes the peers on 5 of 9, in flight first on 1.

Why full caches tie. Behind ``kvreuse route`` every replica's tree is trimmed at its budget
(2 × its KV), so once traffic has filled them all their sizes differ by whatever the last
trims left, a few hundred tokens that say nothing about room. Measured on the same contracts
workload, misses by size first: the simulator, which makes all 502 of a gateway run's
decisions when its trees are bounded alike, predicted 51.5 % hit rate and a 210 ms p95 when
misses followed those sizes and 53.2 % and 173 ms when full caches tied. Unbounded trees (the
simulator's default) never fill, so the rule is unchanged there.

Why relative. ``cache_aware``'s bound is a fixed 200 ms: on 12,000-token documents a miss costs
1.2 s of prefill, so a 200 ms queue difference spills the request, scatters the documents and the
fleet falls over (the ``long-context`` scenario: 30 % hit rate and a 50 s p95 where SGLang's rule
keeps 65 %). A bound proportional to ``R`` holds a long prompt on its cache as long as waiting
costs less than ``slack`` times recomputing, and releases short ones quickly; it scales with the
queues, so a fleet that is busy everywhere does not spill for nothing.

The knob, ``slack``, moves along one curve: 0 is pure least-TTFT placement (hit rate falls,
queues even out), infinity is pure affinity (SGLang's rule without its fleet-wide switch: highest
hit rate, longest queues on hot prefixes). ``kvreuse simulate --report`` plots that curve (hit
rate against p95 TTFT as ``slack`` varies) and ``benchmarks/default_vs_peers.py`` judges the
default against the peers' rules on every workload. The default is 4 (it was 2): over ten
replays of every simulator workload, slack 4 keeps 0.2-0.3 points more than slack 2 of the
Mooncake trace at 4, 8 and 16 replicas and 0.4 more of ``long-context``, at p95s within 0.5 s,
and passes the peers on 5 of 9 against 4; 3 and 8 pass the same 5. Through the gateway
(``benchmarks/routers.py``, 12,288- and 32,768-token engines) it gave the same hit rates as 2 at
p95s 0-12 % higher, about the spread of one setup's p95 from run to run (docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvreuse.errors import ConfigError
from kvreuse.routing.base import (
    CacheEstimator,
    CostModel,
    EstimatorPolicy,
    FleetView,
    ReplicaId,
    ReplicaLoad,
    RequestView,
    RoutingDecision,
)

MISS_WINDOW = 0.2
"""Share of ``R`` within which a miss may trade speed for a less busy, emptier cache."""

SLACKS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, float("inf"))
"""The knob's values ``kvreuse simulate --report`` plots."""


def relative_spill_rule(
    matched: dict[ReplicaId, int],
    loads: Sequence[ReplicaLoad],
    prompt_tokens: int,
    cost: CostModel,
    cache_size: Callable[[ReplicaId], int],
    cache_threshold: float,
    slack: float,
    cache_capacity: Callable[[ReplicaId], int | None] = lambda replica: None,
) -> RoutingDecision:
    """The rule of the module docstring. ``loads`` is not empty; ``cache_capacity`` is each
    replica's bound (None: unbounded). O(replicas)."""
    rate, overhead = cost.prefill_tokens_per_s, cost.overhead_s
    rows: list[tuple[ReplicaId, int, float, int]] = []
    total_delay = 0.0
    for load in loads:
        rid = load.replica_id
        hit = matched[rid]
        delay = cost.queue_delay_s(load)
        total_delay += delay
        rows.append((rid, hit, delay + cost.prefill_s(prompt_tokens - hit), load.in_flight))
    fastest = min(row[2] for row in rows)
    reference = total_delay / len(rows) + overhead + prompt_tokens / rate
    limit = fastest + slack * reference if slack != float("inf") else float("inf")
    # The fastest replica is always within the limit, so ``within`` is never empty.
    within = [row for row in rows if row[2] <= limit]
    pick = min(within, key=lambda row: (-row[1], row[2], row[3]))
    if pick[1] / max(prompt_tokens, 1) <= cache_threshold:
        window = fastest + MISS_WINDOW * reference
        near = [row for row in rows if row[2] <= window]

        def room_order(row: tuple[ReplicaId, int, float, int]) -> int:
            size, bound = cache_size(row[0]), cache_capacity(row[0])
            return bound if bound is not None and size + prompt_tokens > bound else size

        pick = min(near, key=lambda row: (room_order(row), row[3], row[2]))
        return RoutingDecision(pick[0], "miss", pick[1])
    longest = max(row[1] for row in rows)
    return RoutingDecision(pick[0], "affinity" if pick[1] == longest else "spill", pick[1])


class RelativeSpill(EstimatorPolicy):
    """See the module docstring. Its estimator's options: ``estimator`` (``"approx"``, the
    router's own trees, no KV events needed; ``tree_capacity_tokens`` makes them forget at a
    replica's cache size; or ``"exact"``, KV events, ``block_size`` the engine's)."""

    name = "relative_spill"
    estimator_options = ("estimator", "tree_capacity_tokens", "block_size")

    def __init__(
        self,
        *,
        estimator: CacheEstimator,
        slack: float = 4.0,
        cache_threshold: float = 0.1,
        cost: CostModel | None = None,
    ) -> None:
        if not slack >= 0:  # also refuses NaN
            raise ConfigError(f"slack must be >= 0 (inf for pure affinity), got {slack}")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ConfigError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.slack = slack
        self.cache_threshold = cache_threshold
        self.cost = cost or CostModel()
        super().__init__(estimator)

    def route(self, request: RequestView, fleet: FleetView) -> RoutingDecision | None:
        if not fleet.replicas:
            return None
        return relative_spill_rule(
            self.predict(request, fleet),
            fleet.replicas,
            request.prompt_tokens,
            self.cost,
            self.estimator.tree_tokens,
            self.cache_threshold,
            self.slack,
            self.estimator.capacity_of,
        )
