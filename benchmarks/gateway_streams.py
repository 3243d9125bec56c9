"""routers.py's workloads on many seeded streams, in the simulator as the gateway runs them.

A gateway verdict (``benchmarks/routers.py``) is measured on one seeded stream per scenario
(``--seed 7``): one draw of documents, system prompts and arrival times. Repeated gateway runs
average out timing, not the draw, and the draw decides a lot: at 12,288-token caches
``relative_spill``'s two miss orders (smallest cache first, fewest in flight first) differ by 5
points on contracts at seed 7 and by 0.1 over twelve seeds. Real gateway runs cost about 36 s
per router, scenario and stream; this replays each scenario's stream for every seed of
``--seeds`` through the simulator's model of that fleet (``benchmarks/sim_vs_gateway.py``'s:
the engines' parameters, the gateway's index budget for ``kvreuse:`` policies, the HTTP lags;
at 12,288-token caches each of its rows lands within ±3 points and ±25 % of p95 of the
gateway's, docs/performance.md), and
prints per seed each router's hit rate and p95 TTFT (the median of ``--replays`` replays, all
but the first with arrivals moved by up to 5 ms, as gateway runs differ by timing), then the
means over the seeds and, per router, on how many streams the candidate's hit rate was at least
that router's. Routers are routers.py's names: ``kvreuse:POLICY`` or a peer whose rule the
simulator runs (``smg``, ``sglang-router``, ``vllm-router``: ``cache_aware_smg``).

    PYTHONPATH=src .venv/bin/python benchmarks/gateway_streams.py --seeds 1-12 \\
        --cache-tokens 12288 --routers kvreuse:relative_spill,smg
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvreuse.errors import ConfigError
from kvreuse.routing import build_policy
from kvreuse.sim.config import FleetConfig
from kvreuse.sim.fleet import FleetSimulator
from kvreuse.sim.requests import SimRequest, jittered
from kvreuse.sim.summary import summarize
from sim_vs_gateway import (
    PEER_RULES,
    gateway_cost,
    gateway_fleet,
    gateway_options,
    routers_module,
    sim_requests,
)

routers_bench = routers_module()

JITTER_S = 0.005


@dataclass(frozen=True, slots=True)
class StreamFigures:
    """One router on one seeded stream: the median over the replays."""

    hit_rate: float
    p95_ms: float


def policy_of(router: str) -> str:
    """The simulator policy that plays ``router`` (routers.py's name); a usage error names the
    routers it can play."""
    if router.startswith("kvreuse:"):
        return routers_bench.kvreuse_policy(router)[0]
    if router in PEER_RULES:
        return PEER_RULES[router]
    raise ValueError(f"no simulator rule plays {router!r}: give kvreuse:POLICY or one of "
                     f"{', '.join(sorted(PEER_RULES))}")


def replays_of(scenario: str, seed: int, args: argparse.Namespace) -> list[list[SimRequest]]:
    """The scenario's stream for ``seed`` as the engines see it, then ``--replays`` - 1 copies
    with arrivals moved by up to ``JITTER_S``."""
    calls = routers_bench.scenario_calls(scenario, rate=args.rate, warmup_s=args.warmup,
                                         duration_s=args.duration, seed=seed,
                                         max_tokens=args.max_tokens)
    requests = sim_requests(calls, args.max_tokens)
    return [requests] + [jittered(requests, replay, JITTER_S)
                         for replay in range(1, args.replays)]


def measure(router: str, replays: Sequence[list[SimRequest]], fleet: FleetConfig,
            fixed_prefill: bool = False) -> StreamFigures:
    """``router``'s rule on each replay of one stream: the medians."""
    policy = policy_of(router)
    options = gateway_options(router, policy, fleet.replica.pool_tokens)
    cost = gateway_cost(router, fleet, fixed_prefill)
    summaries = [summarize(FleetSimulator(
        fleet, build_policy(policy, rng=random.Random(0), cost=cost, **options)).run(stream))
        for stream in replays]
    return StreamFigures(statistics.median(s.token_hit_rate for s in summaries),
                         statistics.median(s.ttft_p95_s * 1000 for s in summaries))


def cell(figures: StreamFigures) -> str:
    return f"{figures.hit_rate:.1%} / {figures.p95_ms:.0f} ms"


def report(scenario: str, seeds: Sequence[int], routers: Sequence[str],
           figures: dict[tuple[str, int], StreamFigures]) -> list[str]:
    """The scenario's table: a row per seed, the means, and the candidate's (the first
    router's) count of streams at or above each other router's hit rate."""
    lines = [f"| {scenario} seed | " + " | ".join(f"{r} hit / p95" for r in routers) + " |",
             "|---|" + "---|" * len(routers)]
    for seed in seeds:
        lines.append(f"| {seed} | " + " | ".join(cell(figures[r, seed]) for r in routers) + " |")
    means = {r: StreamFigures(statistics.fmean(figures[r, s].hit_rate for s in seeds),
                              statistics.fmean(figures[r, s].p95_ms for s in seeds))
             for r in routers}
    lines.append(f"| mean of {len(seeds)} | " + " | ".join(cell(means[r]) for r in routers)
                 + " |")
    candidate = routers[0]
    for other in routers[1:]:
        ahead = sum(figures[candidate, s].hit_rate >= figures[other, s].hit_rate for s in seeds)
        hit_diff = (means[candidate].hit_rate - means[other].hit_rate) * 100
        p95_diff = round(means[candidate].p95_ms - means[other].p95_ms)  # never "-0 ms"
        lines.append(f"{scenario}: {candidate} at or above {other}'s hit rate on {ahead} of "
                     f"{len(seeds)} streams; means {hit_diff:+.2f} points, p95 {p95_diff:+d} ms")
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=routers_bench.parse_seeds, default=(1, 2, 3, 4, 5, 6),
                        metavar="N,N-M,...", help="the streams (default 1-6)")
    parser.add_argument("--routers", default="kvreuse:relative_spill,smg",
                        help="routers.py names; the first is the candidate")
    parser.add_argument("--scenarios", default="belgavi,contracts,surge")
    parser.add_argument("--replays", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--cache-tokens", type=int, default=32_768)
    parser.add_argument("--prefill-tokens-per-s", type=float, default=20_000.0)
    parser.add_argument("--rate", type=float, default=16.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--fixed-prefill", action="store_true",
                        help="model kvreuse gateways run with --fixed-prefill: their policies "
                        "on 10,000 tokens/s and 15 ms, not the engines' measured speed")
    args = parser.parse_args(argv)
    args.routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    if args.replays < 1:
        parser.error(f"--replays must be at least 1, not {args.replays}")
    if not (args.rate > 0 and args.duration > 0 and args.warmup >= 0 and args.max_tokens >= 1):
        parser.error("--rate and --duration must be > 0, --warmup >= 0 and --max-tokens >= 1")
    try:
        gateway_fleet(args.replicas, args.cache_tokens, args.prefill_tokens_per_s)
    except ConfigError as exc:
        parser.error(str(exc))
    try:
        for router in args.routers:
            policy_of(router)
    except ValueError as exc:
        parser.error(str(exc))
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in args.scenarios if s not in routers_bench.SCENARIOS]
    if unknown or not args.scenarios:
        parser.error(f"--scenarios: unknown {unknown}; routers.py has "
                     f"{', '.join(routers_bench.SCENARIOS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    speed = ("10,000 tokens/s (--fixed-prefill)" if args.fixed_prefill
             else "the engines' speed")
    print(f"# {len(args.scenarios)} scenarios x {len(args.seeds)} streams x "
          f"{len(args.routers)} routers x {args.replays} replays; cache {args.cache_tokens:,} "
          f"tokens x {args.replicas} replicas; kvreuse gateways on {speed}", flush=True)
    fleet = gateway_fleet(args.replicas, args.cache_tokens, args.prefill_tokens_per_s)
    for scenario in args.scenarios:
        figures = {}
        for seed in args.seeds:
            replays = replays_of(scenario, seed, args)
            for router in args.routers:
                figures[router, seed] = measure(router, replays, fleet, args.fixed_prefill)
            print(f"# {scenario} seed {seed}: " + "; ".join(
                f"{r} {cell(figures[r, seed])}" for r in args.routers), flush=True)
        print()
        for line in report(scenario, args.seeds, args.routers, figures):
            print(line)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
