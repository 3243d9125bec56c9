"""kvreuse's gateway side by side with sglang-router, vllm-router and smg (docs/performance.md).

Same fleet, same traffic, one router at a time:

* fleet: ``--replicas`` ``kvreuse engine`` processes with a fixed cache (``--cache-tokens``), each
  publishing KV events; their caches are reset between runs;
* traffic (open loop, seeded): ``belgavi`` multi-turn chats over six shared system prompts,
  ``contracts`` questions over a document library with a hot set, ``surge`` two tenants' chats
  with one tenant tripling its rate mid-run;
* routers: ``direct`` (the client spreads requests round robin, no router), the peers
  (``sglang-router``, ``vllm-router`` cache_aware, ``vllm-router-kv`` kv_aware on KV events,
  ``smg``; from ``make peers``) and ``kvreuse route`` with each policy (``kvreuse:NAME``;
  ``kvreuse:NAME/fixed-prefill`` adds ``--fixed-prefill``: the policy routes on 10,000
  prefill tokens/s and 15 ms instead of the speed the gateway measures);
* figures: fleet token hit rate from the engines' own counters (after warm-up), client-side
  p50/p95 TTFT, max/mean prompt tokens per engine (load spread), requests lost.

Then two gateway-cost sections: added latency of ``kvreuse route`` against direct at
``--overhead-rate`` req/s (small prompts), and the request rate one gateway process proxies
(closed loop, tiny requests, zero-cost engines), with the gateway's CPU use.

``--record DIR`` makes every kvreuse gateway run record its traffic (``kvreuse route --record``)
under ``DIR/SCENARIO--POLICY``; the row's ``recording`` names it, and
``benchmarks/sim_vs_gateway.py`` replays those placements in the simulator.

``--repeats N`` measures every router N times on the same seeded stream (the runs interleaved:
each round runs every router once, so a drift of the machine's load falls on all of them) and
judges the medians. At 12,288-token caches one router's hit rate moves by up to 4 points from run
to run (smg on contracts: 52.6-56.6 % over nine runs), timing alone changing placements; a
verdict from one run there is a draw. The table of medians gives each figure's range.

``--seeds 1,2,3`` measures each scenario (and ``--vllm``'s chats) on several seeded streams
(other documents, chats and arrival times drawn from the same distributions) and judges each
router's mean over the streams of its per-stream medians, against the mean of the streams'
ceilings; it prints each stream's verdict first. Why: repeats only average out timing, while
the stream itself decides which rule is lucky. At 12,288-token caches two miss orders of
``relative_spill`` differ by 5 points on contracts at seed 7 through the gateway and by 0.1
over twelve seeds in the simulator's model, and seed 7 is among the streams where the peers'
rule does best (docs/performance.md, "Which stream?").

Everything binds 127.0.0.1 and every process started is stopped at the end. Runtime is about
``(warmup + duration + 6 s) × scenarios × routers × repeats × seeds`` plus ~30 s; ``--quick``
is a smoke run.

    .venv/bin/python benchmarks/routers.py --quick
    .venv/bin/python benchmarks/routers.py --duration 30 --json artifacts/bench/routers.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import httpx

from kvreuse.hitrate.prometheus import parse_exposition
from kvreuse.routing import DESCRIPTIONS
from kvreuse.routing.registry import policy_option_names
from kvreuse.sim.workloads import ChatWorkload, DocumentWorkload, RateStep, Tenant
from kvreuse.testing.loadgen import (
    Call,
    EngineCounters,
    LatencySummary,
    engine_mean_ttft_s,
    fleet_hits,
    run_calls,
    scrape,
)
from kvreuse.testing.processes import EngineSpec, Fleet, Process, peers_available, wait_http

PEERS = ("sglang-router", "vllm-router", "vllm-router-kv", "smg")
MODEL = "sim"
VLLM_MODEL = "tiny-llama"
ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- traffic


SCENARIOS = ("belgavi", "contracts", "surge")
"""The gateway workloads (``vllm-chat`` is ``--vllm``'s)."""


def scenario_calls(name: str, *, rate: float, warmup_s: float, duration_s: float,
                   seed: int, max_tokens: int) -> list[Call]:
    from kvreuse.testing.loadgen import chat_calls, document_calls

    if name == "vllm-chat":
        # Small enough for the tiny model's 2,048-token window once BPE splits the words.
        chats = ChatWorkload(tenants=(Tenant("belgavi", rate),), duration_s=duration_s,
                             warmup_s=warmup_s, system_prompts=3, system_tokens=120,
                             turns=(3, 3), user_tokens=(20, 20), answer_tokens=(30, 30),
                             gap_s=(2.0, 3.0), model=VLLM_MODEL)
        return chat_calls(chats, seed, model=VLLM_MODEL, max_tokens=max_tokens)
    if name == "belgavi":
        chats = ChatWorkload(tenants=(Tenant("belgavi", rate),), duration_s=duration_s,
                             warmup_s=warmup_s, system_prompts=6, system_tokens=1500,
                             turns=(3, 3), user_tokens=(150, 150), answer_tokens=(250, 250),
                             gap_s=(4.0, 6.0), model=MODEL)
        return chat_calls(chats, seed, model=MODEL, max_tokens=max_tokens)
    if name == "contracts":
        docs = DocumentWorkload(rate_rps=rate, duration_s=duration_s, warmup_s=warmup_s,
                                documents=200, document_tokens=2000, hot_docs=25,
                                hot_fraction=0.8, question_tokens=(60, 100), model=MODEL)
        return document_calls(docs, seed, model=MODEL, max_tokens=max_tokens)
    if name == "surge":
        start, _ = surge_window(warmup_s, duration_s)
        chats = ChatWorkload(
            tenants=(Tenant("acme", rate * 0.6), Tenant("globex", rate * 0.4)),
            duration_s=duration_s, warmup_s=warmup_s, system_prompts=3, system_tokens=1500,
            turns=(3, 3), user_tokens=(150, 150), answer_tokens=(250, 250), gap_s=(4.0, 6.0),
            steps=(RateStep(start, start + duration_s / 3, 3.0, "acme"),), model=MODEL)
        return chat_calls(chats, seed, model=MODEL, max_tokens=max_tokens)
    raise SystemExit(f"unknown scenario {name!r}: choose belgavi, contracts, surge")


def ceiling(calls: Sequence[Call], block_size: int = 16,
            capacity_tokens: int | None = None) -> float:
    """The token hit rate of one infinite cache holding every earlier prompt (no router can do
    better; outputs are not counted as reusable): whole blocks of each measured prompt's longest
    match among all prompts sent before it. Prompts are read back from the request bodies.
    ``capacity_tokens``: one LRU cache of that size instead (replicas x cache: the pooled bound
    of :func:`kvreuse.sim.trace.compute_bounds`, what the fleet's caches could hold together)."""
    from kvreuse.gateway.prompts import TextApproximation
    from kvreuse.index import RadixIndex

    render = TextApproximation()
    seen = RadixIndex() if capacity_tokens is None else RadixIndex(capacity_tokens=capacity_tokens)
    hits = total = 0
    for call in calls:
        body = json.loads(call.body)
        tokens = (render.completion(body["prompt"]) if "prompt" in body
                  else render.chat(body["messages"]))
        matched = seen.match(tokens).length
        seen.insert(tokens)
        if call.measured:
            count = len(tokens) // 4
            hits += min(matched, count - 1) // block_size * block_size
            total += count
    return hits / total if total else 0.0


# ---------------------------------------------------------------------------- one run


@dataclass(frozen=True, slots=True)
class RunRow:
    scenario: str
    router: str
    hit_rate: float
    p50_ms: float
    p95_ms: float
    max_over_mean: float
    requests: int
    lost: int
    error: str = ""
    surge_hit_rate: float = float("nan")  # surge scenario: the hit rate while the surge lasts
    # The router's own time per request under the run's load (HTTP hops, parsing, routing,
    # its CPU): the clients' mean TTFT over the measured requests minus the engines' own mean
    # (vllm:time_to_first_token_seconds, warm-up to the end).
    router_ms: float = float("nan")
    # ``--record``: the directory this kvreuse gateway run recorded its traffic to (each
    # request's arrival, prompt length and upstream: what benchmarks/sim_vs_gateway.py replays).
    recording: str = ""
    # The seed of the scenario's stream (``--seed`` / ``--seeds``); None in rows that do not
    # come from a run (tests) or were saved before rows carried it (``run_row`` fills it).
    seed: int | None = None


def reset_caches(engines: Sequence[Process]) -> None:
    for engine in engines:
        for _ in range(50):
            if httpx.post(engine.url + "/reset_prefix_cache", timeout=5).status_code == 200:
                break
            time.sleep(0.1)  # requests of the previous run still draining


FIXED_PREFILL = "/fixed-prefill"


def kvreuse_policy(router: str) -> tuple[str, bool]:
    """``kvreuse:POLICY[/fixed-prefill]``'s policy, and whether its gateway runs with
    ``--fixed-prefill``."""
    rest = router.split(":", 1)[1]
    if rest.endswith(FIXED_PREFILL):
        return rest[: -len(FIXED_PREFILL)], True
    return rest, False


def start_router(fleet: Fleet, router: str, engines: Sequence[Process],
                 gateway_args: Sequence[str] = (), block_size: int = 16,
                 model: str = MODEL) -> Process | None:
    if router == "direct":
        return None
    if router.startswith("kvreuse:"):
        policy, fixed = kvreuse_policy(router)
        extra = list(gateway_args) + (["--fixed-prefill"] if fixed else [])
        if "block_size" in policy_option_names(policy):  # the engines' block, not a default
            extra += ["--policy-option", f"block_size={block_size}"]
        # A process name is a log file's name: no "/" from the variant.
        return fleet.start_gateway(router.replace("/", "-"), engines, policy=policy,
                                   extra_args=extra)
    return fleet.start_peer(router, engines, block_size=block_size, model=model)


def surge_window(warmup_s: float, duration_s: float) -> tuple[float, float]:
    """Seconds after the start when the surge scenario's hot tenant triples, and stops."""
    start = warmup_s + duration_s / 3
    return start, start + duration_s / 3


def measure(fleet: Fleet, engines: Sequence[Process], router: str, scenario: str,
            calls: Sequence[Call], warmup_s: float, gateway_args: Sequence[str] = (),
            block_size: int = 16, model: str = MODEL,
            window: tuple[float, float] | None = None, record: Path | None = None,
            record_suffix: str = "") -> RunRow:
    """One router on one scenario; with ``record``, a kvreuse gateway records its traffic in a
    fresh directory under it (the engines' block size; a secret kept in the fleet's workdir),
    named ``SCENARIO--POLICY`` plus ``record_suffix``."""
    reset_caches(engines)
    recording = ""
    if record is not None and router.startswith("kvreuse:"):
        named = router.split(":", 1)[1].replace("/", "-")
        target = record / f"{scenario}--{named}{record_suffix}"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        secret = fleet.workdir / "record-secret"
        if not secret.exists():
            secret.write_text(os.urandom(16).hex())
        gateway_args = [*gateway_args, "--record", str(target), "--record-block-size",
                        str(block_size), "--record-secret-file", str(secret)]
        recording = str(target)
    try:
        proc = start_router(fleet, router, engines, gateway_args, block_size, model)
    except RuntimeError as exc:
        return RunRow(scenario, router, float("nan"), float("nan"), float("nan"),
                      float("nan"), 0, 0, str(exc).splitlines()[0])
    urls = [e.url for e in engines]
    if proc is None:
        def pick(i: int, call: Call) -> str:
            return urls[i % len(urls)]
    else:
        target = proc.url

        def pick(i: int, call: Call) -> str:
            return target
    snapshots: dict[str, dict[str, EngineCounters]] = {"start": scrape(urls)}
    checkpoints = {"warm": warmup_s}
    if window is not None:
        checkpoints["surge"], checkpoints["surge_end"] = window

    def tick(elapsed: float) -> None:
        for name, at in checkpoints.items():
            if elapsed >= at and name not in snapshots:
                snapshots[name] = {}
                task = asyncio.get_running_loop().run_in_executor(None, scrape, urls)
                task.add_done_callback(
                    lambda t, name=name: snapshots.__setitem__(name, t.result()))

    results = asyncio.run(run_calls(calls, pick, on_tick=tick))
    after = scrape(urls)
    hits = fleet_hits(snapshots.get("warm") or snapshots["start"], after)
    latency = LatencySummary.of(results)
    ttfts = [r.ttft_s for r in results
             if r.call.measured and r.ttft_s is not None and not r.error]
    engine_ttft_s = engine_mean_ttft_s(snapshots.get("warm") or snapshots["start"], after)
    router_ms = (sum(ttfts) / len(ttfts) - engine_ttft_s) * 1000 if ttfts else float("nan")
    surge = float("nan")
    if snapshots.get("surge") and snapshots.get("surge_end"):
        surge = fleet_hits(snapshots["surge"], snapshots["surge_end"]).hit_rate
    if proc is not None:
        if router.startswith("kvreuse:"):
            report_prefill_speed(router, proc.url)
        fleet.forget(proc)
    return RunRow(scenario, router, hits.hit_rate, latency.p50_ms, latency.p95_ms,
                  hits.max_over_mean_load, latency.count, latency.lost,
                  surge_hit_rate=surge, router_ms=router_ms, recording=recording)


PREFILL_SERIES = ("kvreuse_gateway_prefill_tokens_per_second",
                  "kvreuse_gateway_prefill_overhead_seconds",
                  "kvreuse_gateway_prefill_samples_total")
UPSTREAM_SPEED = "kvreuse_gateway_upstream_prefill_speed"


def report_prefill_speed(router: str, url: str) -> None:
    """Print, as comments, the prefill speed a kvreuse gateway measured per model (absent with
    ``--fixed-prefill`` and before any streamed answer) and each upstream's speed over its
    fleet's as routed on (1 for alike engines: the band of ``routing.cost_fit``)."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError as exc:
        print(f"# {router}: /metrics unreadable ({exc})", file=sys.stderr)
        return
    by_model: dict[str, dict[str, float]] = {}
    by_upstream: dict[str, float] = {}
    for sample in parse_exposition(text, f"{router} /metrics",
                                   only=(*PREFILL_SERIES, UPSTREAM_SPEED), strict=False):
        if sample.name == UPSTREAM_SPEED:
            by_upstream[sample.label("upstream") or ""] = sample.value
        else:
            by_model.setdefault(sample.label("model") or "", {})[sample.name] = sample.value
    rate, overhead, samples = PREFILL_SERIES
    for model, series in sorted(by_model.items()):
        print(f"# {router} measured model {model}: "
              f"{series.get(rate, float('nan')):,.0f} prefill tokens/s, "
              f"{series.get(overhead, float('nan')) * 1000:.1f} ms a request, "
              f"{series.get(samples, 0):.0f} first tokens timed", flush=True)
    if by_upstream:
        print(f"# {router} routed upstreams at: " + ", ".join(
            f"{name} {speed:.3f}" for name, speed in sorted(by_upstream.items())), flush=True)


# ---------------------------------------------------------------------------- gateway cost


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def small_calls(rate: float, duration_s: float, prompt_tokens: int) -> list[Call]:
    """Unique short completions at a fixed rate (uniform spacing: latency, not queueing)."""
    from kvreuse.testing.loadgen import tokens_text
    from kvreuse.tokens import pack

    calls = []
    count = int(rate * duration_s)
    for i in range(count):
        prompt = tokens_text(pack(range(10_000 + i * prompt_tokens,
                                        10_000 + (i + 1) * prompt_tokens)))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}
        calls.append(Call(i / rate, "/v1/completions", json.dumps(body).encode(),
                          measured=i >= rate))  # the first second warms connections
    return calls


def added_latency(fleet: Fleet, engines: Sequence[Process], policy: str, rate: float,
                  duration_s: float) -> dict[str, float]:
    urls = [e.url for e in engines]
    calls = small_calls(rate, duration_s, 64)
    direct = asyncio.run(run_calls(calls, lambda i, c: urls[i % len(urls)]))
    gateway = fleet.start_gateway(f"kvreuse:{policy}:latency", engines, policy=policy)
    calls = small_calls(rate, duration_s, 64)
    via = asyncio.run(run_calls(calls, lambda i, c: gateway.url))
    fleet.forget(gateway)
    d, g = LatencySummary.of(direct), LatencySummary.of(via)
    return {"rate": rate, "direct_p50_ms": d.p50_ms, "direct_p99_ms": d.p99_ms,
            "gateway_p50_ms": g.p50_ms, "gateway_p99_ms": g.p99_ms,
            "added_p50_ms": g.p50_ms - d.p50_ms, "added_p99_ms": g.p99_ms - d.p99_ms,
            "lost": d.lost + g.lost}


async def _closed_loop(url: str, duration_s: float, concurrency: int) -> tuple[int, int]:
    body = json.dumps({"model": MODEL, "prompt": "ping" * 8, "max_tokens": 1}).encode()
    done = errors = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        deadline = time.perf_counter() + duration_s

        async def worker() -> None:
            nonlocal done, errors
            while time.perf_counter() < deadline:
                try:
                    r = await client.post(url + "/v1/completions", content=body,
                                          headers={"content-type": "application/json"})
                    done += r.status_code == 200
                    errors += r.status_code != 200
                except httpx.HTTPError:
                    errors += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, errors


def wrk_rate(url: str, workdir: Path, duration_s: float, concurrency: int) -> tuple[float, int]:
    """Requests/s and non-2xx answers that wrk (C, two threads) gets from ``url``."""
    script = workdir / "post.lua"
    body = json.dumps({"model": MODEL, "prompt": "ping" * 8, "max_tokens": 1})
    script.write_text(f"wrk.method = 'POST'\nwrk.body = '{body}'\n"
                      "wrk.headers['Content-Type'] = 'application/json'\n")
    out = subprocess.run(["wrk", "-t2", f"-c{concurrency}", f"-d{max(int(duration_s), 1)}s",
                          "-s", str(script), url + "/v1/completions"],
                         capture_output=True, text=True, check=True).stdout
    rate = next(float(line.split()[1]) for line in out.splitlines()
                if line.startswith("Requests/sec"))
    bad = 0
    for line in out.splitlines():
        if "Non-2xx" in line:
            bad += int(line.split()[-1])
        elif line.strip().startswith("Socket errors:"):
            bad += sum(int(part.strip(",")) for part in line.split() if part.strip(",").isdigit())
    return rate, bad


def throughput(fleet: Fleet, engines: Sequence[Process], policy: str, duration_s: float,
               concurrency: int) -> dict[str, float]:
    """Closed loop of tiny requests through one gateway: wrk when installed (``make peers``),
    else a Python client (which then limits the figure itself)."""
    gateway = fleet.start_gateway(f"kvreuse:{policy}:throughput", engines, policy=policy)
    figures: dict[str, float] = {}
    cpu0, t0 = cpu_seconds(gateway.pid), time.perf_counter()
    if shutil.which("wrk"):
        rate, errors = wrk_rate(gateway.url, fleet.workdir, duration_s, concurrency)
        done = rate * (time.perf_counter() - t0)
        figures["engine_alone_req_per_s"] = wrk_rate(engines[0].url, fleet.workdir,
                                                     duration_s / 2, concurrency)[0]
    else:
        done, errors = asyncio.run(_closed_loop(gateway.url, duration_s, concurrency))
    wall = time.perf_counter() - t0 - (duration_s / 2 if "engine_alone_req_per_s" in figures
                                       else 0.0)
    cpu = cpu_seconds(gateway.pid) - cpu0
    fleet.forget(gateway)
    figures.update({"req_per_s": done / wall, "errors": errors,
                    "gateway_cpu_share": cpu / wall,
                    "req_per_gateway_cpu_s": done / cpu if cpu else float("nan")})
    return figures


# ---------------------------------------------------------------------------- report


def print_table(rows: Sequence[RunRow]) -> None:
    print(f"{'scenario':10} {'router':26} {'hit rate':>8} {'p50 ms':>8} {'p95 ms':>8} "
          f"{'max/mean':>8} {'reqs':>6} {'lost':>5}")
    for row in rows:
        print_table_row(row)


def runs_by_router(rows: Sequence[RunRow]) -> dict[tuple[str, str], list[RunRow]]:
    """Every run of each (scenario, router), in first-seen order."""
    groups: dict[tuple[str, str], list[RunRow]] = {}
    for row in rows:
        groups.setdefault((row.scenario, row.router), []).append(row)
    return groups


def _median(values: Sequence[float]) -> float:
    real = [v for v in values if v == v]  # NaN: not measured in that run
    return statistics.median(real) if real else float("nan")


def combined_row(runs: Sequence[RunRow], center: Callable[[Sequence[float]], float],
                 seed: int | None) -> RunRow:
    """Runs of one (scenario, router), all measured, as one row: each figure ``center`` of the
    runs' figures, ``requests`` the fewest and ``lost`` the most of any run (one lost request in
    any run is a loss)."""
    first = runs[0]
    return RunRow(
        first.scenario, first.router, center([r.hit_rate for r in runs]),
        center([r.p50_ms for r in runs]), center([r.p95_ms for r in runs]),
        center([r.max_over_mean for r in runs]), min(r.requests for r in runs),
        max(r.lost for r in runs), "", center([r.surge_hit_rate for r in runs]),
        center([r.router_ms for r in runs]),
        ", ".join(r.recording for r in runs if r.recording), seed)


def median_row(runs: Sequence[RunRow]) -> RunRow:
    """One (scenario, router)'s runs of one stream as one row: each figure the median over the
    runs measured without error (:func:`combined_row`). With no run free of error, the first run
    and its error."""
    measured = [r for r in runs if not r.error]
    if not measured:
        return runs[0]
    return combined_row(measured, _median, measured[0].seed)


def median_rows(rows: Sequence[RunRow]) -> list[RunRow]:
    """One :func:`median_row` per (scenario, router), in first-seen order."""
    return [median_row(runs) for runs in runs_by_router(rows).values()]


def seeds_of(rows: Sequence[RunRow]) -> list[int | None]:
    """The stream seeds the rows were measured on, in increasing order (None last)."""
    return sorted({r.seed for r in rows}, key=lambda seed: (seed is None, seed or 0))


def _mean(values: Sequence[float]) -> float:
    real = [v for v in values if v == v]
    return statistics.fmean(real) if real else float("nan")


def seed_means(rows: Sequence[RunRow]) -> list[RunRow]:
    """One row per (scenario, router) over several streams: each stream's runs as their
    :func:`median_row`, then each figure the mean over the streams (:func:`combined_row`; each
    stream counts once, however often it was repeated).
    A router that measured nothing on one of the streams keeps that stream's error, and one
    not run on every stream the rows hold gets an error saying so: neither is judged on the
    streams it has alone. With one stream, the medians themselves. O(rows)."""
    seeds = seeds_of(rows)
    per_seed = [median_rows([r for r in rows if r.seed == seed]) for seed in seeds]
    groups = runs_by_router([row for medians in per_seed for row in medians])
    out = []
    for runs in groups.values():
        failed = next((r for r in runs if r.error), None)
        if failed is None and len(runs) < len(seeds):
            failed = replace(runs[0], error=f"measured on {len(runs)} of the {len(seeds)} "
                             f"streams (seeds {', '.join(str(r.seed) for r in runs)})")
        if failed is not None or len(runs) == 1:
            out.append(failed or runs[0])
            continue
        out.append(combined_row(runs, _mean, None))
    return out


def print_medians(rows: Sequence[RunRow]) -> None:
    """The medians :func:`median_rows` judges, with each router's hit rate and p95 range; with
    several streams, one table per stream seed."""
    seeds = seeds_of(rows)
    if len(seeds) > 1:
        for seed in seeds:
            print(f"# stream seed {seed}")
            print_medians([r for r in rows if r.seed == seed])
        return
    print(f"{'scenario':10} {'router':26} {'runs':>4} {'hit rate':>8} {'hit range':>13} "
          f"{'p95 ms':>8} {'p95 range':>15} {'max/mean':>8} {'lost':>5}")
    for runs in runs_by_router(rows).values():
        row = median_row(runs)
        measured = [r for r in runs if not r.error]
        if not measured:
            print(f"{row.scenario:10} {row.router:26} {0:4d}  ({row.error})")
            continue
        hits = [r.hit_rate for r in measured]
        p95s = [r.p95_ms for r in measured]
        print(f"{row.scenario:10} {row.router:26} {len(measured):4d} {row.hit_rate:8.1%} "
              f"{min(hits):6.1%}-{max(hits):6.1%} {row.p95_ms:8.1f} "
              f"{min(p95s):7.1f}-{max(p95s):7.1f} {row.max_over_mean:8.2f} {row.lost:5d}")


GAP_POINTS = 0.03


Ceilings = dict[tuple[str, "int | None"], float]
"""The pooled-LRU bound of each (scenario, stream seed)."""


def verdicts(rows: Sequence[RunRow], cost: dict[str, dict[str, float]],
             ceilings: Ceilings | None = None,
             candidate: str = "kvreuse:relative_spill") -> list[str]:
    """Issue 15's verdict per scenario: ``candidate`` (the default policy) must reach the best
    peer's token hit rate (the real peer with the highest) at no higher p95 TTFT, with no
    request lost, and close half the gap to the ceiling (``ceilings``: the pooled-LRU bound of
    each scenario's stream) where the best peer is more than 3 points under it. Repeated runs
    of a router are judged by their medians (:func:`median_rows`); runs on several streams
    (``--seeds``) by the mean of each stream's medians (:func:`seed_means`) against the mean
    of the streams' ceilings, after one verdict per stream."""
    ceilings = ceilings or {}
    out = []
    for scenario in dict.fromkeys(r.scenario for r in rows):
        of_scenario = [r for r in rows if r.scenario == scenario]
        seeds = seeds_of(of_scenario)
        tops = {seed: ceilings[scenario, seed] for seed in seeds if (scenario, seed) in ceilings}
        if len(seeds) > 1:
            for seed in seeds:
                out += scenario_verdicts(
                    median_rows([r for r in of_scenario if r.seed == seed]),
                    {scenario: tops[seed]} if seed in tops else {}, candidate,
                    f", seed {seed}", surge_info=False)
        label = (", mean of seeds " + ", ".join(str(seed) for seed in seeds)
                 if len(seeds) > 1 else "")
        mean_top = {scenario: statistics.fmean(tops.values())} if len(tops) == len(seeds) else {}
        out += scenario_verdicts(seed_means(of_scenario), mean_top, candidate, label)
    return out + cost_verdicts(cost)


def scenario_verdicts(rows: Sequence[RunRow], ceilings: dict[str, float], candidate: str,
                      label: str = "", *, surge_info: bool = True) -> list[str]:
    """:func:`verdicts`' lines for rows already merged to one per (scenario, router); ``label``
    follows the scenario's name (which stream, or the mean of which)."""
    out = []
    for scenario in dict.fromkeys(r.scenario for r in rows):
        mine = [r for r in rows if r.scenario == scenario and r.router.startswith("kvreuse:")
                and not r.error]
        peers = [r for r in rows if r.scenario == scenario and r.router in PEERS
                 and not r.error]
        own = next((r for r in mine if r.router == candidate), None)
        if own is None or not peers:
            out.append(f"[skip] {scenario}{label}: need a {candidate} run and peer runs")
            continue
        peer = min(peers, key=lambda r: (-r.hit_rate, r.p95_ms))
        needed = peer.hit_rate
        ceiling_note = ""
        top = ceilings.get(scenario)
        if top is not None:
            ceiling_note = f"; ceiling {top:.1%}"
            if top - peer.hit_rate > GAP_POINTS:
                needed = peer.hit_rate + (top - peer.hit_rate) / 2
                ceiling_note += f", half the gap: >= {needed:.1%}"
        ok = own.hit_rate >= needed and own.p95_ms <= peer.p95_ms and not own.lost
        out.append(f"[{'PASS' if ok else 'FAIL'}] {scenario}{label}: {candidate} "
                   f"{own.hit_rate:.1%} vs best peer {peer.router} {peer.hit_rate:.1%} "
                   f"({(own.hit_rate - peer.hit_rate) * 100:+.1f} points{ceiling_note}); p95 "
                   f"{own.p95_ms:.0f} ms vs {peer.p95_ms:.0f} ms; lost {own.lost}")
        surged = [r for r in mine + peers if r.surge_hit_rate == r.surge_hit_rate]
        if surged and surge_info:
            best_in = max((r for r in surged if r in mine), key=lambda r: r.surge_hit_rate,
                          default=None)
            peer_in = max((r for r in surged if r in peers), key=lambda r: r.surge_hit_rate,
                          default=None)
            if best_in is not None and peer_in is not None:
                out.append(f"[info] {scenario} while the surge lasts: best kvreuse "
                           f"{best_in.router} {best_in.surge_hit_rate:.1%} vs best peer "
                           f"{peer_in.router} {peer_in.surge_hit_rate:.1%} "
                           f"({(best_in.surge_hit_rate - peer_in.surge_hit_rate) * 100:+.1f} "
                           "points)")
    return out


def cost_verdicts(cost: dict[str, dict[str, float]]) -> list[str]:
    """The gateway-cost sections' verdicts (added latency, proxied request rate)."""
    out: list[str] = []
    lat = cost.get("added_latency")
    if lat:
        ok = lat["added_p50_ms"] <= 1 and lat["added_p99_ms"] <= 3 and not lat["lost"]
        out.append(f"[{'PASS' if ok else 'FAIL'}] added latency at {lat['rate']:.0f} req/s: "
                   f"p50 {lat['added_p50_ms']:+.2f} ms (<= 1), p99 {lat['added_p99_ms']:+.2f} ms "
                   f"(<= 3)")
    thr = cost.get("throughput")
    if thr:
        ok = thr["req_per_s"] >= 1000
        out.append(f"[{'PASS' if ok else 'FAIL'}] one gateway process proxied "
                   f"{thr['req_per_s']:.0f} req/s (>= 1000) using {thr['gateway_cpu_share']:.2f} "
                   f"CPU; {thr['req_per_gateway_cpu_s']:.0f} requests per gateway CPU-second")
    return out


def vllm_section(fleet: Fleet, args: argparse.Namespace, routers: Sequence[str],
                 seeds: Sequence[int]) -> list[RunRow]:
    """The same comparison on two real vLLM replicas (tiny random Llama, CPU), at low rate,
    on each of ``seeds``' streams (rows tagged with their seed)."""
    python = os.environ.get("KVREUSE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        print(f"# --vllm: no vLLM interpreter at {python} (make vllm-env)", file=sys.stderr)
        return []
    model = Path(os.environ.get("KVREUSE_TINY_MODEL", ROOT / "build" / "tiny-llama")).resolve()
    subprocess.run([python, str(ROOT / "tests" / "vllm" / "build_tiny_model.py"), str(model)],
                   check=True, capture_output=True)
    cores = sorted(os.sched_getaffinity(0))
    apart = args.vllm_cpus_apart and len(cores) >= 2
    replicas = [fleet.start_vllm(f"vllm{i}", python, str(model),
                                 cpus={cores[i]} if apart else None) for i in range(2)]
    for replica in replicas:
        wait_http(replica, "/v1/models", timeout_s=600)
    time.sleep(1.0)
    candidate = kvreuse_policy(args.candidate)[0]
    # 'all' names every kvreuse policy; vLLM on CPU runs only the ones the verdicts compare
    # (a list given by name runs as given).
    chosen = routers if args.routers != "all" else [
        r for r in routers if r in ("direct", *PEERS, "kvreuse:round_robin",
                                    "kvreuse:cache_aware", "kvreuse:exact", args.candidate)
        or (r.startswith("kvreuse:") and kvreuse_policy(r)[0] == candidate)]
    rows = []
    for seed in seeds:
        calls = scenario_calls("vllm-chat", rate=args.vllm_rate, warmup_s=args.warmup,
                               duration_s=args.duration, seed=seed, max_tokens=4)
        if len(seeds) > 1:
            print(f"# vllm-chat, seed {seed}", flush=True)
        for _ in range(args.repeats):
            for router in chosen:
                row = measure(fleet, replicas, router, "vllm-chat", calls, args.warmup,
                              gateway_args=["--tokenizer", str(model)], block_size=32,
                              model=VLLM_MODEL)
                rows.append(replace(row, seed=seed))
                print_table_row(row)
    for replica in replicas:
        fleet.forget(replica)
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--cache-tokens", type=int, default=32_768)
    parser.add_argument("--prefill-tokens-per-s", type=float, default=20_000.0)
    parser.add_argument("--rate", type=float, default=16.0, help="req/s of each scenario")
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds per run")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--candidate", default="kvreuse:relative_spill",
                        help="the router judged against the best peer (issue 15's verdict)")
    parser.add_argument("--routers", default="all",
                        help="comma list: direct, peers' names, kvreuse:POLICY; 'all'")
    parser.add_argument("--overhead-rate", type=float, default=200.0)
    parser.add_argument("--overhead-duration", type=float, default=10.0)
    parser.add_argument("--overhead-policy", default="cache_aware")
    parser.add_argument("--throughput-duration", type=float, default=8.0)
    parser.add_argument("--throughput-concurrency", type=int, default=64)
    parser.add_argument("--skip-cost", action="store_true", help="skip the gateway-cost runs")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--seeds", type=parse_seeds, metavar="N,N-M,...",
                        help="measure each scenario (and --vllm's chats) on these seeded "
                             "streams (instead of --seed) and judge each router's mean over "
                             "them")
    parser.add_argument("--quick", action="store_true", help="smoke run: short, few routers")
    parser.add_argument("--vllm", action="store_true",
                        help="also compare on 2 real vLLM replicas (KVREUSE_VLLM_PYTHON)")
    parser.add_argument("--vllm-only", action="store_true", help="only the vLLM comparison")
    parser.add_argument("--vllm-rate", type=float, default=2.0)
    parser.add_argument("--vllm-cpus-apart", action="store_true",
                        help="pin each vLLM replica to a core of its own (the gateways and the "
                             "load generator still share them): else two CPU engines trade "
                             "cores, and an idle one speeds up the busy one")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every router on each scenario, interleaved; the verdicts "
                             "judge the medians (default 1)")
    parser.add_argument("--verdicts-from", type=Path, nargs="+",
                        help="print the verdicts of earlier --json runs of one setup, judging "
                             "each router's medians (no processes started)")
    parser.add_argument("--workdir", type=Path, help="process logs (default: a temp dir)")
    parser.add_argument("--record", type=Path, metavar="DIR",
                        help="kvreuse gateways record their traffic under DIR/SCENARIO--POLICY "
                             "(benchmarks/sim_vs_gateway.py replays their placements)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, not {args.repeats}")
    if args.quick:
        args.warmup, args.duration = 4.0, 6.0
        args.overhead_duration, args.throughput_duration = 3.0, 3.0
        if args.routers == "all":
            args.routers = "direct,sglang-router,kvreuse:round_robin,kvreuse:cache_aware"
    return args


def parse_seeds(text: str) -> tuple[int, ...]:
    """``--seeds``' value: distinct integers and ranges separated by commas (``1,2,7``,
    ``1-12``)."""
    seeds: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            seeds += range(int(first), int(last) + 1) if last else [int(first)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--seeds takes integers and ranges separated by commas (1,2,7 or 1-12), not "
            f"{text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"--seeds names no seed: {text!r}")
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"--seeds lists a seed twice: {text!r}")
    return tuple(seeds)


def router_list(spec: str) -> list[str]:
    if spec != "all":
        return [name.strip() for name in spec.split(",") if name.strip()]
    names = ["direct", *PEERS, *(f"kvreuse:{p}" for p in DESCRIPTIONS)]
    if not peers_available():
        print("peer routers not installed (run `make peers`): running kvreuse only",
              file=sys.stderr)
        names = [n for n in names if n not in PEERS]
    return names


SAME_SETUP = ("replicas", "cache_tokens", "prefill_tokens_per_s", "rate", "warmup", "duration",
              "max_tokens")
"""The arguments that make two ``--json`` files runs of one setup (the same engines and
traffic distribution); each row carries its stream's seed."""


def load_runs(paths: Sequence[Path]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The first file's arguments and every file's rows, from ``--json`` files of one setup;
    refuses (``SystemExit`` naming the file and the arguments) files whose setups differ. Each
    row has its stream's ``seed`` (rows saved before rows carried it: their file's ``--seed``)."""
    files = []
    for path in paths:
        try:
            data = json.loads(path.read_text())
            if not isinstance(data.get("args"), dict) or not isinstance(data.get("runs"), list):
                raise ValueError("no 'args' object and 'runs' list")
        except (OSError, ValueError, AttributeError) as exc:
            raise SystemExit(f"{path}: not a routers.py --json file ({exc})") from None
        for row in data["runs"]:
            if isinstance(row, dict) and row.get("seed") is None:
                row["seed"] = int(data["args"].get("seed", 7))
        files.append(data)
    saved = files[0]["args"]
    for path, data in zip(paths[1:], files[1:], strict=True):
        differ = [k for k in SAME_SETUP if str(data["args"].get(k)) != str(saved.get(k))]
        if differ:
            raise SystemExit(f"{path} was measured with other {', '.join(differ)} than "
                             f"{paths[0]}; use runs of one setup together")
    return saved, [row for data in files for row in data["runs"]]


def run_row(saved: dict[str, Any]) -> RunRow:
    """A row of a ``--json`` file (files from older runs carry other figures, left out)."""
    known = {f.name for f in fields(RunRow)}
    return RunRow(**{k: v for k, v in saved.items() if k in known})


def verdicts_from(paths: Sequence[Path], candidate: str) -> int:
    """The verdicts of saved runs of one setup (each router judged by its medians over every
    file; files of several stream seeds by the mean over the streams), the ceilings recomputed
    from the same seeded traffic."""
    saved, saved_rows = load_runs(paths)
    rows = [run_row(row) for row in saved_rows]
    ceilings: Ceilings = {}
    for scenario, seed in dict.fromkeys((r.scenario, r.seed) for r in rows):
        assert seed is not None, "load_runs gives every row its stream's seed"
        calls = scenario_calls(scenario, rate=float(saved["rate"]),
                               warmup_s=float(saved["warmup"]),
                               duration_s=float(saved["duration"]), seed=seed,
                               max_tokens=int(saved["max_tokens"]))
        pool = int(saved["replicas"]) * int(saved["cache_tokens"])
        ceilings[scenario, seed] = ceiling(calls, capacity_tokens=pool)
        print(f"{scenario:10} seed {seed}: ceiling one infinite cache {ceiling(calls):.1%}, "
              f"pooled LRU of {pool:,} tokens {ceilings[scenario, seed]:.1%}")
    if len(rows) > len(median_rows(rows)):
        print_medians(rows)
    seeds = seeds_of(rows)
    if len(seeds) > 1:
        print(f"# means over the streams of seeds {', '.join(str(seed) for seed in seeds)}")
        print_table(seed_means(rows))
    cost = json.loads(paths[0].read_text()).get("cost", {})
    for line in verdicts(rows, cost, ceilings, candidate):
        print(line)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.verdicts_from is not None:
        return verdicts_from(args.verdicts_from, args.candidate)
    routers = router_list(args.routers)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if args.vllm_only:
        scenarios, args.skip_cost = [], True
    seeds = args.seeds or (args.seed,)
    estimate = ((args.warmup + args.duration + 6) * len(routers) * len(scenarios)
                * args.repeats * len(seeds))
    if args.vllm or args.vllm_only:  # vLLM answers slowly: ~40 s more a run, ~1 min to start
        estimate += ((args.warmup + args.duration + 40) * len(routers) * args.repeats
                     * len(seeds) + 60)
    print(f"# {len(routers)} routers x {len(scenarios)} scenarios, about {estimate / 60:.0f} min"
          f" plus the gateway-cost runs", flush=True)
    spec = EngineSpec(model=MODEL, cache_tokens=args.cache_tokens,
                      prefill_tokens_per_s=args.prefill_tokens_per_s)
    rows: list[RunRow] = []
    cost: dict[str, dict[str, float]] = {}
    ceilings: Ceilings = {}
    with Fleet(args.workdir) as fleet:
        print(f"# logs in {fleet.workdir}", flush=True)
        if args.vllm or args.vllm_only:
            rows += vllm_section(fleet, args, routers, seeds)
        engines = fleet.start_engines(args.replicas, spec) if scenarios else []
        for scenario, seed in ((sc, seed) for sc in scenarios for seed in seeds):
            calls = scenario_calls(scenario, rate=args.rate, warmup_s=args.warmup,
                                   duration_s=args.duration, seed=seed,
                                   max_tokens=args.max_tokens)
            top = ceilings[scenario, seed] = ceiling(
                calls, capacity_tokens=args.replicas * args.cache_tokens)
            stream = f" seed {seed}" if len(seeds) > 1 else ""
            print(f"{scenario:10} {'ceiling (one infinite cache)':26} {ceiling(calls):8.1%}"
                  f"{stream}", flush=True)
            print(f"{scenario:10} {'ceiling (pooled LRU)':26} {top:8.1%}{stream}", flush=True)
            window = (surge_window(args.warmup, args.duration) if scenario == "surge"
                      else None)
            for repeat in range(args.repeats):
                suffix = (f"--seed{seed}" if len(seeds) > 1 else "") + (
                    f"--run{repeat + 1}" if args.repeats > 1 else "")
                for router in routers:
                    row = replace(measure(fleet, engines, router, scenario, calls, args.warmup,
                                          window=window, record=args.record,
                                          record_suffix=suffix), seed=seed)
                    rows.append(row)
                    if len(rows) == 1:
                        print_table([])
                    print_table_row(row)
        for engine in engines:
            fleet.forget(engine)
        if not args.skip_cost:
            # Cheap engines: the question is what the router adds, not the engines' queueing.
            light = EngineSpec(model=MODEL, events=False, overhead_ms=2.0, tpot_ms=1.0)
            engines = fleet.start_engines(args.replicas, light)
            cost["added_latency"] = added_latency(fleet, engines, args.overhead_policy,
                                                  args.overhead_rate, args.overhead_duration)
            for engine in engines:
                fleet.forget(engine)
            fast = EngineSpec(model=MODEL, events=False, overhead_ms=0.0, tpot_ms=0.0,
                              prefill_tokens_per_s=1e9)
            engines = fleet.start_engines(args.replicas, fast)
            cost["throughput"] = throughput(fleet, engines, args.overhead_policy,
                                            args.throughput_duration,
                                            args.throughput_concurrency)
    print()
    if args.repeats > 1:
        print(f"# medians of {args.repeats} runs")
        print_medians(rows)
        print()
    if len(seeds) > 1:
        print(f"# means over the streams of seeds {', '.join(str(seed) for seed in seeds)}")
        print_table(seed_means(rows))
        print()
    for line in verdicts(rows, cost, ceilings, args.candidate):
        print(line)
    for name, figures in cost.items():
        print(f"# {name}: " + ", ".join(f"{k}={v:.2f}" for k, v in figures.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "runs": [asdict(r) for r in rows], "cost": cost},
                                        indent=2))
    return 0


def print_table_row(row: RunRow) -> None:
    note = f"  ({row.error})" if row.error else ""
    if row.surge_hit_rate == row.surge_hit_rate:  # not NaN: the surge window's own figure
        note += f"  during the surge {row.surge_hit_rate:.1%}"
    print(f"{row.scenario:10} {row.router:26} {row.hit_rate:8.1%} {row.p50_ms:8.1f} "
          f"{row.p95_ms:8.1f} {row.max_over_mean:8.2f} {row.requests:6d} {row.lost:5d}{note}",
          flush=True)



if __name__ == "__main__":
    sys.exit(main())
