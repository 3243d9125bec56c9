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

from kvreuse.errors import ConfigError
from kvreuse.frozen import fast_init
from kvreuse.identity import DEFAULT_IDENTITY, CacheIdentity
from kvreuse.routing.events import KvEvent
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
    replica holds (queued, prefilling or decoding) — SGLang's router calls this the load.
    """

    replica_id: ReplicaId
    queued_prefill_tokens: int = 0
    queued_requests: int = 0
    in_flight: int = 0


REPLICA_ID = operator.attrgetter("replica_id")
"""``ReplicaLoad -> ReplicaId`` at C speed (policies map it over ``FleetView.replicas``)."""


@fast_init
@dataclass(frozen=True, slots=True)
class FleetView:
    """The replicas a request may be sent to (non-empty unless nothing is eligible) and ``now``,
    the caller's time in seconds (simulated or monotonic)."""

    replicas: tuple[ReplicaLoad, ...]
    now: float = 0.0

    @property
    def replica_ids(self) -> tuple[ReplicaId, ...]:
        return tuple(r.replica_id for r in self.replicas)

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

    ``queue_delay_s`` is the predicted wait before a new request's prefill starts.
    """

    prefill_tokens_per_s: float = 10_000.0
    overhead_s: float = 0.015

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0:
            raise ConfigError(
                f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}"
            )
        if self.overhead_s < 0:
            raise ConfigError(f"overhead_s must be >= 0, got {self.overhead_s}")

    def queue_delay_s(self, load: ReplicaLoad) -> float:
        return (
            load.queued_prefill_tokens / self.prefill_tokens_per_s
            + load.queued_requests * self.overhead_s
        )

    def prefill_s(self, uncached_tokens: int) -> float:
        return self.overhead_s + uncached_tokens / self.prefill_tokens_per_s


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
