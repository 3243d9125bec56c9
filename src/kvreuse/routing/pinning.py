"""Tenant pinning: a tenant's requests only ever see a subset of the fleet.

Seed 000: "Routing by tenant gives a second layer: tenants who never share a replica cannot probe
each other's cache at all." The wrapper narrows the :class:`FleetView` before the inner policy
sees it, so every policy (and its ring, trees or mirror) works unchanged inside the subset.
Tenants without a pin, or with ``tenant=None``, see the whole fleet.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvreuse.errors import ConfigError
from kvreuse.routing.base import (
    FleetView,
    ReplicaId,
    RequestView,
    RoutingDecision,
    RoutingPolicy,
)
from kvreuse.routing.events import KvEvent


class TenantPinned:
    """Wraps ``inner``; ``pins`` maps tenant name -> replica ids it may use."""

    def __init__(self, inner: RoutingPolicy, pins: Mapping[str, Iterable[ReplicaId]]) -> None:
        self.inner = inner
        self.name = f"{inner.name}+pinned"
        self.uses_kv_events = inner.uses_kv_events
        self.pins: dict[str, frozenset[ReplicaId]] = {}
        for tenant, replicas in pins.items():
            allowed = frozenset(replicas)
            if not allowed:
                raise ConfigError(f"tenant {tenant!r} is pinned to no replica; list at least one")
            self.pins[tenant] = allowed

    def route(self, request: RequestView, fleet: FleetView) -> RoutingDecision | None:
        allowed = self.pins.get(request.tenant) if request.tenant is not None else None
        if allowed is not None:
            fleet = fleet.restrict(allowed)
        decision = self.inner.route(request, fleet)
        assert decision is None or allowed is None or decision.replica in allowed, (
            f"{self.inner.name} left the tenant's replica subset"
        )
        return decision

    def on_routed(self, request: RequestView, decision: RoutingDecision, now: float) -> None:
        self.inner.on_routed(request, decision, now)

    def on_finished(self, request: RequestView, replica: ReplicaId, now: float) -> None:
        self.inner.on_finished(request, replica, now)

    def on_kv_event(self, event: KvEvent) -> None:
        self.inner.on_kv_event(event)
