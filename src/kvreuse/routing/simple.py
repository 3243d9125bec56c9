"""Cache-blind policies: round robin, random, least load. The baselines every other policy beats
or explains itself against (seed 001: "Load balancing an LLM fleet with a generic round-robin
proxy ... scatters conversations and multiplies cache memory by the number of replicas")."""

from __future__ import annotations

import random

from kvreuse.routing.base import (
    CostModel,
    FleetView,
    PolicyBase,
    RequestView,
    RoutingDecision,
    least_loaded,
)


class RoundRobin(PolicyBase):
    """Cycles through the replicas in view order. The counter advances on :meth:`route`, so a
    request that is retried elsewhere still moves the cycle on (as a proxy's does)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, request: RequestView, fleet: FleetView) -> RoutingDecision | None:
        if not fleet.replicas:
            return None
        load = fleet.replicas[self._next % len(fleet.replicas)]
        self._next += 1
        return RoutingDecision(load.replica_id, "round_robin")


class RandomChoice(PolicyBase):
    """Uniform choice with the caller's seeded ``rng`` (never the global generator)."""

    name = "random"

    def __init__(self, rng: random.Random | None = None, seed: int = 0) -> None:
        self._rng = rng if rng is not None else random.Random(seed)

    def route(self, request: RequestView, fleet: FleetView) -> RoutingDecision | None:
        if not fleet.replicas:
            return None
        load = fleet.replicas[self._rng.randrange(len(fleet.replicas))]
        return RoutingDecision(load.replica_id, "random")


class LeastLoad(PolicyBase):
    """Smallest predicted queue delay (queued prefill tokens / rate + overhead per queued
    request), ties to fewer in-flight requests, then view order."""

    name = "least_load"

    def __init__(self, cost: CostModel | None = None) -> None:
        self.cost = cost or CostModel()

    def route(self, request: RequestView, fleet: FleetView) -> RoutingDecision | None:
        if not fleet.replicas:
            return None
        return RoutingDecision(least_loaded(fleet, self.cost).replica_id, "least_load")
