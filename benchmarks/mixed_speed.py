"""One replica slower than the others: does the gateway find it and send it less?

A fleet of mixed hardware, or one replica degraded (a GPU at low clocks, a noisy neighbour),
is the case a single measured prefill speed per model gets wrong: the slow replica is seen as
average, is sent as many queued tokens as the others, and its requests wait longer. ``kvreuse
route`` measures each upstream's speed over its model's fleet from streamed first tokens
(kvreuse.routing.cost_fit.RelativeSpeeds) and divides its load by it. This script shows what
that changes, in separate processes on loopback:

* ``--engines`` (4) ``kvreuse engine`` replicas; the first ``--slow`` (1) prefill
  ``--slow-rate`` tokens a second (2,500), the others ``--rate`` (10,000), each after 15 ms;
* warm-up: 48 streamed completions of 100 to 800 unique tokens, four at a time;
* then ``--requests`` (240) streamed completions, Poisson arrivals at ``--rps`` (12) a second,
  60 % of them opening with one of 8 shared 1,500-token system prompts, each with 200 to
  1,500 tokens of its own (seeded by ``--seeds``).

Routers, each on fresh engines per seed: ``kvreuse`` (the default: ``relative_spill``,
measuring), ``kvreuse --fixed-prefill`` (routes on 10,000 tokens/s and 15 ms, every upstream
alike: the gateway before this measurement), ``kvreuse weight=`` (``--fixed-prefill`` with
the slow upstreams declared at their true weight: what an operator who knew would configure)
and the peers of ``--peers`` (smg) where ``make peers`` installed them.

Per run it prints the slow engines' measured speed over the others' (from ``/metrics``), the
share of prompt tokens the slow engines received, the engines' token hit rate and the
client's TTFT percentiles, then per router the mean over seeds.

Then the simulator's prediction of the same runs (``--replays`` per seed, 0 for none): each
seed's stream through ``kvreuse.sim`` as ``benchmarks/sim_vs_gateway.py`` models a gateway
(its :func:`gateway_fleet`, :func:`gateway_options`, :func:`sim_requests`), the engines'
parameters, the warm-up as 48 unmeasured requests four at a time, and the fleet's speeds
(``FleetConfig.prefill_speeds``) seen as each router sees them: measured from first tokens
(``kvreuse``), alike (``--fixed-prefill`` and the peers, whose rule, smg's
``cache_aware_smg``, knows no speeds) or known (``weight=``). A router is predicted within
range when the mean hit rate is within 3 points and the mean p95 within 25 % of the gateway's
(issue 15's bounds).

    PYTHONPATH=src .venv/bin/python benchmarks/mixed_speed.py --seeds 1,2,3
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvreuse.hitrate.prometheus import parse_exposition
from kvreuse.sim.summary import percentile
from kvreuse.testing.loadgen import Call, fleet_hits, run_calls, scrape
from kvreuse.testing.processes import PEERS_VENV, EngineSpec, Fleet, Process, free_port, wait_http

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvreuse.routing import build_policy
from kvreuse.sim import FleetSimulator, SimRequest, summarize
from prefill_speed import text_of, warm_up  # the prompts and warm-up it times
from sim_vs_gateway import (
    HIT_POINTS,
    P95_SHARE,
    gateway_fleet,
    gateway_options,
    kendall_tau,
    sim_requests,
)

SPEED_SERIES = "kvreuse_gateway_upstream_prefill_speed"
ROUTERS = ("kvreuse", "kvreuse --fixed-prefill", "kvreuse weight=")
SIMULATED = {"kvreuse": ("relative_spill", "measured"),
             "kvreuse --fixed-prefill": ("relative_spill", "alike"),
             "kvreuse weight=": ("relative_spill", "known"),
             "smg": ("cache_aware_smg", "alike"), "sglang-router": ("cache_aware_smg", "alike"),
             "vllm-router": ("cache_aware_smg", "alike")}
"""Per router: the simulator's policy for its rule and what it knows of the speeds."""
WARM_UP_GAP_S = 0.25  # the warm-up's groups of four, this far apart (each takes 0.05-0.3 s)


def workload(seed: int, requests: int, rps: float) -> list[Call]:
    """The seeded stream of the module docstring (the text differs per call, the shape not)."""
    rng = random.Random(seed)
    run = uuid.uuid4().hex
    prefixes = [text_of(1500, f"system{i}-{run}") for i in range(8)]
    calls, at = [], 0.0
    for i in range(requests):
        at += rng.expovariate(rps)
        prefix = prefixes[rng.randrange(8)] if rng.random() < 0.6 else ""
        prompt = prefix + text_of(rng.randint(200, 1500), f"{i:05d}{run[:8]}")
        calls.append(Call(at, "/v1/completions", json.dumps({
            "model": "sim", "prompt": prompt, "max_tokens": 8, "stream": True}).encode()))
    return calls


def with_weights(argv: list[str], weights: dict[str, float]) -> list[str]:
    """``argv`` of ``kvreuse route`` with ``,weight=W`` added to the ``--upstream`` flags of
    the named engines (flags carry ``,name=NAME``)."""
    out = list(argv)
    for i, flag in enumerate(out[:-1]):
        if flag == "--upstream":
            name = out[i + 1].split(",name=")[1].split(",")[0]
            if name in weights:
                out[i + 1] += f",weight={weights[name]:g}"
    return out


def slow_over_fast(gateway: Process, slow: set[str]) -> float | None:
    """The slow upstreams' mean measured speed over the others' (None: not exported)."""
    text = httpx.get(gateway.url + "/metrics", timeout=5).text
    speeds = {s.label("upstream"): s.value
              for s in parse_exposition(text, "gateway /metrics", only=[SPEED_SERIES])}
    slow_speeds = [v for k, v in speeds.items() if k in slow]
    fast_speeds = [v for k, v in speeds.items() if k not in slow]
    if not slow_speeds or not fast_speeds:
        return None
    return statistics.fmean(slow_speeds) / statistics.fmean(fast_speeds)


@dataclass(frozen=True, slots=True)
class Row:
    router: str
    seed: int
    measured: float | None
    slow_share: float
    hit_rate: float
    p50_ms: float
    p95_ms: float
    failed: int


def one_run(fleet: Fleet, router: str, seed: int, args: argparse.Namespace) -> Row:
    engines = []
    for i in range(args.engines):
        spec = EngineSpec(prefill_tokens_per_s=args.slow_rate if i < args.slow else args.rate,
                          overhead_ms=15.0, tpot_ms=2.0, events=False, cache_tokens=32_768)
        engines.append(fleet.start_engine(f"e{i}-{uuid.uuid4().hex[:6]}", spec, wait=False))
    for engine in engines:
        wait_http(engine)
    slow = {engine.name for engine in engines[:args.slow]}
    port = free_port()
    if router.startswith("kvreuse"):
        argv = fleet.gateway_argv(engines, port, policy="relative_spill", events=False)
        if router != "kvreuse":
            argv.append("--fixed-prefill")
        if router == "kvreuse weight=":
            argv = with_weights(argv, dict.fromkeys(slow, args.slow_rate / args.rate))
    else:
        argv = fleet.peer_argv(router, engines, port)
    gateway = fleet.spawn(f"{router.split()[0]}-{uuid.uuid4().hex[:6]}", argv,
                          url=f"http://127.0.0.1:{port}", port=port)
    urls = [engine.url for engine in engines]
    try:
        wait_http(gateway)
        asyncio.run(warm_up(gateway.url, 48))
        before = scrape(urls)
        results = asyncio.run(run_calls(workload(seed, args.requests, args.rps),
                                        lambda i, call: gateway.url))
        after = scrape(urls)
        measured = slow_over_fast(gateway, slow) if router == "kvreuse" else None
    finally:
        for proc in (gateway, *engines):
            fleet.forget(proc)
    hits = fleet_hits(before, after)
    loads = hits.per_engine_queries  # in the order of urls: the slow engines first
    slow_share = sum(loads[:args.slow]) / (sum(loads) or 1)
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None and r.status == 200]
    failed = sum(1 for r in results if r.status != 200 or r.error or r.ttft_s is None)
    return Row(router, seed, measured, slow_share, hits.hit_rate,
               statistics.median(ttfts) * 1000 if ttfts else float("nan"),
               percentile(ttfts, 0.95) * 1000 if ttfts else float("nan"), failed)


def simulated_stream(seed: int, args: argparse.Namespace) -> list[SimRequest]:
    """The warm-up (unmeasured, 48 prompts of 100 to 800 unique tokens, four at a time) and
    ``seed``'s stream, as the engines see them."""
    warm = [Call((i // 4) * WARM_UP_GAP_S, "/v1/completions", json.dumps({
        "model": "sim", "prompt": text_of(100 + (i * 137) % 700, uuid.uuid4().hex[:11]),
        "max_tokens": 2}).encode(), measured=False) for i in range(48)]
    start = 12 * WARM_UP_GAP_S + 0.5
    stream = [dataclasses.replace(call, at_s=start + call.at_s)
              for call in workload(seed, args.requests, args.rps)]
    warm_requests = sim_requests(warm, 2)
    return warm_requests + [dataclasses.replace(request, request_id=48 + i)
                            for i, request in enumerate(sim_requests(stream, 8))]


def simulate_run(router: str, seed: int, requests: Sequence[SimRequest],
                 args: argparse.Namespace, replay: int) -> Row:
    """One simulated run of ``router`` on ``requests`` (replays > 0 move every arrival by up
    to 5 ms, seeded, as gateway runs differ)."""
    policy, view = SIMULATED[router]
    if replay:
        rng = random.Random(seed * 1000 + replay)
        moved = [dataclasses.replace(r, arrival_s=r.arrival_s + rng.uniform(0, 0.005))
                 for r in requests]
        requests = sorted(moved, key=lambda r: r.arrival_s)
    speeds = ((args.slow_rate / args.rate,) * args.slow + (1.0,) * (args.engines - args.slow))
    fleet = gateway_fleet(args.engines, 32_768, args.rate)
    fleet = dataclasses.replace(
        fleet, replica=dataclasses.replace(fleet.replica, time_per_output_token_s=0.002),
        prefill_speeds=speeds, speed_view=view)
    label = f"kvreuse:{policy}" if router.startswith("kvreuse") else router
    built = build_policy(policy, rng=random.Random(seed),
                         **gateway_options(label, policy, 32_768))
    simulator = FleetSimulator(fleet, built)
    run = simulator.run(requests)
    summary = summarize(run)
    measured = [r for r in run.records if r.measured]
    slow_tokens = sum(r.prompt_tokens for r in measured if r.replica < args.slow)
    speeds_seen = simulator.measured_speeds()
    ids = [replica.replica_id for replica in simulator.replicas]
    ratio = (statistics.fmean(speeds_seen[i] for i in ids[:args.slow])
             / statistics.fmean(speeds_seen[i] for i in ids[args.slow:]))
    return Row(router, seed, ratio if view == "measured" else None,
               slow_tokens / (sum(r.prompt_tokens for r in measured) or 1),
               summary.token_hit_rate, summary.ttft_p50_s * 1000, summary.ttft_p95_s * 1000, 0)


def mean_row(router: str, rows: Sequence[Row]) -> Row:
    """``router``'s rows averaged (failures summed)."""
    mine = [row for row in rows if row.router == router]
    measured = [row.measured for row in mine if row.measured is not None]
    return Row(router, 0, statistics.fmean(measured) if measured else None,
               statistics.fmean(r.slow_share for r in mine),
               statistics.fmean(r.hit_rate for r in mine),
               statistics.fmean(r.p50_ms for r in mine),
               statistics.fmean(r.p95_ms for r in mine), sum(r.failed for r in mine))


def row_text(row: Row, label: str) -> str:
    measured = "" if row.measured is None else f"{row.measured:.2f}"
    return (f"| {row.router} | {label} | {measured} | {row.slow_share:.1%} | "
            f"{row.hit_rate:.1%} | {row.p50_ms:,.0f} | {row.p95_ms:,.0f} | {row.failed} |")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=4, help="kvreuse engines per run")
    parser.add_argument("--slow", type=int, default=1, help="of them, how many are slow")
    parser.add_argument("--rate", type=float, default=10_000.0,
                        help="the other engines' prefill tokens/s")
    parser.add_argument("--slow-rate", type=float, default=2_500.0,
                        help="the slow engines' prefill tokens/s")
    parser.add_argument("--requests", type=int, default=240,
                        help="streamed requests per run, after 48 of warm-up")
    parser.add_argument("--rps", type=float, default=12.0, help="Poisson arrivals a second")
    parser.add_argument("--seeds", default="1,2,3",
                        help="comma-separated: one workload and fresh engines per seed")
    parser.add_argument("--replays", type=int, default=3,
                        help="simulated runs per seed and router to compare (0: none)")
    parser.add_argument("--peers", default="smg",
                        help="peer routers, comma-separated ('' for none; needs make peers)")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if not 1 <= args.slow < args.engines or min(args.rate, args.slow_rate, args.rps) <= 0 \
            or args.requests < 1 or not seeds:
        parser.error("need 1 <= --slow < --engines, rates > 0, --requests >= 1, a seed")
    peers = [p for p in args.peers.split(",") if p]
    if peers and not (PEERS_VENV / "bin").is_dir():
        print(f"# peers skipped: {PEERS_VENV} is missing (make peers)", flush=True)
        peers = []
    routers = [*ROUTERS, *peers]
    print(f"# {args.engines} engines, {args.slow} at {args.slow_rate:,.0f} prefill tokens/s and "
          f"the others at {args.rate:,.0f}; {args.requests} streamed requests at "
          f"{args.rps:g}/s per run; seeds {', '.join(map(str, seeds))}", flush=True)
    print("| router | seed | slow engines' measured speed over the others' | slow engines' "
          "share of prompt tokens | hit rate | p50 TTFT ms | p95 TTFT ms | failed |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    rows: list[Row] = []
    with Fleet() as fleet:
        for seed in seeds:
            for router in routers:
                row = one_run(fleet, router, seed, args)
                rows.append(row)
                print(row_text(row, str(seed)), flush=True)
    print(f"\n# means over {len(seeds)} seeds (true speed ratio {args.slow_rate / args.rate:.2f})")
    print("| router | seeds | slow engines' measured speed over the others' | slow engines' "
          "share of prompt tokens | hit rate | p50 TTFT ms | p95 TTFT ms | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for router in routers:
        print(row_text(mean_row(router, rows), "mean"))
    if args.replays:
        predicted_all_within = print_predictions(routers, seeds, rows, args)
        print(f"\n# the simulator predicted {predicted_all_within} of "
              f"{sum(r in SIMULATED for r in routers)} routers within range")
    return 1 if any(row.failed for row in rows) else 0


def print_predictions(routers: Sequence[str], seeds: Sequence[int], rows: Sequence[Row],
                      args: argparse.Namespace) -> int:
    """The simulator's means over ``--replays`` per seed against the gateway's; returns how
    many routers it predicted within range."""
    simulated: list[Row] = []
    for seed in seeds:
        requests = simulated_stream(seed, args)
        for router in [r for r in routers if r in SIMULATED]:
            simulated += [simulate_run(router, seed, requests, args, replay)
                          for replay in range(args.replays)]
    print(f"\n# the simulator's prediction: means over {len(seeds)} seeds x {args.replays} "
          "replays, against the gateway's means")
    print("| router | simulated: slow engines' measured speed over the others' | slow engines' "
          "share of prompt tokens | hit rate | p95 TTFT ms | gateway: hit rate | p95 TTFT ms "
          "| hit rate within 3 points | p95 within 25 % |")
    print("|---|---|---|---|---|---|---|---|---|")
    within = 0
    compared = [r for r in routers if r in SIMULATED]
    p95s: list[tuple[float, float]] = []
    for router in compared:
        sim, real = mean_row(router, simulated), mean_row(router, rows)
        p95s.append((sim.p95_ms, real.p95_ms))
        hit_ok = abs(sim.hit_rate - real.hit_rate) <= HIT_POINTS
        p95_ok = abs(sim.p95_ms - real.p95_ms) <= P95_SHARE * real.p95_ms
        within += hit_ok and p95_ok
        measured = "" if sim.measured is None else f"{sim.measured:.2f}"
        print(f"| {router} | {measured} | {sim.slow_share:.1%} | {sim.hit_rate:.1%} | "
              f"{sim.p95_ms:,.0f} | {real.hit_rate:.1%} | {real.p95_ms:,.0f} | "
              f"{'yes' if hit_ok else 'NO'} | {'yes' if p95_ok else 'NO'} |", flush=True)
    if len(p95s) > 1:
        tau = kendall_tau([a for a, _ in p95s], [b for _, b in p95s])
        print(f"\n# routers ranked by p95 TTFT, simulator against gateway: Kendall tau {tau:.2f}")
    return within


if __name__ == "__main__":
    sys.exit(main())
