"""Cost routing: minimise the predicted time to first token.

For each eligible replica ``r``::

    ttft(r) = queue_delay(r) + overhead_s + (prompt_tokens - predicted_cached(r)) / rate

with ``queue_delay`` from the (possibly lagged) load view through :class:`CostModel` and
``predicted_cached`` from the router's approximate trees or from KV events. Unlike a match-ratio
threshold there is no knob: a cached prefix is worth exactly the prefill time it saves, which is
what the spill threshold of ``cache_aware`` approximates.
"""

from __future__ import annotations

from kvreuse.errors import ConfigError
from kvreuse.routing.base import (
    REPLICA_ID,
    CostModel,
    FleetView,
    PolicyBase,
    RequestView,
    RoutingDecision,
)
from kvreuse.routing.estimators import ApproxTrees
from kvreuse.routing.events import KvEvent
from kvreuse.routing.mirror import CacheMirror


class CostRouting(PolicyBase):
    """See the module docstring. ``estimator``: ``"approx"`` (default) or ``"exact"``."""

    name = "cost"

    def __init__(
        self,
        *,
        estimator: str = "approx",
        cost: CostModel | None = None,
        eviction_interval_s: float = 120.0,
        max_tree_tokens: int = 2**26,
        tree_capacity_tokens: int | None = None,
        block_size: int = 16,
    ) -> None:
        self.cost = cost or CostModel()
        self.estimator: ApproxTrees | CacheMirror
        if estimator == "approx":
            self.estimator = ApproxTrees(
                eviction_interval_s=eviction_interval_s,
                max_tree_tokens=max_tree_tokens,
                capacity_tokens=tree_capacity_tokens,
            )
        elif estimator == "exact":
            self.estimator = CacheMirror(block_size)
            self.uses_kv_events = True
        else:
            raise ConfigError(f"estimator must be 'approx' or 'exact', got {estimator!r}")

    def route(self, request: RequestView, fleet: FleetView) -> RoutingDecision | None:
        if not fleet.replicas:
            return None
        ids = tuple(map(REPLICA_ID, fleet.replicas))
        matched = self.estimator.predict(request, ids, fleet.now)
        rate, overhead = self.cost.prefill_tokens_per_s, self.cost.overhead_s
        prompt = request.prompt_tokens
        best_id, best_ttft = ids[0], float("inf")
        for load in fleet.replicas:
            rid = load.replica_id
            uncached = max(prompt - matched[rid], 0)
            # CostModel.queue_delay_s + CostModel.prefill_s, inlined with the same arithmetic.
            ttft = (
                load.queued_prefill_tokens / rate + load.queued_requests * overhead
            ) + (overhead + uncached / rate)
            if ttft < best_ttft:
                best_id, best_ttft = rid, ttft
        return RoutingDecision(best_id, "min_ttft", matched[best_id])

    def on_routed(self, request: RequestView, decision: RoutingDecision, now: float) -> None:
        self.estimator.record(request, decision.replica, now)

    def on_kv_event(self, event: KvEvent) -> None:
        if isinstance(self.estimator, CacheMirror):
            self.estimator.apply(event)
