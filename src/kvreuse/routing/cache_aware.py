"""Cache-aware routing: send a request where its longest cached prefix is, unless load says no.

Two load rules, chosen with ``balance``:

``"sglang"`` — SGLang router's rule (sgl-router ``policies/cache_aware.rs``), fleet-wide: if
``max_load - min_load > balance_abs_threshold`` **and** ``max_load > min_load ×
balance_rel_threshold`` over every eligible replica (load = in-flight requests), *every* request
goes to the least loaded replica, affinity is off for everyone until the imbalance clears.
Otherwise the replica with the longest match is chosen when ``match / prompt > cache_threshold``,
else the replica with the smallest tree. Defaults are those of ``sglang_router``'s ``RouterArgs``
(py_src/sglang_router/router_args.py): ``cache_threshold=0.3``, ``balance_abs_threshold=64``,
``balance_rel_threshold=1.5``, ``eviction_interval_secs=120``, ``max_tree_size=2**26``. (The Rust
``CacheAwareConfig::default`` differs — 0.5, 32, 1.0001, 60 s, 2**24 — and is what you get
when embedding the library without the launcher.)

``"bounded"`` (ours, the default) — per request: take the longest match (ties to the shorter
predicted TTFT); if its ratio is at most ``cache_threshold`` go to the least loaded replica; if
the chosen replica's predicted TTFT (queue delay + overhead + uncached / rate) exceeds the
fastest replica's by more than ``spill_threshold_s`` (seed 001: "cache-aware on three replicas
and a 200 ms spill threshold"), spill to the best match among replicas within the threshold.
Counting the request's own uncached prefill means a replica holding a long history is worth a
longer queue than one holding only the system prompt. One hot replica thus sheds only the
requests it cannot serve in time, and affinity stays on for every other request in the fleet.

The cache estimate is the router's own approximate trees (``cache_aware``) or the replicas' KV
events (``exact``); see :mod:`kvreuse.routing.estimators`. The rules themselves are in
:mod:`kvreuse.routing.load_rules`.
"""

from __future__ import annotations

from kvreuse.errors import ConfigError
from kvreuse.routing.base import (
    REPLICA_ID,
    CostModel,
    FleetView,
    PolicyBase,
    ReplicaId,
    RequestView,
    RoutingDecision,
)
from kvreuse.routing.estimators import ApproxTrees
from kvreuse.routing.events import KvEvent
from kvreuse.routing.load_rules import bounded_rule, sglang_rule
from kvreuse.routing.mirror import CacheMirror

BALANCE_RULES = ("bounded", "sglang")


class CacheAware(PolicyBase):
    """See the module docstring. ``estimator`` is ``"approx"`` or ``"exact"``."""

    name = "cache_aware"

    def __init__(
        self,
        *,
        estimator: str = "approx",
        balance: str = "bounded",
        cache_threshold: float = 0.3,
        spill_threshold_s: float = 0.2,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        eviction_interval_s: float = 120.0,
        max_tree_tokens: int = 2**26,
        tree_capacity_tokens: int | None = None,
        block_size: int = 16,
        cost: CostModel | None = None,
    ) -> None:
        if balance not in BALANCE_RULES:
            raise ConfigError(f"balance must be one of {BALANCE_RULES}, got {balance!r}")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ConfigError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if spill_threshold_s < 0:
            raise ConfigError(f"spill_threshold_s must be >= 0, got {spill_threshold_s}")
        if balance_rel_threshold < 1.0:
            raise ConfigError(f"balance_rel_threshold must be >= 1, got {balance_rel_threshold}")
        self.balance = balance
        self.cache_threshold = cache_threshold
        self.spill_threshold_s = spill_threshold_s
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cost = cost or CostModel()
        self.block_size = block_size
        self.trees: ApproxTrees | None = None
        self.mirror: CacheMirror | None = None
        # A gateway that checks the KV-event mirror against realized hits sets these: replicas
        # in ``suspects`` are then predicted from ``fallback`` (its own approximate trees, fed
        # by on_routed). Both unset in the simulator, whose mirror is never wrong.
        self.fallback: ApproxTrees | None = None
        self.suspects: frozenset[ReplicaId] = frozenset()
        if estimator == "approx":
            self.trees = ApproxTrees(
                eviction_interval_s=eviction_interval_s,
                max_tree_tokens=max_tree_tokens,
                capacity_tokens=tree_capacity_tokens,
            )
        elif estimator == "exact":
            self.mirror = CacheMirror(block_size)
            self.uses_kv_events = True
        else:
            raise ConfigError(f"estimator must be 'approx' or 'exact', got {estimator!r}")

    def predict(self, request: RequestView, fleet: FleetView) -> dict[ReplicaId, int]:
        """Each eligible replica's predicted cached prefix of the prompt, in tokens. ``trees``
        is looked up per call: a gateway may replace it (a shared index, gateway/shared_index)."""
        ids = tuple(map(REPLICA_ID, fleet.replicas))
        if self.trees is not None:
            return self.trees.predict(request, ids, fleet.now)
        assert self.mirror is not None
        predicted = self.mirror.predict(request, ids, fleet.now)
        if self.fallback is not None and self.suspects:
            approx = self.fallback.predict(request, ids, fleet.now)
            for replica in self.suspects:
                if replica in predicted:
                    predicted[replica] = approx[replica]
        return predicted

    def route(self, request: RequestView, fleet: FleetView) -> RoutingDecision | None:
        if not fleet.replicas:
            return None
        matched = self.predict(request, fleet)
        if self.balance == "sglang":
            size = self.trees.tree_tokens if self.trees is not None else self._mirror_blocks
            return sglang_rule(
                matched,
                fleet.replicas,
                request.prompt_tokens,
                size,
                self.cache_threshold,
                self.balance_abs_threshold,
                self.balance_rel_threshold,
            )
        return bounded_rule(
            matched,
            fleet.replicas,
            request.prompt_tokens,
            self.cost,
            self.cache_threshold,
            self.spill_threshold_s,
        )

    def _mirror_blocks(self, replica: ReplicaId) -> int:
        assert self.mirror is not None
        return self.mirror.cached_blocks(replica)

    def on_routed(self, request: RequestView, decision: RoutingDecision, now: float) -> None:
        if self.trees is not None:
            self.trees.record(request, decision.replica, now)
        if self.fallback is not None:
            self.fallback.record(request, decision.replica, now)

    def on_kv_event(self, event: KvEvent) -> None:
        if self.mirror is not None:
            self.mirror.apply(event)


class CacheAwareSGLang(CacheAware):
    """SGLang router's fleet-wide imbalance rule with its launcher defaults."""

    name = "cache_aware_sglang"

    def __init__(self, **options: object) -> None:
        options.setdefault("balance", "sglang")
        super().__init__(**options)  # type: ignore[arg-type]


class Exact(CacheAware):
    """Cache-aware routing on true replica contents from KV events (bounded rule)."""

    name = "exact"

    def __init__(self, **options: object) -> None:
        options.setdefault("estimator", "exact")
        super().__init__(**options)  # type: ignore[arg-type]
