"""The gateway's memory under a prompt flood: are its indexes bounded?

One ``kvreuse route --policy cache_aware`` (the approximate trees: what grew without a bound
before the per-upstream budgets) in front of ``--engines`` ``kvreuse engine`` processes with
``--engine-cache-tokens`` of KV cache each (the gateway reads that capacity from each engine's
``vllm:cache_config_info`` and bounds every index to twice it). Phases, closed loop at
``--concurrency`` requests in flight:

1. **warm**: documents of ~1,000 tokens from a pool of 2,000, until every upstream's index holds
   90 % of its budget (or ``--warm-max`` requests): the gateway's working size;
2. **flood 1**: 200,000 unique prompts of ~256 tokens;
3. **flood 2**: 60,000 unique prompts of ~4,000 tokens, then **flood 3** the same 60,000 again;
4. **after**: the warm traffic again (as many requests as warm-up took, at most 5,000).

``--scale`` multiplies the flood counts (0.1: 20,000 then 2 x 6,000). Prompts are hex text, so
the gateway's and the engines' token approximation (one token per 4 bytes) sees exactly the
intended lengths. The gateway's RSS is sampled every 0.5 s; printed: RSS after each phase and
its peak, the index sizes against their budgets, requests per second, errors.

Targets (issue 14): RSS under 300 MB throughout, and after the flood within 20 % of the warm
size.

    .venv/bin/python benchmarks/index_flood.py --scale 0.1
    .venv/bin/python benchmarks/index_flood.py                 # the full flood (~15-30 min)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvreuse.hitrate.prometheus import parse_exposition
from kvreuse.testing.processes import EngineSpec, Fleet, Process
from kvreuse.testing.rawhttp import RawClient

MODEL = "sim"


def hex_prompt(seed: int, tokens: int) -> str:
    """~``tokens`` tokens of text unique to ``seed`` (hex: 4 characters per token)."""
    return random.Random(seed).randbytes(tokens * 2).hex()


def body(prompt: str) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()


@dataclass
class Phase:
    name: str
    sent: int = 0
    errors: int = 0
    seconds: float = 0.0
    rss_end_mb: float = 0.0
    rss_peak_mb: float = 0.0
    index_tokens: dict[str, float] = field(default_factory=dict)
    error_examples: list[str] = field(default_factory=list)


class RssSampler:
    """The gateway's VmRSS every ``every_s`` seconds, in a thread; ``peak()`` since reset."""

    def __init__(self, proc: Process, every_s: float = 0.5) -> None:
        self.proc = proc
        self.every_s = every_s
        self.samples: list[tuple[float, float]] = []
        self._peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            rss = self.proc.rss_bytes() / 2**20
            self.samples.append((time.monotonic(), rss))
            self._peak = max(self._peak, rss)

    def now_mb(self) -> float:
        return self.proc.rss_bytes() / 2**20

    def take_peak(self) -> float:
        peak, self._peak = max(self._peak, self.now_mb()), 0.0
        return peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def gauges(url: str, family: str) -> dict[str, float]:
    """``family{upstream="..."} value`` lines of the gateway's /metrics, by upstream."""
    samples = parse_exposition(httpx.get(url + "/metrics", timeout=10).text, only=(family,))
    return {upstream: s.value for s in samples if (upstream := s.label("upstream")) is not None}


async def drive(url: str, bodies: Iterator[bytes], concurrency: int, phase: Phase,
                stop: Callable[[], bool] = lambda: False, label: str = "") -> None:
    """Send every body (closed loop, ``concurrency`` at a time) until done or ``stop()``."""
    client = RawClient(timeout_s=60.0)
    started = time.perf_counter()
    next_report = started + 10.0
    headers = {"content-type": "application/json"}

    async def worker() -> None:
        nonlocal next_report
        for payload in bodies:
            if stop():
                return
            reply = await client.post(url + "/v1/completions", payload, headers)
            phase.sent += 1
            if reply.error or reply.status != 200:
                phase.errors += 1
                if len(phase.error_examples) < 5:
                    phase.error_examples.append(
                        reply.error or f"HTTP {reply.status}: {reply.tail[:200]!r}")
            now = time.perf_counter()
            if now >= next_report:
                next_report = now + 10.0
                print(f"#   {label} {phase.sent:,} sent, {phase.sent / (now - started):.0f} "
                      f"req/s", flush=True)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.close()
    phase.seconds = time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--engine-cache-tokens", type=int, default=262_144)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--warm-max", type=int, default=20_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    short_count = int(200_000 * args.scale)
    long_count = int(60_000 * args.scale)
    spec = EngineSpec(model=MODEL, cache_tokens=args.engine_cache_tokens,
                      prefill_tokens_per_s=1e9, overhead_ms=0.0, tpot_ms=0.0, events=False)
    phases: list[Phase] = []
    with Fleet() as fleet:
        print(f"# logs in {fleet.workdir}", flush=True)
        engines = fleet.start_engines(args.engines, spec)
        gateway = fleet.start_gateway("gateway", engines, policy=args.policy, events=False,
                                      extra_args=["--metrics-interval", "1"])
        sampler = RssSampler(gateway)
        deadline = time.monotonic() + 10
        budgets: dict[str, float] = {}
        while time.monotonic() < deadline:
            budgets = gauges(gateway.url, "kvreuse_gateway_index_budget_tokens")
            expected = args.engine_cache_tokens * 2
            if budgets and all(abs(v - expected) <= 64 for v in budgets.values()):
                break
            time.sleep(0.2)
        print(f"# gateway RSS at start {sampler.now_mb():.1f} MiB; index budgets (tokens): "
              f"{json.dumps(budgets)}", flush=True)
        sampler.take_peak()

        def run(name: str, bodies: Iterator[bytes],
                stop: Callable[[], bool] = lambda: False) -> Phase:
            phase = Phase(name)
            print(f"# {name} ...", flush=True)
            asyncio.run(drive(gateway.url, bodies, args.concurrency, phase, stop, name))
            time.sleep(1.0)
            phase.rss_end_mb = sampler.now_mb()
            phase.rss_peak_mb = sampler.take_peak()
            phase.index_tokens = gauges(gateway.url, "kvreuse_gateway_index_tokens")
            phases.append(phase)
            print(f"#   {name}: {phase.sent:,} requests in {phase.seconds:.0f} s, RSS end "
                  f"{phase.rss_end_mb:.1f} MiB, peak {phase.rss_peak_mb:.1f} MiB, index "
                  f"tokens {json.dumps(phase.index_tokens)}", flush=True)
            return phase

        def warm_bodies(seed: int, limit: int) -> Iterator[bytes]:
            rng = random.Random(seed)
            for _ in range(limit):
                doc = rng.randrange(2000)
                yield body(hex_prompt(doc, 1000) + " " + hex_prompt(10**9 + rng.randrange(10**9),
                                                                    16))

        checked = {"at": 0.0, "full": False}

        def index_full() -> bool:
            now = time.monotonic()
            if now - checked["at"] >= 2.0:
                checked["at"] = now
                sizes = gauges(gateway.url, "kvreuse_gateway_index_tokens")
                checked["full"] = bool(sizes) and all(
                    sizes.get(name, 0) >= 0.9 * budget for name, budget in budgets.items())
            return checked["full"]

        warm = run("warm", warm_bodies(1, args.warm_max), index_full)
        run("flood 1: unique ~256-token prompts",
            (body(hex_prompt(2 * 10**9 + i, 256)) for i in range(short_count)))
        run("flood 2: unique ~4,000-token prompts",
            (body(hex_prompt(3 * 10**9 + i, 4000)) for i in range(long_count)))
        run("flood 3: the same ~4,000-token prompts again",
            (body(hex_prompt(3 * 10**9 + i, 4000)) for i in range(long_count)))
        after = run("after: warm traffic again", warm_bodies(2, min(warm.sent, 5000)))
        sampler.stop()
        alive = gateway.alive()
        samples = sampler.samples
    peak = max((p.rss_peak_mb for p in phases), default=0.0)
    growth = (after.rss_end_mb - warm.rss_end_mb) / warm.rss_end_mb
    over_budget = {
        phase.name: name for phase in phases for name, tokens in phase.index_tokens.items()
        if tokens > budgets.get(name, float("inf")) + 4096  # + one prompt kept whole
    }
    print()
    print("| phase | requests | req/s | errors | RSS end MiB | RSS peak MiB | index tokens |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for p in phases:
        rate = p.sent / p.seconds if p.seconds else 0.0
        sizes = ", ".join(f"{v:,.0f}" for v in p.index_tokens.values())
        print(f"| {p.name} | {p.sent:,} | {rate:,.0f} | {p.errors:,} | {p.rss_end_mb:.1f} | "
              f"{p.rss_peak_mb:.1f} | {sizes} |")
    checks = [
        ("RSS under 300 MB throughout", peak * 2**20 < 300e6, f"peak {peak:.1f} MiB"),
        ("RSS after the flood within 20 % of warm", abs(growth) <= 0.20,
         f"{warm.rss_end_mb:.1f} -> {after.rss_end_mb:.1f} MiB ({growth:+.1%})"),
        ("indexes within budget", not over_budget, json.dumps(over_budget) or "-"),
        ("no errors", all(p.errors == 0 for p in phases),
         "; ".join(e for p in phases for e in p.error_examples[:2])),
        ("gateway survived", alive, ""),
    ]
    print()
    for name, ok, detail in checks:
        print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "args": vars(args) | {"json": str(args.json)}, "budgets": budgets,
            "phases": [vars(p) for p in phases],
            "rss_mb_every_0_5s": [round(v, 1) for _, v in samples],
        }, indent=2, default=str))
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
