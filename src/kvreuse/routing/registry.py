"""Policies by name. The simulator's ``--policy`` and the gateway's ``--policy`` read this dict."""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvreuse.errors import ConfigError
from kvreuse.routing.affinity import PrefixHash, SessionAffinity
from kvreuse.routing.approx_trees import ApproxTrees
from kvreuse.routing.base import CacheEstimator, CostModel, ReplicaId, RoutingPolicy
from kvreuse.routing.cache_aware import CacheAware, CacheAwareSGLang, CacheAwareSmg, Exact
from kvreuse.routing.cost import CostRouting
from kvreuse.routing.mirror import CacheMirror
from kvreuse.routing.peers import DynamoKvCost, LlmdScorers
from kvreuse.routing.pinning import TenantPinned
from kvreuse.routing.relative_spill import RelativeSpill
from kvreuse.routing.simple import LeastLoad, RandomChoice, RoundRobin

PolicyFactory = Callable[..., RoutingPolicy]

DEFAULT_POLICY = "relative_spill"
"""What ``kvreuse route``, ``kvreuse simulate --trace`` and ``kvreuse plan`` use unless told
otherwise: the policy that ``benchmarks/default_vs_peers.py`` and ``benchmarks/routers.py``
measure closest to dominating the peers' rules (docs/performance.md, issue 15)."""

POLICIES: dict[str, PolicyFactory] = {
    "round_robin": RoundRobin,
    "random": RandomChoice,
    "least_load": LeastLoad,
    "session_affinity": SessionAffinity,
    "prefix_hash": PrefixHash,
    "cache_aware": CacheAware,
    "cache_aware_sglang": CacheAwareSGLang,
    "cache_aware_smg": CacheAwareSmg,
    "exact": Exact,
    "cost": CostRouting,
    "llm_d": LlmdScorers,
    "dynamo_kv": DynamoKvCost,
    "relative_spill": RelativeSpill,
}

DESCRIPTIONS: dict[str, str] = {
    "round_robin": "cycle through replicas, cache-blind",
    "random": "uniform random with a seeded rng, cache-blind",
    "least_load": "smallest predicted queue delay, cache-blind",
    "session_affinity": "session id on a consistent ring (virtual nodes)",
    "prefix_hash": "first K tokens on a consistent ring, bounded-load spill (contract library)",
    "cache_aware": "router's approximate trees, longest match, per-request 200 ms spill bound",
    "cache_aware_sglang": "SGLang router rule: fleet-wide abs/rel imbalance fallback",
    "cache_aware_smg": "smg 1.13 / sglang-router 0.3 rule: SGLang's, misses to the least loaded",
    "exact": "true replica contents from KV events (lagged), longest match, spill bound",
    "cost": "minimum predicted TTFT = queue delay + overhead + uncached / rate",
    "llm_d": "llm-d scheduler rule: prefix-cache 3 + queue 2 + kv-cache utilization 2, max score",
    "dynamo_kv": "NVIDIA Dynamo KV router rule: min of overlap weight x prefill blocks + decode "
    "blocks",
    "relative_spill": "longest match unless its TTFT exceeds the fastest by slack x the fleet's "
    "prefill time for the request, or any faster replica while the prefix's demand exceeds its "
    "holders; misses to the smallest near-fastest cache",
}


def policy_names() -> list[str]:
    return list(POLICIES)


def policy_option_names(name: str) -> frozenset[str]:
    """The keyword options policy ``name`` accepts (what ``--policy-option`` may set), besides
    ``rng`` and ``cost`` which :func:`build_policy` passes itself. Raises :class:`ConfigError`
    for an unknown name."""
    return frozenset(_parameters(_factory(name)).keys() - {"rng", "cost"})


def build_estimator(
    estimator: str = "approx",
    *,
    eviction_interval_s: float = 120.0,
    max_tree_tokens: int = 2**26,
    tree_capacity_tokens: int | None = None,
    block_size: int = 16,
) -> CacheEstimator:
    """A policy's cache estimator by kind: ``"approx"``, the router's record of what it sent
    (:class:`ApproxTrees`, trimmed to ``max_tree_tokens`` per replica every
    ``eviction_interval_s`` and, if set, to ``tree_capacity_tokens``), or ``"exact"``, the
    replicas' KV events (:class:`CacheMirror` in blocks of ``block_size``). Another kind is a
    :class:`ConfigError`."""
    if estimator == "approx":
        return ApproxTrees(eviction_interval_s=eviction_interval_s,
                           max_tree_tokens=max_tree_tokens, capacity_tokens=tree_capacity_tokens)
    if estimator == "exact":
        return CacheMirror(block_size)
    raise ConfigError(f"estimator must be 'approx' or 'exact', got {estimator!r}")


def build_policy(
    name: str,
    *,
    rng: random.Random | None = None,
    cost: CostModel | None = None,
    pins: Mapping[str, Iterable[ReplicaId]] | None = None,
    **options: Any,
) -> RoutingPolicy:
    """A fresh policy instance. ``rng`` goes to policies that draw, ``cost`` to those that
    predict time, ``pins`` wraps the result in :class:`TenantPinned`; other ``options`` are the
    policy's own keyword arguments and, for a policy with an estimator, the options of
    :func:`build_estimator` it lists (``estimator`` may also be a :class:`CacheEstimator`
    built by the caller). Unknown names or options raise :class:`ConfigError`."""
    factory = _factory(name)
    params = _parameters(factory)
    if rng is not None and "rng" in params:
        options["rng"] = rng
    if cost is not None and "cost" in params:
        options["cost"] = cost
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise ConfigError(
            f"policy {name!r} has no option(s) {', '.join(unknown)}; "
            f"it accepts: {', '.join(sorted(params)) or 'none'}"
        )
    for key, value in options.items():
        _check_kind(name, key, value, str(params[key].annotation))
    wanted = getattr(factory, "estimator_options", ())
    if wanted:
        given = {key: options[key] for key in wanted if key in options}
        for key in given.keys() - _parameters(factory, estimator=False).keys():
            del options[key]  # the estimator's alone
        kind = given.pop("estimator", getattr(factory, "default_estimator", "approx"))
        built = isinstance(kind, CacheEstimator)
        options["estimator"] = kind if built else build_estimator(kind, **given)
    policy = factory(**options)
    return TenantPinned(policy, pins) if pins else policy


def policy_defaults(name: str) -> dict[str, Any]:
    """The keyword options policy ``name`` accepts, with their defaults (``None`` where an
    option has none), found like :func:`build_policy` finds them."""
    factory = _factory(name)
    defaults = {key: None if p.default is p.empty else p.default
                for key, p in _parameters(factory).items()}
    if "estimator" in getattr(factory, "estimator_options", ()):
        defaults["estimator"] = getattr(factory, "default_estimator", "approx")
    return defaults


def _factory(name: str) -> PolicyFactory:
    factory = POLICIES.get(name)
    if factory is None:
        raise ConfigError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}")
    return factory


_KINDS: dict[str, tuple[type, ...]] = {"float": (int, float), "int": (int,), "str": (str,),
                                       "bool": (bool,)}


def _check_kind(policy: str, key: str, value: Any, annotation: str) -> None:
    """A caller's option of the wrong type (text where a number goes: ``slack=abc``,
    ``nan``) is a :class:`ConfigError` naming it, not a TypeError deep in a constructor.
    Annotations other than plain numbers, text and booleans are left to the policy."""
    parts = [part.strip() for part in annotation.split("|")]
    optional = "None" in parts
    named = [part for part in parts if part != "None"]
    if len(named) != 1 or named[0] not in _KINDS:
        return
    if value is None and optional:
        return
    wanted = named[0]
    ok = isinstance(value, _KINDS[wanted]) and (wanted == "bool" or not isinstance(value, bool))
    if not ok:
        words = {"float": "a number", "int": "an integer", "str": "text", "bool": "true or false"}
        raise ConfigError(
            f"policy {policy!r} option {key} must be {words[wanted]}"
            f"{' or None' if optional else ''}, got {value!r}"
        )


def _parameters(factory: PolicyFactory, *, estimator: bool = True
                ) -> dict[str, inspect.Parameter]:
    """The keyword options the factory takes, following ``**options`` up to the base class,
    then (with ``estimator``) those of :func:`build_estimator` it lists in
    ``estimator_options``; the first declaration of a name wins."""
    cls: Any = factory
    params: dict[str, inspect.Parameter] = {}
    for klass in getattr(cls, "__mro__", (cls,)):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        found = inspect.signature(init).parameters.values()
        for p in found:
            if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                params.setdefault(p.name, p)
        if not any(p.kind is p.VAR_KEYWORD for p in found):
            break
    if estimator:
        own = inspect.signature(build_estimator).parameters
        for key in getattr(cls, "estimator_options", ()):
            params.setdefault(key, own[key])
    return params
