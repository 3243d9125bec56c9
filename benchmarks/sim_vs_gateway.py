"""Does the simulator predict the gateway? (issue 15, item 4)

Reads a ``benchmarks/routers.py --json`` file (the gateway's measured figures per scenario and
router), rebuilds each scenario's very request stream (same seed, arrival times, rendered
prompts: the text approximation of one token per 4 bytes that ``kvreuse engine`` and the
gateway use), runs it through ``kvreuse.sim`` with the engines' parameters (``kvreuse engine``:
vLLM's block pool of ``--cache-tokens`` in 16-token blocks, 15 ms overhead, the run's prefill
rate, 5 ms per output token, ``--max-tokens`` output tokens) and compares, per policy:

* token hit rate within ±3 points of the gateway's (engines' counters after warm-up);
* p95 TTFT within ±25 % of the client-side p95;
* the ranking of policies by hit rate and by p95 (Kendall's tau-b, target >= 0.8), where two
  figures closer than the gateway's own run-to-run noise rank as equal in either series
  (``--tie-points``, default 1 point; ``--tie-share``, default 10 % of p95). Measured: routers
  that place every request alike (same hit rate and load spread to the digit) measured p95s up
  to 10 % apart in one run (belgavi: ``kvreuse:cache_aware`` 70.4 ms, ``kvreuse:exact`` 75.1,
  ``kvreuse:cache_aware_smg`` 77.7), and two runs of the same load-sensitive policy differed by
  up to 3.6 points of hit rate (``kvreuse:least_load`` on contracts: 35.9 and 39.5 %;
  ``kvreuse:llm_d``, which breaks ties at random: 79.2 and 76.1 %), so smaller differences
  say nothing about which policy is better. The tau with exact ties only is printed beside
  it.

``kvreuse:NAME`` rows are simulated with policy NAME (``block_size=16`` where the policy takes
one, as the gateway run passed it; trees bounded by the gateway's index budget, 2 x the engines'
cache, where the policy keeps its own: :func:`gateway_options`; on the engines' prefill speed,
which the gateway measures, unless the run was ``--fixed-prefill``: :func:`gateway_cost`);
``sglang-router``, ``smg`` and ``vllm-router`` with ``cache_aware_smg``, the rule their Rust
code runs; other peers have no simulator rule and are skipped. The simulator's fleet counts
queues as the gateway does (``load_view="router"``) and hears of each first token
``--first-byte-lag-ms`` (2) after the engine made it, the HTTP hop back to the router: with 0,
``cost`` on belgavi is predicted at 80.8 % hit rate and a 93 ms p95 against the 83.0–83.1 % and
68–74 ms the gateway measured in five runs; lags of 1, 2, 3 and 5 ms predict 83.1–83.2 % and 68
ms; of the nine other rows it moves, every hit rate moving by more than half a point moves
toward the gateway's, and two p95s move 4–5 % away (surge ``exact``, ``cost``;
docs/performance.md). It hears of each response's end ``--last-byte-lag-ms`` (4) after the
engine's last token: a router counting requests in flight sees them that much longer (the real
engines' event loops, the HTTP hops). On recorded runs the gateway's own total time per request
exceeds the simulator's on the same placements by a median of 8-12 ms, and the lag was 8 ms
until the session of 2026-12-04. On the eighteen streams measured that day (docs/performance.md,
"The simulator's two misses on contracts"), 4 ms put 66 of 66 rows within range and 18 of 18
rankings at tau >= 0.8, against 63 and 16 with 8 ms. Only rows of routers sending misses to the
fewest requests in flight move: whether a request that ended a few ms ago still counts decides
those misses. On contracts at seed 1 that rule is chaotic at that scale, 70.9-76.6 % over twenty
replays jittered by 5 ms. ``--replays N`` simulates each row N times, all but the first with
every arrival moved by up to ``--jitter-ms`` (5), and compares the medians: on contracts at
12,288 tokens a policy's hit rate moves by up to 6 points between such replays, as it does
between gateway runs.

Why the bound and the lag (docs/performance.md): replaying a recorded gateway run's placements
and asking the simulator's policy, fed the same history, where it would have sent each
request, it agreed on 316-382 of 403 cache hits and 58-90 of 99 misses with unbounded trees,
and on every hit and 109-115 of 119-126 misses with the gateway's bound; each remaining miss
checked went elsewhere because the gateway still counted a request in flight that the
simulator's faster engine had finished 7-43 ms before.

    PYTHONPATH=src .venv/bin/python benchmarks/sim_vs_gateway.py artifacts/bench/routers.json
    ... benchmarks/sim_vs_gateway.py run1.json run2.json run3.json   # medians of three runs

Runs made with ``routers.py --record DIR`` (kvreuse gateways record each request's upstream)
add a second table: the simulator replaying the gateway's own placements
(:class:`RecordedPlacement`), which judges its engines and caches apart from its routing. On
contracts at 12,288 tokens it lands within 0.6 points and 12 % of p95 of 13 recorded runs
(``cache_aware``, ``cache_aware_smg``, ``relative_spill``) whose own-policy predictions were
1.5-3.5 points off before the fixes below: what the simulator got wrong there was where
requests went, not what the engines did with them.

Several ``--json`` files of one setup (routers.py run again with the same arguments) compare
the simulator against each figure's median over the runs: the gateway's p95 moves by up to
10 % between runs of the same placements, the simulator's does not.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

from kvreuse.gateway.config import DEFAULT_INDEX_BUDGET_FACTOR
from kvreuse.routing import CostModel, build_policy
from kvreuse.routing.base import FleetView, PolicyBase, RequestView, RoutingDecision
from kvreuse.routing.registry import policy_option_names
from kvreuse.sim.config import FleetConfig, ReplicaConfig
from kvreuse.sim.fleet import FleetSimulator
from kvreuse.sim.requests import SimRequest, jittered
from kvreuse.sim.summary import RunSummary, summarize
from kvreuse.tokens import TOKEN_BYTES
from kvreuse.trace.format import parse_trace_lines

HERE = Path(__file__).resolve().parent
# vllm-router 0.1's cache_aware is a fork of the same Rust policy (misses to the least loaded;
# its session-key path is unused without session headers) and measures like smg.
PEER_RULES = {"sglang-router": "cache_aware_smg", "smg": "cache_aware_smg",
              "vllm-router": "cache_aware_smg"}
HIT_POINTS = 0.03
P95_SHARE = 0.25
Tie = Callable[[float, float], float] | None


@functools.cache
def routers_module() -> Any:
    spec = importlib.util.spec_from_file_location("bench_routers", HERE / "routers.py")
    assert spec is not None and spec.loader is not None, "benchmarks/routers.py is missing"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


def sim_requests(calls: Sequence[Any], output_tokens: int) -> list[SimRequest]:
    """The calls as the engines see them: rendered, one token per 4 bytes."""
    from kvreuse.gateway.prompts import TextApproximation

    render = TextApproximation()
    out = []
    for i, call in enumerate(calls):
        body = json.loads(call.body)
        tokens = (render.completion(body["prompt"]) if "prompt" in body
                  else render.chat(body["messages"]))
        out.append(SimRequest(i, call.at_s, tokens, len(tokens) // TOKEN_BYTES, output_tokens,
                              tenant=call.tenant or None, session_id=call.session or None,
                              measured=call.measured))
    return out


RECORD_BLOCK = 16  # the engines' block size; routers.py --record hashes prompts in it
MATCH_WINDOW = 8  # how far a request may move in arrival order between client and gateway


class RecordedPlacement(PolicyBase):
    """Sends request ``i`` (a :func:`sim_requests` id) to ``placements[i]``, the replica a
    gateway run sent it to: the simulator's engines and caches judged apart from its routing."""

    name = "recorded"

    def __init__(self, placements: Sequence[str]) -> None:
        self.placements = placements

    def route(self, request: RequestView, fleet: FleetView) -> RoutingDecision:
        return RoutingDecision(self.placements[int(request.request_id)], "recorded", 0)


def gateway_options(router: str, policy: str, cache_tokens: int) -> dict[str, Any]:
    """The options ``policy`` runs with behind ``router``: the engines' block size where it
    takes one, as routers.py passed it; and for ``kvreuse:`` rows whose policy keeps its own
    trees, the gateway's index budget: ``kvreuse route`` bounds every index it keeps per
    upstream to ``index_budget_factor`` x the upstream's reported KV capacity and forgets the
    least recently used prefixes beyond it. It must match to the token: with a budget one block
    smaller, a replay of recorded placements disagreed with 3 of a gateway run's 502 decisions,
    with the gateway's own budget with none. KV-event indexes hold what the engines hold, well
    inside it. Peers' trees are bounded far above these runs (smg: ``max_tree_size`` 2**24
    characters and more) and run unbounded."""
    names = policy_option_names(policy)
    options: dict[str, Any] = {"block_size": 16} if "block_size" in names else {}
    if (router.startswith("kvreuse:") and "tree_capacity_tokens" in names
            and not build_policy(policy, **options).uses_kv_events):
        # The gateway reads the engine's capacity from vllm:cache_config_info, whose
        # num_gpu_blocks counts vLLM's null block, as ``kvreuse engine`` reports it.
        reported = (cache_tokens // RECORD_BLOCK + 1) * RECORD_BLOCK
        options["tree_capacity_tokens"] = int(DEFAULT_INDEX_BUDGET_FACTOR * reported)
    return options


def gateway_cost(router: str, fleet: FleetConfig, fixed_prefill: bool) -> CostModel | None:
    """The cost model ``router``'s policy routes on behind the gateway: a ``kvreuse:`` gateway
    measures its engines' prefill speed (kvreuse.routing.cost_fit) and, its fit converged,
    routes on theirs; with ``fixed_prefill`` (``kvreuse route --fixed-prefill``, and every
    gateway run before the session of 2026-12-05, twentieth) on its default, 10,000 tokens a
    second and 15 ms (None), as for ``kvreuse:POLICY/fixed-prefill``. Peers' rules predict no
    time."""
    if (fixed_prefill or not router.startswith("kvreuse:")
            or routers_module().kvreuse_policy(router)[1]):
        return None
    replica = fleet.replica
    return CostModel(replica.prefill_tokens_per_s, replica.overhead_s)


def gateway_fleet(replicas: int, cache_tokens: int, prefill_tokens_per_s: float,
                  first_byte_lag_s: float = 0.002, last_byte_lag_s: float = 0.004
                  ) -> FleetConfig:
    """The simulator's model of routers.py's fleet behind a gateway: ``kvreuse engine``'s
    parameters (vLLM's block pool of ``cache_tokens`` in 16-token blocks, 15 ms overhead, 5 ms
    per output token), queues counted from what the gateway sent (``load_view="router"``), and
    the lags with which it hears of first tokens and response ends (module docstring)."""
    replica = ReplicaConfig(
        pool_tokens=cache_tokens,
        prefill_tokens_per_s=prefill_tokens_per_s,
        overhead_s=0.015,
        time_per_output_token_s=0.005,
        cache_kind="block",
        block_size=16,
    )
    return FleetConfig(replicas, replica, kv_event_lag_s=0.0, load_view="router",
                       first_byte_lag_s=first_byte_lag_s, last_byte_lag_s=last_byte_lag_s)


@dataclass(frozen=True, slots=True)
class SimFigures:
    """What the comparison reads of a simulated run (or the median of replays)."""

    token_hit_rate: float
    ttft_p95_s: float


def median_summary(summaries: Sequence[RunSummary]) -> SimFigures:
    """The median token hit rate and p95 TTFT of several simulated replays."""
    return SimFigures(statistics.median(s.token_hit_rate for s in summaries),
                      statistics.median(s.ttft_p95_s for s in summaries))


@dataclass(frozen=True, slots=True)
class Comparison:
    """One gateway row against the simulator's figures: the p95 with the router's own time
    added, the hit-rate difference, the p95 ratio, whether both are within range, and the
    table cells from the gateway's figures on."""

    p95_ms: float
    within: bool
    cells: str


def compare(row: dict[str, Any], simulated: SimFigures | RunSummary) -> Comparison:
    """``row`` (a routers.py figure) against ``simulated``. What the simulator does not model,
    the router's own path (HTTP hops, parsing, its CPU under load) and the engines' HTTP
    handling, delays every first token: routers.py measures it under the run's load (client
    mean TTFT minus the engines' own) and it is added to the simulated p95."""
    router_ms = row.get("router_ms", float("nan"))
    router_ms = 0.0 if router_ms != router_ms else max(router_ms, 0.0)
    p95_ms = simulated.ttft_p95_s * 1000 + router_ms
    hit_diff = simulated.token_hit_rate - row["hit_rate"]
    ratio = p95_ms / row["p95_ms"]
    within = abs(hit_diff) <= HIT_POINTS and abs(ratio - 1) <= P95_SHARE
    cells = (f"{row['hit_rate']:.1%} / {row['p95_ms']:.0f} ms | {simulated.token_hit_rate:.1%} "
             f"/ {p95_ms:.0f} ms ({router_ms:.1f}) | {hit_diff * 100:+.1f} pts | {ratio:.2f} | "
             f"{'yes' if within else 'NO'} |")
    return Comparison(p95_ms, within, cells)


def recorded_placements(recording: Path, requests: Sequence[SimRequest]) -> list[str]:
    """The simulator replica each of ``requests`` went to in a ``routers.py --record`` run: the
    i-th upstream in name order (engine2 before engine10) is ``r<i>``. Recorded lines are in the
    gateway's arrival order, which may differ from the client's where two requests left within a
    moment; each line is matched to the nearest unmatched request within ``MATCH_WINDOW``
    positions that has its prompt length. Refuses (SystemExit, naming the file and line) a
    recording of another stream. O(requests x MATCH_WINDOW)."""
    files = sorted(recording.glob("*.jsonl"))
    if not files:
        raise SystemExit(f"{recording}: no recorded trace files (trace-*.jsonl)")
    lines = [line for f in files for line in f.read_text().splitlines()]
    records = parse_trace_lines(lines, str(recording), block=RECORD_BLOCK)
    if len(records) != len(requests):
        raise SystemExit(f"{recording}: {len(records)} recorded requests, the scenario sends "
                         f"{len(requests)}; was it recorded with other routers.py arguments?")
    names = sorted({r.upstream or "" for r in records}, key=lambda n: (len(n), n))
    replica_of = {name: f"r{i}" for i, name in enumerate(names)}
    placements: list[str | None] = [None] * len(requests)
    for j, record in enumerate(records):
        near = [i for i in range(max(0, j - MATCH_WINDOW), min(len(requests), j + MATCH_WINDOW + 1))
                if placements[i] is None and requests[i].prompt_len == record.input_length]
        if not near or not record.upstream:
            raise SystemExit(f"{recording}: line {j + 1} ({record.input_length} prompt tokens, "
                             f"upstream {record.upstream!r}) matches no request of the scenario "
                             "near that position; was it recorded with other routers.py "
                             "arguments?")
        placements[min(near, key=lambda i: abs(i - j))] = replica_of[record.upstream]
    assert all(p is not None for p in placements), "a request left unmatched"
    return [p for p in placements if p is not None]


@dataclass(frozen=True, slots=True)
class PairOrders:
    """How the pairs of two paired samples compare: ordered alike, ordered opposite ways, tied
    in ``a`` only, tied in ``b`` only (pairs tied in both are not counted)."""

    concordant: int
    discordant: int
    ties_a: int
    ties_b: int

    @property
    def tau_b(self) -> float:
        """Kendall's tau-b; NaN when no pair is ordered."""
        c, d = self.concordant, self.discordant
        denominator = ((c + d + self.ties_a) * (c + d + self.ties_b)) ** 0.5
        return (c - d) / denominator if denominator else float("nan")

    @property
    def ordered(self) -> int:
        """Pairs that at least one sample orders."""
        return self.concordant + self.discordant + self.ties_a + self.ties_b

    def agrees(self, target: float) -> bool:
        """Whether the two samples rank alike: tau-b at least ``target``, or no pair ordered on
        either side (every pair tied in both: nothing to rank, so nothing ranked differently;
        tau-b is 0/0 there). One side tying every pair the other orders does not agree."""
        return self.ordered == 0 or self.tau_b >= target

    def shown(self) -> str:
        """tau-b to two decimals, or what its NaN means."""
        if self.ordered == 0:
            return "all pairs tied in both"
        if math.isnan(self.tau_b):
            return "undefined (one side ties every pair the other orders)"
        return f"{self.tau_b:.2f}"


def pair_orders(a: Sequence[float], b: Sequence[float], tie_a: Tie = None,
                tie_b: Tie = None) -> PairOrders:
    """The pairs of two paired samples by how they compare. A pair whose difference in one
    sample is within that sample's ``tie`` (a function of the two values; exact equality
    without one) is tied there. O(n^2)."""
    concordant = discordant = ties_a = ties_b = 0
    for i, j in combinations(range(len(a)), 2):
        da, db = a[i] - a[j], b[i] - b[j]
        tied_a = abs(da) <= tie_a(a[i], a[j]) if tie_a else da == 0
        tied_b = abs(db) <= tie_b(b[i], b[j]) if tie_b else db == 0
        if tied_a and tied_b:
            continue
        if tied_a:
            ties_a += 1
        elif tied_b:
            ties_b += 1
        elif (da > 0) == (db > 0):
            concordant += 1
        else:
            discordant += 1
    return PairOrders(concordant, discordant, ties_a, ties_b)


def kendall_tau(a: Sequence[float], b: Sequence[float], tie_a: Tie = None,
                tie_b: Tie = None) -> float:
    """Kendall's tau-b of two paired samples, ties as :func:`pair_orders` counts them; NaN
    when no pair is ordered. O(n^2)."""
    return pair_orders(a, b, tie_a, tie_b).tau_b


# routers.py arguments that change what the gateway measured (a run's --json path does not).
def merged_runs(paths: Sequence[Path]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The routers.py arguments and one row per (scenario, router) from one or more
    ``--json`` files of the same setup: with several runs of a row (files, or ``--repeats``),
    each figure is the median over the runs that measured it without error (routers.py's
    ``median_row``: the gateway's own run-to-run noise is what repeated runs average out).
    Refuses files whose setups differ (routers.py's ``load_runs``) or that hold runs of more
    than one stream (``--seeds``): the simulator replays one stream; the arguments returned
    name its seed."""
    routers = routers_module()
    first, runs = routers.load_runs(paths)
    seeds = sorted({run["seed"] for run in runs})
    if len(seeds) > 1:
        raise SystemExit(f"these runs measured the streams of seeds {seeds}; compare one "
                         "stream at a time (routers.py --seed, or one seed's files)")
    if seeds:
        first = {**first, "seed": str(seeds[0])}
    merged = []
    for group in routers.runs_by_router([routers.run_row(row) for row in runs]).values():
        measured = [run for run in group if not run.error]
        if not measured:
            continue
        row = routers.median_row(measured)
        merged.append({"scenario": row.scenario, "router": row.router, "error": None,
                       "runs": len(measured), "router_ms": row.router_ms,
                       "hit_rate": row.hit_rate, "p95_ms": row.p95_ms})
    return first, merged


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("routers_json", type=Path, nargs="+",
                        help="output of benchmarks/routers.py --json; several runs of one "
                        "setup compare against each figure's median")
    parser.add_argument("--tie-points", type=float, default=1.0,
                        help="hit rates this many points apart rank as equal (default 1)")
    parser.add_argument("--first-byte-lag-ms", type=float, default=2.0,
                        help="how long a first token takes to reach the router (default 2)")
    parser.add_argument("--last-byte-lag-ms", type=float, default=4.0,
                        help="how long a response's end takes to reach the router (default 4)")
    parser.add_argument("--replays", type=int, default=1,
                        help="simulate each row this many times, all but the first with "
                        "arrivals jittered by --jitter-ms, and compare the medians (default 1)")
    parser.add_argument("--jitter-ms", type=float, default=5.0,
                        help="largest arrival shift of a jittered replay (default 5)")
    parser.add_argument("--fixed-prefill", action="store_true",
                        help="the kvreuse gateways ran with --fixed-prefill (or before they "
                        "measured their engines' speed): simulate their policies on 10,000 "
                        "tokens/s and 15 ms, not the engines' speed")
    parser.add_argument("--tie-share", type=float, default=0.10,
                        help="p95s within this share of the larger rank as equal (default 0.1)")
    args = parser.parse_args(argv)
    if args.replays < 1 or not args.jitter_ms >= 0:
        parser.error("--replays must be >= 1 and --jitter-ms >= 0")

    def hit_tie(x: float, y: float) -> float:
        return float(args.tie_points) / 100

    def p95_tie(x: float, y: float) -> float:
        return float(args.tie_share) * max(x, y)

    run_args, measured_runs = merged_runs(args.routers_json)
    routers = routers_module()
    fleet = gateway_fleet(int(run_args["replicas"]), int(run_args["cache_tokens"]),
                          float(run_args["prefill_tokens_per_s"]),
                          args.first_byte_lag_ms / 1000, args.last_byte_lag_ms / 1000)
    replica = fleet.replica
    ok_all = True
    print(f"cache {replica.pool_tokens:,} tokens x {fleet.replicas} replicas; "
          f"{run_args['rate']} req/s, {run_args['warmup']} s warm-up + {run_args['duration']} s")
    if len(args.routers_json) > 1:
        print(f"gateway figures: the median of {len(args.routers_json)} runs of routers.py")
    if args.replays > 1:
        print(f"simulator figures: the median of {args.replays} replays, all but the first with "
              f"arrivals moved by up to ±{args.jitter_ms:g} ms")
    print("| scenario | router | gateway hit / p95 | simulator hit / p95 (+ router ms) | hit diff "
          "| p95 ratio | within |")
    print("|---|---|---|---|---|---|---|")
    taus = []
    streams: dict[str, list[SimRequest]] = {}
    for scenario in dict.fromkeys(r["scenario"] for r in measured_runs):
        calls = routers.scenario_calls(
            scenario, rate=float(run_args["rate"]), warmup_s=float(run_args["warmup"]),
            duration_s=float(run_args["duration"]), seed=int(run_args["seed"]),
            max_tokens=int(run_args["max_tokens"]))
        requests = streams[scenario] = sim_requests(calls, int(run_args["max_tokens"]))
        replays = [requests] + [jittered(requests, seed, args.jitter_ms / 1000)
                                for seed in range(1, args.replays)]
        pairs = []
        for row in measured_runs:
            if row["scenario"] != scenario or row["error"]:
                continue
            router = row["router"]
            policy = (routers.kvreuse_policy(router)[0] if router.startswith("kvreuse:")
                      else PEER_RULES.get(router))
            if policy is None:
                continue
            options = gateway_options(router, policy, replica.pool_tokens)
            cost = gateway_cost(router, fleet, args.fixed_prefill)
            summary = median_summary([
                summarize(FleetSimulator(
                    fleet, build_policy(policy, rng=random.Random(0), cost=cost,
                                        **options)).run(stream))
                for stream in replays])
            compared = compare(row, summary)
            ok_all &= compared.within
            pairs.append((row["hit_rate"], summary.token_hit_rate, row["p95_ms"],
                          compared.p95_ms))
            print(f"| {scenario} | {router} | {compared.cells}", flush=True)
        if len(pairs) >= 2:
            hits = [p[0] for p in pairs], [p[1] for p in pairs]
            p95s = [p[2] for p in pairs], [p[3] for p in pairs]
            taus.append((scenario, kendall_tau(*hits), kendall_tau(*p95s),
                         pair_orders(*hits, hit_tie, hit_tie),
                         pair_orders(*p95s, p95_tie, p95_tie)))
    print()
    for scenario, hit_raw, p95_raw, hit_orders, p95_orders in taus:
        good = hit_orders.agrees(0.8) and p95_orders.agrees(0.8)
        ok_all &= good
        print(f"[{'PASS' if good else 'FAIL'}] {scenario}: Kendall tau of the policies' "
              f"ranking, hit rate {hit_orders.shown()}, p95 TTFT {p95_orders.shown()} "
              f"(target >= 0.8; ties "
              f"within {args.tie_points:g} points and {args.tie_share:.0%}; exact ties only: "
              f"{hit_raw:.2f}, {p95_raw:.2f})")
        for name, orders in (("hit rate", hit_orders), ("p95", p95_orders)):
            print(f"       {name}: {orders.concordant} pairs ordered alike, "
                  f"{orders.discordant} opposite ways, {orders.ties_a} tied by the gateway "
                  f"only, {orders.ties_b} by the simulator only")
    recorded = [(path, row) for path in args.routers_json
                for row in json.loads(path.read_text())["runs"]
                if row.get("recording") and not row["error"] and row["scenario"] in streams]
    if recorded:
        ok_all &= replay_placements(recorded, streams, fleet)
    return 0 if ok_all else 1


def replay_placements(recorded: Sequence[tuple[Path, dict[str, Any]]],
                      streams: dict[str, list[SimRequest]], fleet: FleetConfig) -> bool:
    """Prints, per recorded gateway run, its figures against the simulator's on the very
    placements the gateway made (:class:`RecordedPlacement`); True when every row is within
    range. Where the simulator's own policy misses the gateway but this does not, the engines
    and caches are modelled well enough and the difference is in where requests were sent."""
    print("\nThe simulator's engines on the gateway's own placements (routers.py --record):")
    print("| scenario | router | run | gateway hit / p95 | simulator, same placements, hit / p95 "
          "(+ router ms) | hit diff | p95 ratio | within |")
    print("|---|---|---|---|---|---|---|---|")
    ok = True
    for path, row in recorded:
        recording = Path(row["recording"])
        if not recording.is_dir():
            print(f"| {row['scenario']} | {row['router']} | {path.name} | recording "
                  f"{recording} is gone | | | | |")
            continue
        requests = streams[row["scenario"]]
        placements = recorded_placements(recording, requests)
        summary = summarize(FleetSimulator(fleet, RecordedPlacement(placements)).run(requests))
        compared = compare(row, summary)
        ok &= compared.within
        print(f"| {row['scenario']} | {row['router']} | {path.name} | {compared.cells}",
              flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(main())
