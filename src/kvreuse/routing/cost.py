"""Cost routing: minimise the predicted time to first token.

For each eligible replica ``r``::

    ttft(r) = queue_delay(r) + overhead_s + (prompt_tokens - predicted_cached(r)) / rate

with ``queue_delay`` from the (possibly lagged) load view through :class:`CostModel` and
``predicted_cached`` from its estimator (the router's approximate trees or KV events). Unlike a
match-ratio threshold there is no knob: a cached prefix is worth exactly the prefill time it
saves, which is what the spill threshold of ``cache_aware`` approximates.
"""

from __future__ import annotations

from kvreuse.routing.base import (
    CacheEstimator,
    CostModel,
    EstimatorPolicy,
    FleetView,
    RequestView,
    RoutingDecision,
)
from kvreuse.routing.load_rules import min_ttft_rule


class CostRouting(EstimatorPolicy):
    """See the module docstring."""

    name = "cost"

    def __init__(self, *, estimator: CacheEstimator, cost: CostModel | None = None) -> None:
        self.cost = cost or CostModel()
        super().__init__(estimator)

    def route(self, request: RequestView, fleet: FleetView) -> RoutingDecision | None:
        if not fleet.replicas:
            return None
        matched = self.predict(request, fleet)
        return min_ttft_rule(matched, fleet.replicas, request.prompt_tokens, self.cost)
