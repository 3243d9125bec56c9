"""Simulated requests per wall-clock second: belgavi, and the Mooncake trace over 8 replicas.

Targets (issue 3): at least 20,000 simulated req/s on belgavi (Vidur manages about 100), and the
whole Mooncake trace over 8 replicas in under 3 s. Workload generation and trace parsing are timed
separately from the simulation itself. Run: ``.venv/bin/python benchmarks/sim_speed.py``.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from kvreuse.routing import build_policy
from kvreuse.sim import FleetConfig, FleetSimulator, ReplicaConfig
from kvreuse.sim.scenarios import get_scenario
from kvreuse.sim.trace import compute_bounds, parse_trace

TRACE = Path(__file__).resolve().parents[1] / "../shared/data/mooncake_synthetic_trace.jsonl"


def belgavi(scale: float) -> None:
    scenario = get_scenario("belgavi")
    start = time.perf_counter()
    requests = scenario.requests(0, "", scale)
    generate_s = time.perf_counter() - start
    print(f"belgavi x{scale:g}: {len(requests):,} requests generated in {generate_s:.2f} s")
    for spec in scenario.runs:
        if spec.variant:
            continue
        options = dict(scenario.policy_options.get(spec.policy, {}))
        policy = build_policy(spec.policy, rng=random.Random(0), **options)
        sim = FleetSimulator(scenario.fleet(spec.replicas, spec.variant), policy)
        start = time.perf_counter()
        sim.run(requests)
        elapsed = time.perf_counter() - start
        print(
            f"  {spec.policy:<20} x{spec.replicas}: {len(requests) / elapsed:>9,.0f} simulated "
            f"req/s ({elapsed:.2f} s)"
        )


def trace(path: Path, replicas: int = 8, cache_tokens: int = 200_000) -> None:
    if not path.exists():
        print(f"trace {path} not found; skipping")
        return
    start = time.perf_counter()
    with path.open() as lines:
        requests = parse_trace(lines)
    parse_s = time.perf_counter() - start
    print(f"mooncake trace: {len(requests):,} requests parsed in {parse_s:.2f} s")
    start = time.perf_counter()
    compute_bounds(requests, replicas, cache_tokens)
    print(f"  bounds (infinite + pooled LRU): {time.perf_counter() - start:.2f} s")
    for name in ("round_robin", "prefix_hash", "cache_aware", "exact"):
        config = FleetConfig(
            replicas, ReplicaConfig(pool_tokens=cache_tokens), kv_event_lag_s=0.0
        )
        sim = FleetSimulator(config, build_policy(name))
        start = time.perf_counter()
        sim.run(requests)
        elapsed = time.perf_counter() - start
        print(f"  {name:<20} x{replicas}: whole trace in {elapsed:.2f} s "
              f"({len(requests) / elapsed:,.0f} req/s)")


if __name__ == "__main__":
    belgavi(float(sys.argv[1]) if len(sys.argv) > 1 else 5.0)
    trace(TRACE)
