"""Stateless affinity: session ids or the first K prompt tokens through a consistent ring.

``prefix_hash`` spills exactly like seed 000's ``choose``::

    key = hash(tuple(prompt_ids[:k]))
    ring = consistent_ring_order(replicas, key)      # stable preference list
    mean_load = sum(r.queued_tokens for r in replicas) / len(replicas)
    for r in ring:                                    # affinity first
        if r.queued_tokens <= overload * mean_load:
            return r                                  # warm or soon warm
    return min(replicas, key=lambda r: r.queued_tokens)  # everyone busy

with ``queued_tokens`` = :attr:`ReplicaLoad.queued_prefill_tokens` and the mean over the replicas
the request may use. ``load_metric="in_flight"`` bounds in-flight requests instead (the
consistent-hashing-with-bounded-loads form): queued prefill tokens jump by a whole prompt at each
miss and sit at 0 on idle replicas, so at low load the mean is tiny and the seed's bound spills
requests that did not need to move; in-flight counts are smoother. ``overload=None`` turns the
bound off (pure affinity, seed 001's "pinning by prefix without a spill rule"). Hot prefixes
thus end up on as many replicas as their load needs. Note that with ``overload >= 1`` some
replica is always at or under the bound (the minimum never exceeds the mean), so the seed's
everyone-busy fallback cannot fire; it is kept for parity with ``choose``.
"""

from __future__ import annotations

from kvreuse.errors import ConfigError
from kvreuse.routing.base import FleetView, PolicyBase, ReplicaLoad, RequestView, RoutingDecision
from kvreuse.routing.ring import ConsistentRing, prefix_key, stable_hash

LOAD_METRICS = ("queued_prefill_tokens", "in_flight")


class _RingPolicy(PolicyBase):
    """Shared machinery: a ring that learns replica ids as views show them."""

    def __init__(self, overload: float | None, vnodes: int, load_metric: str) -> None:
        if overload is not None and overload < 1.0:
            raise ConfigError(f"overload must be >= 1.0 (or None for no bound), got {overload}")
        if load_metric not in LOAD_METRICS:
            raise ConfigError(f"load_metric must be one of {LOAD_METRICS}, got {load_metric!r}")
        self.overload = overload
        self.load_metric = load_metric
        self.ring = ConsistentRing(vnodes=vnodes)

    def _key(self, request: RequestView) -> int:
        raise NotImplementedError

    def route(self, request: RequestView, fleet: FleetView) -> RoutingDecision | None:
        if not fleet.replicas:
            return None
        by_id: dict[str, ReplicaLoad] = {}
        for load in fleet.replicas:
            by_id[load.replica_id] = load
            if load.replica_id not in self.ring:
                self.ring.add(load.replica_id)
        key = self._key(request)
        if self.overload is None:
            first = self.ring.first(key, by_id)
            assert first is not None, "ring lost a replica of the view"
            return RoutingDecision(first, "affinity")
        metric = self.load_metric
        mean = sum(getattr(r, metric) for r in fleet.replicas) / len(fleet.replicas)
        bound = self.overload * mean
        rank = 0
        for rid in self.ring.preference(key):
            candidate = by_id.get(rid)
            if candidate is None:
                continue
            if getattr(candidate, metric) <= bound:
                return RoutingDecision(rid, "affinity" if rank == 0 else "spill")
            rank += 1
        idlest = min(fleet.replicas, key=lambda r: getattr(r, metric))
        return RoutingDecision(idlest.replica_id, "all_busy")


class PrefixHash(_RingPolicy):
    """Hash of the first ``k`` tokens (and the cache identity) on a consistent ring, bounded-load
    spill at ``overload`` × mean queued prefill tokens (seed 000 defaults: k=1024, 1.25)."""

    name = "prefix_hash"

    def __init__(
        self,
        k: int = 1024,
        overload: float | None = 1.25,
        vnodes: int = 160,
        load_metric: str = "queued_prefill_tokens",
    ) -> None:
        if k < 1:
            raise ConfigError(f"k must be >= 1 token, got {k}")
        super().__init__(overload, vnodes, load_metric)
        self.k = k

    def _key(self, request: RequestView) -> int:
        return prefix_key(request.tokens, self.k, request.identity)


class SessionAffinity(_RingPolicy):
    """Session id on a consistent ring (seed 001: "Hash a session or conversation ID to a
    replica"). A request without a session falls back to its first ``k`` tokens. No load bound
    by default; pass ``overload`` to add seed 000's spill."""

    name = "session_affinity"

    def __init__(
        self,
        k: int = 1024,
        overload: float | None = None,
        vnodes: int = 160,
        load_metric: str = "queued_prefill_tokens",
    ) -> None:
        super().__init__(overload, vnodes, load_metric)
        self.k = k

    def _key(self, request: RequestView) -> int:
        if request.session_id is None:
            return prefix_key(request.tokens, self.k, request.identity)
        return stable_hash(f"session:{request.tenant}:{request.session_id}".encode())
