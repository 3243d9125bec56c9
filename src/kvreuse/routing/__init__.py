"""Routing policies shared by the fleet simulator and the gateway (pure core: no I/O, no clocks).

Contracts (:class:`RoutingPolicy`, :class:`CacheEstimator`): :mod:`kvreuse.routing.base`.
Policies by name: :data:`POLICIES`, built with :func:`build_policy` (their estimators with
:func:`build_estimator`).
"""

from kvreuse.routing.affinity import PrefixHash, SessionAffinity
from kvreuse.routing.approx_trees import ApproxTrees
from kvreuse.routing.base import (
    CacheEstimator,
    CostModel,
    EstimatorPolicy,
    FleetView,
    PolicyBase,
    PredictsTime,
    ReplicaId,
    ReplicaLoad,
    RequestView,
    RoutingDecision,
    RoutingPolicy,
    least_loaded,
)
from kvreuse.routing.cache_aware import CacheAware, CacheAwareSGLang, Exact
from kvreuse.routing.cost import CostRouting
from kvreuse.routing.cost_fit import PrefillFit, PrefillSample, RelativeSpeeds
from kvreuse.routing.events import KvCleared, KvEvent, KvRemoved, KvStored
from kvreuse.routing.mirror import CacheMirror
from kvreuse.routing.peers import DynamoKvCost, LlmdScorers
from kvreuse.routing.pinning import TenantPinned
from kvreuse.routing.registry import (
    DEFAULT_POLICY,
    DESCRIPTIONS,
    POLICIES,
    build_estimator,
    build_policy,
    policy_names,
    policy_option_names,
)
from kvreuse.routing.relative_spill import RelativeSpill
from kvreuse.routing.ring import ConsistentRing, block_chain, prefix_key, stable_hash
from kvreuse.routing.simple import LeastLoad, RandomChoice, RoundRobin

__all__ = [
    "DEFAULT_POLICY",
    "DESCRIPTIONS",
    "POLICIES",
    "ApproxTrees",
    "CacheAware",
    "CacheAwareSGLang",
    "CacheEstimator",
    "CacheMirror",
    "ConsistentRing",
    "CostModel",
    "CostRouting",
    "DynamoKvCost",
    "EstimatorPolicy",
    "Exact",
    "FleetView",
    "KvCleared",
    "KvEvent",
    "KvRemoved",
    "KvStored",
    "LeastLoad",
    "LlmdScorers",
    "PolicyBase",
    "PredictsTime",
    "PrefillFit",
    "PrefillSample",
    "PrefixHash",
    "RandomChoice",
    "RelativeSpeeds",
    "RelativeSpill",
    "ReplicaId",
    "ReplicaLoad",
    "RequestView",
    "RoundRobin",
    "RoutingDecision",
    "RoutingPolicy",
    "SessionAffinity",
    "TenantPinned",
    "block_chain",
    "build_estimator",
    "build_policy",
    "least_loaded",
    "policy_names",
    "policy_option_names",
    "prefix_key",
    "stable_hash",
]
