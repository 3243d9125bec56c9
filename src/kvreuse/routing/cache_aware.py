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

``"smg"`` — what the Rust router does today (smg 1.13's and sglang-router 0.3's
``policies/cache_aware.rs``, ``select_worker_with_text``): the same imbalance switch and
threshold, but a miss goes to the least loaded replica (fewest in flight, the first on ties),
not to the smallest tree, although that file's header comment still says "smallest tree size".
Measured: through the gateway (benchmarks/routers.py) sglang-router 0.3.2 and smg 1.13.0 reach
the same hit rate and load spread to the digit as this rule's bounded cousin ``cache_aware``
(which also sends misses to the least loaded replica), and 0.3–6 points under ``"sglang"``.

``"bounded"`` (ours, the default) — per request: take the longest match (ties to the shorter
predicted TTFT); if its ratio is at most ``cache_threshold`` go to the least loaded replica; if
the chosen replica's predicted TTFT (queue delay + overhead + uncached / rate) exceeds the
fastest replica's by more than ``spill_threshold_s`` (seed 001: "cache-aware on three replicas
and a 200 ms spill threshold"), spill to the best match among replicas within the threshold.
Counting the request's own uncached prefill means a replica holding a long history is worth a
longer queue than one holding only the system prompt. One hot replica thus sheds only the
requests it cannot serve in time, and affinity stays on for every other request in the fleet.

The cache estimate (a :class:`~kvreuse.routing.base.CacheEstimator`) is the router's own
approximate trees (``cache_aware``) or the replicas' KV events (``exact``); see
:mod:`kvreuse.routing.approx_trees`. The rules themselves are in :mod:`kvreuse.routing.load_rules`.
"""

from __future__ import annotations

from kvreuse.errors import ConfigError, require_at_least
from kvreuse.routing.base import (
    CacheEstimator,
    CostModel,
    EstimatorPolicy,
    FleetView,
    RequestView,
    RoutingDecision,
)
from kvreuse.routing.load_rules import bounded_rule, sglang_rule

BALANCE_RULES = ("bounded", "sglang", "smg")


class CacheAware(EstimatorPolicy):
    """See the module docstring. ``block_size``: the engines' (the size of an index in blocks,
    for the gateway's metrics)."""

    name = "cache_aware"

    def __init__(
        self,
        *,
        estimator: CacheEstimator,
        balance: str = "bounded",
        cache_threshold: float = 0.3,
        spill_threshold_s: float = 0.2,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        block_size: int = 16,
        cost: CostModel | None = None,
    ) -> None:
        if balance not in BALANCE_RULES:
            raise ConfigError(f"balance must be one of {BALANCE_RULES}, got {balance!r}")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ConfigError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        require_at_least("spill_threshold_s", spill_threshold_s, 0)
        require_at_least("balance_rel_threshold", balance_rel_threshold, 1)
        self.balance = balance
        self.cache_threshold = cache_threshold
        self.spill_threshold_s = spill_threshold_s
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cost = cost or CostModel()
        self.block_size = block_size
        super().__init__(estimator)

    def route(self, request: RequestView, fleet: FleetView) -> RoutingDecision | None:
        if not fleet.replicas:
            return None
        matched = self.predict(request, fleet)
        if self.balance != "bounded":
            return sglang_rule(
                matched,
                fleet.replicas,
                request.prompt_tokens,
                self.estimator.cached_blocks,
                self.cache_threshold,
                self.balance_abs_threshold,
                self.balance_rel_threshold,
                self.balance == "smg",
            )
        return bounded_rule(
            matched,
            fleet.replicas,
            request.prompt_tokens,
            self.cost,
            self.cache_threshold,
            self.spill_threshold_s,
        )


class CacheAwareSGLang(CacheAware):
    """SGLang router's fleet-wide imbalance rule with its launcher defaults."""

    name = "cache_aware_sglang"

    def __init__(self, **options: object) -> None:
        options.setdefault("balance", "sglang")
        super().__init__(**options)  # type: ignore[arg-type]


class CacheAwareSmg(CacheAware):
    """The Rust SGLang router's rule as smg 1.13 and sglang-router 0.3 run it: SGLang's
    imbalance switch, misses to the least loaded replica, the launcher defaults."""

    name = "cache_aware_smg"

    def __init__(self, **options: object) -> None:
        options.setdefault("balance", "smg")
        super().__init__(**options)  # type: ignore[arg-type]


class Exact(CacheAware):
    """Cache-aware routing on true replica contents from KV events (bounded rule)."""

    name = "exact"
    default_estimator = "exact"
