"""Fleet planning on a trace: which replicas × policy × cache size × knob meets the SLOs cheapest.

A *cell* is one simulated fleet: a policy (with one value of its knob, :data:`KNOBS`), a replica
count and a KV pool per replica. :func:`run_cell` simulates it on the trace (a pure function of
the cell, the traffic and the replica constants, so serial, process-pool and Ray runs give the
same results) and measures what SLOs are written on (:data:`SLO_METRICS`): nearest-rank TTFT
p95 and p99 and the mean queue delay (TTFT less the request's own prefill time).

:func:`choose` picks the cell that meets every SLO with the fewest replicas, then the least
prefill GPU time, then the smallest pool; :func:`pareto_front` keeps the cells no other cell
beats on all of replicas, prefill GPU time and the first SLO's metric. Ties are broken by the
cell's key, so the choice never depends on the order cells finished in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvreuse.errors import ConfigError, PoolTooSmallError, require_at_least
from kvreuse.routing import DEFAULT_POLICY, POLICIES
from kvreuse.routing.base import CostModel
from kvreuse.sim.config import FleetConfig, ReplicaConfig, check_prefill_speeds, speeds_for
from kvreuse.sim.requests import SimRequest
from kvreuse.sim.runner import check_fits, simulate
from kvreuse.sim.summary import measured, percentile, prefill_cost_s, summarize
from kvreuse.sim.units import TraceUnits

SLO_METRICS: dict[str, str] = {
    "ttft_p95": "95th percentile time to first token, seconds",
    "ttft_p99": "99th percentile time to first token, seconds",
    "mean_queue": "mean queue delay (TTFT less the request's own prefill), seconds",
}

KNOBS: dict[str, tuple[str, tuple[float | None, ...]]] = {
    "cache_aware": ("spill_threshold_s", (0.1, 0.2, 0.5)),
    "exact": ("spill_threshold_s", (0.1, 0.2, 0.5)),
    "cache_aware_sglang": ("cache_threshold", (0.3, 0.5)),
    "cache_aware_smg": ("cache_threshold", (0.3, 0.5)),
    "prefix_hash": ("overload", (1.25, 2.0)),
    "relative_spill": ("slack", (0.5, 8.0)),
}
"""Each policy's one knob the plan searches, and its default values to try (``--knob``
replaces them). Policies not listed have no knob."""

DEFAULT_POLICIES = (
    "round_robin", "least_load", "prefix_hash", "cache_aware", "exact", DEFAULT_POLICY
)


@dataclass(frozen=True, slots=True)
class Slo:
    """``metric <= limit_s``."""

    metric: str
    limit_s: float

    def __str__(self) -> str:
        return f"{self.metric}={self.limit_s:g}"


def parse_slo(text: str) -> Slo:
    """``ttft_p95=0.5`` -> Slo; the error names the accepted metrics."""
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or name not in SLO_METRICS:
        raise ConfigError(
            f"--slo takes METRIC=SECONDS with METRIC one of {', '.join(SLO_METRICS)}; got {text!r}"
        )
    try:
        limit = float(value)
    except ValueError:
        raise ConfigError(f"--slo {name}: {value!r} is not a number of seconds") from None
    if not math.isfinite(limit) or limit <= 0:
        raise ConfigError(f"--slo {name} must be a finite number of seconds > 0, got {value}")
    return Slo(name, limit)


@dataclass(frozen=True, slots=True)
class Cell:
    """One fleet to simulate. ``knob`` is ``None`` for policies without one;
    ``prefill_speeds`` are its first replicas' speeds (``FleetConfig.prefill_speeds``: the rest
    at 1, measured by the router as ``kvreuse route`` does), empty for a fleet of alike ones."""

    policy: str
    replicas: int
    cache_tokens: int
    knob: float | None = None
    prefill_speeds: tuple[float, ...] = ()

    @property
    def knob_name(self) -> str | None:
        entry = KNOBS.get(self.policy)
        return None if entry is None else entry[0]

    def options(self) -> dict[str, Any]:
        name = self.knob_name
        return {} if name is None else {name: self.knob}

    def key(self) -> str:
        """Stable text naming the cell (cache file names, tie-breaks)."""
        knob = "" if self.knob_name is None else f" {self.knob_name}={self.knob}"
        speeds = (f" speeds={','.join(map(repr, self.prefill_speeds))}"
                  if self.prefill_speeds else "")
        return f"{self.policy} x{self.replicas} cache={self.cache_tokens}{knob}{speeds}"


@dataclass(frozen=True, slots=True)
class CellResult:
    """What one cell measured. Times in seconds."""

    cell: Cell
    requests: int
    token_hit_rate: float
    prefill_gpu_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    ttft_p99_s: float
    mean_queue_s: float

    def metric(self, name: str) -> float:
        return {
            "ttft_p95": self.ttft_p95_s,
            "ttft_p99": self.ttft_p99_s,
            "mean_queue": self.mean_queue_s,
        }[name]

    def meets(self, slos: Sequence[Slo]) -> bool:
        return all(self.metric(s.metric) <= s.limit_s for s in slos)

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.cell.policy,
            "replicas": self.cell.replicas,
            "cache_tokens": self.cell.cache_tokens,
            "knob": self.cell.knob_name,
            "knob_value": self.cell.knob,
            "prefill_speeds": list(self.cell.prefill_speeds),
            "requests": self.requests,
            "token_hit_rate": self.token_hit_rate,
            "prefill_gpu_s": self.prefill_gpu_s,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p95_s": self.ttft_p95_s,
            "ttft_p99_s": self.ttft_p99_s,
            "mean_queue_s": self.mean_queue_s,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CellResult:
        knob = data["knob_value"]
        cell = Cell(data["policy"], int(data["replicas"]), int(data["cache_tokens"]),
                    None if knob is None else float(knob),
                    tuple(float(v) for v in data.get("prefill_speeds", ())))
        return cls(
            cell, int(data["requests"]), float(data["token_hit_rate"]),
            float(data["prefill_gpu_s"]), float(data["ttft_p50_s"]), float(data["ttft_p95_s"]),
            float(data["ttft_p99_s"]), float(data["mean_queue_s"]),
        )


def grid(
    policies: Iterable[str],
    replicas: Iterable[int],
    cache_tokens: Iterable[int],
    knob_values: Sequence[float] | None = None,
    prefill_speeds: tuple[float, ...] = (),
) -> list[Cell]:
    """Every cell of the search, in a fixed order. ``knob_values`` replaces each knobbed
    policy's default values; ``prefill_speeds`` are every fleet's first replicas' speeds."""
    check_prefill_speeds(prefill_speeds)
    cells = []
    for policy in policies:
        if policy not in POLICIES:
            raise ConfigError(f"unknown policy {policy!r}; choose from: {', '.join(POLICIES)}")
        entry = KNOBS.get(policy)
        values: Sequence[float | None] = (
            (None,) if entry is None else (tuple(knob_values) if knob_values else entry[1])
        )
        for n in replicas:
            require_at_least("--replicas", n, 1)
            for cache in cache_tokens:
                require_at_least("--cache-tokens", cache, 1)
                for value in values:
                    cells.append(Cell(policy, n, cache, value, prefill_speeds))
    return cells


def caches_too_small(
    cache_tokens: Iterable[int],
    requests: Sequence[SimRequest],
    units: TraceUnits,
    replica: ReplicaConfig,
) -> dict[int, PoolTooSmallError]:
    """The cache sizes whose pool cannot hold the largest of ``requests`` even alone, each with
    the error simulating it would raise (figures in tokens). O(sizes × requests)."""
    from dataclasses import replace

    too_small = {}
    for cache in cache_tokens:
        config = FleetConfig(1, replace(replica, pool_tokens=cache), kv_event_lag_s=0.0)
        try:
            check_fits(config, requests, units)
        except PoolTooSmallError as exc:
            too_small[cache] = exc
    return too_small


def run_cell(
    cell: Cell,
    requests: Sequence[SimRequest],
    units: TraceUnits,
    replica: ReplicaConfig,
    seed: int = 0,
) -> CellResult:
    """Simulate ``cell`` on ``requests``; ``replica`` gives the constants other than the pool."""
    from dataclasses import replace

    config = FleetConfig(
        cell.replicas, replace(replica, pool_tokens=cell.cache_tokens), kv_event_lag_s=0.0,
        prefill_speeds=speeds_for(cell.prefill_speeds, cell.replicas),
    )
    cost = CostModel(
        prefill_tokens_per_s=replica.prefill_tokens_per_s, overhead_s=replica.overhead_s
    )
    run = simulate(
        cell.policy, cell.options(), config, requests, seed, units=units, cost=cost
    )
    summary = summarize(run)
    records = measured(run)
    ttfts = [r.ttft_s for r in records]
    queue = [max(0.0, r.ttft_s - prefill_cost_s(run, r)) for r in records]
    return CellResult(
        cell=cell,
        requests=len(records),
        token_hit_rate=summary.token_hit_rate,
        prefill_gpu_s=sum(prefill_cost_s(run, r) for r in records),
        ttft_p50_s=summary.ttft_p50_s,
        ttft_p95_s=summary.ttft_p95_s,
        ttft_p99_s=percentile(ttfts, 0.99),
        mean_queue_s=sum(queue) / len(queue) if queue else 0.0,
    )


def _rank(result: CellResult) -> tuple[int, float, int, str]:
    cell = result.cell
    return (cell.replicas, result.prefill_gpu_s, cell.cache_tokens, cell.key())


def choose(results: Iterable[CellResult], slos: Sequence[Slo]) -> CellResult | None:
    """The cell meeting every SLO with the fewest replicas, then the least prefill GPU time;
    ``None`` when no cell meets them."""
    meeting = [r for r in results if r.meets(slos)]
    return min(meeting, key=_rank) if meeting else None


def pareto_front(results: Sequence[CellResult], slos: Sequence[Slo]) -> list[CellResult]:
    """Cells that no other cell beats (or ties) on replicas, prefill GPU time and the first
    SLO's metric all at once, sorted by replicas then GPU time. O(cells²)."""
    metric = slos[0].metric if slos else "ttft_p95"

    def point(r: CellResult) -> tuple[float, float, float]:
        return (float(r.cell.replicas), r.prefill_gpu_s, r.metric(metric))

    points = [point(r) for r in results]
    front = []
    for i, result in enumerate(results):
        mine = points[i]
        dominated = any(
            all(o <= m for o, m in zip(other, mine, strict=True)) and other != mine
            for j, other in enumerate(points)
            if j != i
        )
        if not dominated:
            front.append(result)
    return sorted(front, key=_rank)
