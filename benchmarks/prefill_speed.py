"""A gateway that measures its engines' prefill speed against one that assumes it.

``kvreuse route`` starts from 10,000 prefill tokens a second and 15 ms a request and, unless
``--fixed-prefill``, measures the engines' speed from its streamed answers
(kvreuse.routing.cost_fit). This script shows what that changes on engines far from the
assumption, in separate processes on loopback:

* two ``kvreuse engine`` replicas prefilling ``--engine-rate`` tokens a second (2,000: five
  times slower than assumed) after ``--engine-overhead-ms`` (20);
* warm-up: ``--warmup`` streamed completions of 100 to 800 unique tokens, four at a time
  (what a gateway in service has long since seen);
* then a burst: ``--burst`` streamed completions at ``--burst-rate`` a second (20), all sharing
  one ``--prefix-tokens`` (2,000) prefix and each ``--suffix-tokens`` (100) of its own. A hit
  costs an engine 0.02 + 100 / 2,000 = 0.07 s, so the prefix asks for 1.4 engines' worth; at
  the assumed speed it costs 0.025 s, 0.5 engines' worth, under the 0.8 of a holder at which
  ``relative_spill`` copies a prefix (its "copies for a prefix's demand").

For each gateway (measuring, then ``--fixed-prefill``), ``--repeats`` times on fresh engines,
it prints the speed routed on, how the burst was placed (requests per engine, misses) and the
burst's TTFT percentiles from the client, and the engines' token hit rate over the burst.

    PYTHONPATH=src .venv/bin/python benchmarks/prefill_speed.py --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import uuid
from collections.abc import Sequence

import httpx

from kvreuse.hitrate.prometheus import parse_exposition
from kvreuse.sim.summary import percentile
from kvreuse.testing.loadgen import Call, Result, fleet_hits, run_calls, scrape
from kvreuse.testing.processes import EngineSpec, Fleet, Process, wait_http

PREFILL_SERIES = ("kvreuse_gateway_prefill_tokens_per_second",
                  "kvreuse_gateway_prefill_overhead_seconds")


def text_of(tokens: int, seed: str) -> str:
    """``tokens`` tokens of 4 bytes (the engines' and gateway's approximation), from
    ``seed``."""
    unit = (seed + " ") * (tokens * 4 // (len(seed) + 1) + 1)
    return unit[: tokens * 4]


async def warm_up(url: str, requests: int) -> None:
    sizes = [100 + (i * 137) % 700 for i in range(requests)]
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def one(size: int) -> None:
            body = {"model": "sim", "prompt": text_of(size, uuid.uuid4().hex[:11]),
                    "max_tokens": 2, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                await response.aread()

        for start in range(0, requests, 4):
            await asyncio.gather(*(one(size) for size in sizes[start:start + 4]))


def burst_calls(args: argparse.Namespace) -> list[Call]:
    """``--burst`` streamed completions at ``--burst-rate`` a second sharing one prefix."""
    run = uuid.uuid4().hex
    prefix = text_of(args.prefix_tokens, run)
    return [Call(i / args.burst_rate, "/v1/completions", json.dumps({
        "model": "sim", "prompt": prefix + text_of(args.suffix_tokens, f"{i:04d}{run[:6]}"),
        "max_tokens": 2, "stream": True}).encode())
        for i in range(args.burst)]


def routed_speed(gateway: Process) -> str:
    text = httpx.get(gateway.url + "/metrics", timeout=5).text
    series = {s.name: s.value for s in parse_exposition(text, "gateway /metrics",
                                                         only=PREFILL_SERIES, strict=False)
              if s.label("model") == "sim"}
    if not series:
        return "10,000 tokens/s, 15.0 ms (assumed)"
    return (f"{series[PREFILL_SERIES[0]]:,.0f} tokens/s, "
            f"{series[PREFILL_SERIES[1]] * 1000:.1f} ms (measured)")


def one_run(fleet: Fleet, fixed: bool, args: argparse.Namespace) -> str:
    spec = EngineSpec(prefill_tokens_per_s=args.engine_rate,
                      overhead_ms=args.engine_overhead_ms, tpot_ms=1.0, events=False,
                      cache_tokens=65_536, block_size=16)
    engines = [fleet.start_engine(f"engine{i}-{uuid.uuid4().hex[:6]}", spec, wait=False)
               for i in range(2)]
    for engine in engines:
        wait_http(engine)
    name = f"gateway-{'fixed' if fixed else 'measuring'}-{uuid.uuid4().hex[:6]}"
    gateway = fleet.start_gateway(name, engines, policy="relative_spill", events=False,
                                  extra_args=["--fixed-prefill"] if fixed else [])
    urls = [engine.url for engine in engines]
    try:
        asyncio.run(warm_up(gateway.url, args.warmup))
        speed = routed_speed(gateway)
        before = scrape(urls)
        results: list[Result] = asyncio.run(run_calls(burst_calls(args),
                                                      lambda i, call: gateway.url))
        hits = fleet_hits(before, scrape(urls))
    finally:
        for proc in (gateway, *engines):
            fleet.forget(proc)
    failed = [r for r in results if r.status != 200 or r.error or r.ttft_s is None]
    if failed:
        raise RuntimeError(f"{len(failed)} burst requests failed, first: {failed[0].status} "
                           f"{failed[0].error[:200]}")
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    placed = sorted(r.upstream for r in results)
    per_engine = ", ".join(f"{placed.count(e)}" for e in sorted(set(placed)))
    return (f"| {'--fixed-prefill' if fixed else 'measuring'} | {speed} | {per_engine} | "
            f"{hits.hit_rate:.1%} | {statistics.median(ttfts) * 1000:.0f} ms | "
            f"{percentile(ttfts, 0.95) * 1000:.0f} ms | {max(ttfts) * 1000:.0f} ms |")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine-rate", type=float, default=2_000.0)
    parser.add_argument("--engine-overhead-ms", type=float, default=20.0)
    parser.add_argument("--warmup", type=int, default=48)
    parser.add_argument("--burst", type=int, default=60)
    parser.add_argument("--burst-rate", type=float, default=20.0)
    parser.add_argument("--prefix-tokens", type=int, default=2_000)
    parser.add_argument("--suffix-tokens", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if min(args.engine_rate, args.burst_rate) <= 0 or min(args.warmup, args.burst,
                                                          args.repeats) < 1:
        parser.error("rates must be > 0, counts >= 1")
    print(f"# two engines at {args.engine_rate:,.0f} prefill tokens/s + "
          f"{args.engine_overhead_ms:g} ms; {args.warmup} warm-up answers; a burst of "
          f"{args.burst} at {args.burst_rate:g}/s sharing {args.prefix_tokens:,} tokens",
          flush=True)
    print("| gateway | routed on | burst requests per engine | burst hit rate | p50 TTFT | "
          "p95 TTFT | max TTFT |")
    print("|---|---|---|---|---|---|---|", flush=True)
    with Fleet() as fleet:
        for _ in range(args.repeats):
            for fixed in (False, True):
                print(one_run(fleet, fixed, args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
