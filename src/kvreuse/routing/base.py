"""The routing contract shared by the simulator and the gateway.

A router is called once per request with two views and answers with a :class:`RoutingDecision`:

* :class:`RequestView`: the packed prompt tokens, cache identity (namespace), tenant and session;
* :class:`FleetView`: the replicas the request may go to, each with its load as the caller last
  knew it (possibly lagged: the simulator and the gateway both refresh it on their own schedule).

Policies never read clocks, sockets or global random state: time is ``FleetView.now`` and a
policy that needs randomness is given a seeded :class:`random.Random`. Besides :meth:`route`,
three hooks let a policy keep state: :meth:`RoutingPolicy.on_routed` after the caller committed
to a decision, :meth:`RoutingPolicy.on_finished` when the request completed, and
:meth:`RoutingPolicy.on_kv_event` when a replica reports cache contents (KV events).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvreuse.errors import ConfigError, require_at_least
from kvreuse.frozen import fast_init
from kvreuse.identity import DEFAULT_IDENTITY, CacheIdentity
from kvreuse.routing.events import KvEvent
from kvreuse.routing.ttft import prefill_s, queue_delay_s
from kvreuse.tokens import TokenBuffer

ReplicaId = str
"""Replicas are named by strings: ``"r0"`` in the simulator, an upstream URL in the gateway."""


@fast_init
@dataclass(frozen=True, slots=True)
class RequestView:
    """What a router may know about a request. ``tokens`` is packed once by the caller."""

    request_id: str
    tokens: TokenBuffer
    prompt_tokens: int
    identity: CacheIdentity = DEFAULT_IDENTITY
    tenant: str | None = None
    session_id: str | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's load as the caller sees it.

    ``queued_prefill_tokens``: prompt tokens waiting to be prefilled (or being prefilled);
    ``queued_requests``: requests waiting for or in prefill; ``in_flight``: every request the
    replica holds (queued, prefilling or decoding) — SGLang's router calls this the load;
    ``kv_capacity_tokens``: how many tokens of KV its cache holds (None: not known), the
    simulator's pool or what a gateway scraped from the engine; ``prefill_speed``: how many
    times the cost model's rate this replica prefills at (a gateway's configured weight times
    its measured speed, :class:`~kvreuse.routing.RelativeSpeeds`; 1 in the simulator's fleets
    of alike replicas). The queue counts are already divided by it; the policies that predict
    time divide a request's own uncached prefill by it too (:meth:`CostModel.prefill_s`).
    """

    replica_id: ReplicaId
    queued_prefill_tokens: int = 0
    queued_requests: int = 0
    in_flight: int = 0
    kv_capacity_tokens: int | None = None
    prefill_speed: float = 1.0

    def at_speed(self, speed: float) -> ReplicaLoad:
        """This load, counted at speed 1, as policies see it on a replica of prefill speed
        ``speed``: its queue counts divided by it (a gateway's weight, a measured speed). The
        one place loads are weighted (the gateway's upstreams and the simulator's replicas).
        The request counts are rounded to the nearest, not down: measured speeds of alike
        replicas scatter around 1, and at 1.02 a replica with one request queued and in flight
        read as idle (``int(1 / 1.02)`` is 0), to the policies' ties and to its own speed
        samples. O(1)."""
        assert self.prefill_speed == 1.0, f"{self.replica_id}: load weighted twice"
        if speed == 1.0:
            return self
        return ReplicaLoad(self.replica_id, int(self.queued_prefill_tokens / speed),
                           int(self.queued_requests / speed + 0.5),
                           int(self.in_flight / speed + 0.5), self.kv_capacity_tokens, speed)


REPLICA_ID = operator.attrgetter("replica_id")
"""``ReplicaLoad -> ReplicaId`` at C speed (policies map it over ``FleetView.replicas``)."""


@fast_init
@dataclass(frozen=True, slots=True)
class FleetView:
    """The replicas a request may be sent to (non-empty unless nothing is eligible) and ``now``,
    the caller's time in seconds (simulated or monotonic)."""

    replicas: tuple[ReplicaLoad, ...]
    now: float = 0.0

    def restrict(self, allowed: Iterable[ReplicaId]) -> FleetView:
        """The same view limited to ``allowed`` (order kept). O(n)."""
        keep = set(allowed)
        return FleetView(tuple(r for r in self.replicas if r.replica_id in keep), self.now)


@fast_init
@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """Where a request goes and why.

    ``branch`` names the rule that decided (``"affinity"``, ``"spill"``, ``"least_load"``...),
    so a gateway can count decisions per branch; ``predicted_cached_tokens`` is the policy's
    guess of the prefix the replica already holds (0 for cache-blind policies), to compare with
    what the engine reports.
    """

    replica: ReplicaId
    branch: str
    predicted_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class CostModel:
    """Prefill cost a policy uses to turn queued tokens into seconds (seed 001's constants).

    ``queue_delay_s`` is the predicted wait before a new request's prefill starts, ``prefill_s``
    the request's own prefill: their sum is its predicted TTFT (:mod:`kvreuse.routing.ttft`).
    """

    prefill_tokens_per_s: float = 10_000.0
    overhead_s: float = 0.015

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0:
            raise ConfigError(
                f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}"
            )
        require_at_least("overhead_s", self.overhead_s, 0)

    def queue_delay_s(self, load: ReplicaLoad) -> float:
        return queue_delay_s(load.queued_prefill_tokens, load.queued_requests,
                             self.prefill_tokens_per_s, self.overhead_s)

    def prefill_s(self, uncached_tokens: int, speed: float = 1.0) -> float:
        """A request's own prefill on a replica of ``speed`` (``ReplicaLoad.prefill_speed``)
        times this model's rate."""
        return prefill_s(uncached_tokens, self.prefill_tokens_per_s * speed, self.overhead_s)


@runtime_checkable
class CacheEstimator(Protocol):
    """What a cache-aware policy believes each replica holds, from what the router sent there
    (:class:`~kvreuse.routing.approx_trees.ApproxTrees`; the gateway's Redis-shared
    :class:`~kvreuse.gateway.shared_index.SharedPrefixIndex`) or from the replicas' KV events
    (:class:`~kvreuse.routing.mirror.CacheMirror`). The registry builds a policy's estimator
    (:func:`~kvreuse.routing.registry.build_estimator`); the policy calls it from its hooks, and
    a gateway may replace it between two requests. Not thread-safe, like the policy."""

    @property
    def uses_kv_events(self) -> bool:
        """True when it learns from :meth:`apply` (KV events) and ignores :meth:`record`; False
        when it learns from :meth:`record` and ignores :meth:`apply`."""
        ...

    def predict(
        self, request: RequestView, replicas: Iterable[ReplicaId], now: float
    ) -> dict[ReplicaId, int]:
        """Called once per request being routed, before the choice: each of ``replicas``'
        predicted cached prefix of the prompt, in tokens (0 where none), keyed in the order
        of ``replicas``. May touch what matched (LRU). O(prompt) plus O(depth × replicas)."""
        ...

    def record(self, request: RequestView, replica: ReplicaId, now: float) -> None:
        """Called when the request was sent to ``replica`` (the policy's ``on_routed``):
        remembers its prompt there. O(prompt)."""
        ...

    def apply(self, event: KvEvent) -> None:
        """Called for each KV event a replica published, in the order received (the policy's
        ``on_kv_event``). O(the event's tokens); a clear O(what the replica held)."""
        ...

    def tree_tokens(self, replica: ReplicaId) -> int:
        """Tokens it believes ``replica`` holds, over all identities. O(1)."""
        ...

    def cached_blocks(self, replica: ReplicaId) -> int:
        """The same in its own unit: whole blocks where it predicts in blocks, tokens where it
        predicts in tokens. The cache size SGLang's and Dynamo's rules compare. O(1)."""
        ...

    def capacity_of(self, replica: ReplicaId) -> int | None:
        """The most tokens it keeps for ``replica`` before forgetting the least recently used
        (a gateway's index budget), or None when nothing bounds it but the replica itself. A
        replica whose :meth:`tree_tokens` is at this bound is *full*: what it holds says how
        recently it was used, not how much room it has. O(1)."""
        ...

    def check_invariants(self) -> None:
        """O(size) self-check; raises AssertionError with a message on a broken invariant."""
        ...


@runtime_checkable
class RoutingPolicy(Protocol):
    """A routing policy. One instance serves one fleet; it is not thread-safe.

    ``uses_kv_events`` tells the caller whether :meth:`on_kv_event` matters, so a gateway need
    not subscribe to replicas' event streams (and a simulator need not publish) otherwise.
    """

    name: str
    uses_kv_events: bool

    def route(self, request: RequestView, fleet: FleetView) -> RoutingDecision | None:
        """Called once per request before it is sent. Returns the decision, or ``None`` when
        ``fleet`` has no replica (backpressure: the caller retries or rejects). Must not assume
        the request will be sent: state changes belong in :meth:`on_routed`."""
        ...

    def on_routed(self, request: RequestView, decision: RoutingDecision, now: float) -> None:
        """Called once the caller has sent the request where ``decision`` said."""
        ...

    def on_finished(self, request: RequestView, replica: ReplicaId, now: float) -> None:
        """Called when the request completed (or failed) on ``replica``."""
        ...

    def on_kv_event(self, event: KvEvent) -> None:
        """Called for each cache event a replica published, in the order received."""
        ...


@runtime_checkable
class PredictsTime(Protocol):
    """A policy that turns queued tokens into seconds with :attr:`cost` (``cost``,
    ``cache_aware``, ``relative_spill``, ``least_load``). A gateway that measures its engines'
    prefill speed (:mod:`kvreuse.routing.cost_fit`) assigns ``cost`` before it routes a
    request; the policy reads it only inside :meth:`RoutingPolicy.route`, so it derives
    nothing from it at construction."""

    cost: CostModel


class PolicyBase:
    """No-op hooks, so a stateless policy only writes :meth:`route`."""

    name = "base"
    uses_kv_events = False

    def on_routed(self, request: RequestView, decision: RoutingDecision, now: float) -> None:
        return None

    def on_finished(self, request: RequestView, replica: ReplicaId, now: float) -> None:
        return None

    def on_kv_event(self, event: KvEvent) -> None:
        return None


class EstimatorPolicy(PolicyBase):
    """A policy routing on a :class:`CacheEstimator`, ``estimator``, which it feeds from its
    hooks and reads on every call (a gateway may swap in a shared index).

    The registry builds it from the options of
    :func:`~kvreuse.routing.registry.build_estimator` the class lists in ``estimator_options``
    (the kind, ``estimator``, is ``default_estimator`` unless given).

    A gateway that checks a KV-event estimator against realized hits sets ``fallback`` (its
    own approximate trees, fed here on every send) and ``suspects``: the replicas whose events
    it no longer trusts, predicted from ``fallback`` until their index is rebuilt. Both unset
    in the simulator, whose events are never wrong.
    """

    estimator_options: tuple[str, ...] = (
        "estimator", "eviction_interval_s", "max_tree_tokens", "tree_capacity_tokens", "block_size"
    )
    default_estimator = "approx"

    def __init__(self, estimator: CacheEstimator) -> None:
        self.estimator = estimator
        self.uses_kv_events = estimator.uses_kv_events
        self.fallback: CacheEstimator | None = None
        self.suspects: frozenset[ReplicaId] = frozenset()

    def predict(self, request: RequestView, fleet: FleetView) -> dict[ReplicaId, int]:
        """Each eligible replica's predicted cached prefix of the prompt, in tokens (a
        suspect's from ``fallback``)."""
        ids = tuple(map(REPLICA_ID, fleet.replicas))
        predicted = self.estimator.predict(request, ids, fleet.now)
        if self.fallback is not None and self.suspects:
            approx = self.fallback.predict(request, ids, fleet.now)
            for replica in self.suspects:
                if replica in predicted:
                    predicted[replica] = approx[replica]
        return predicted

    def on_routed(self, request: RequestView, decision: RoutingDecision, now: float) -> None:
        self.estimator.record(request, decision.replica, now)
        if self.fallback is not None:
            self.fallback.record(request, decision.replica, now)

    def on_kv_event(self, event: KvEvent) -> None:
        self.estimator.apply(event)


def least_loaded(fleet: FleetView, cost: CostModel) -> ReplicaLoad:
    """The replica with the smallest predicted queue delay; ties go to fewer in-flight requests,
    then to the first in view order (deterministic). O(n)."""
    best = fleet.replicas[0]
    best_key = (cost.queue_delay_s(best), best.in_flight)
    for load in fleet.replicas[1:]:
        key = (cost.queue_delay_s(load), load.in_flight)
        if key < best_key:
            best, best_key = load, key
    return best
