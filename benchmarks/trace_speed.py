"""A million trace requests, parsed and simulated at block granularity, on one core.

Target (issue 16): one million Mooncake-format trace requests parse and simulate in under 60 s on
one core. The trace is synthetic (:func:`kvreuse.testing.mooncake.iter_synthetic_mooncake`:
Zipf-skewed shared documents of 12 blocks plus a private block, 512-token blocks), written to a
temporary file first (not timed); then parsing (:func:`kvreuse.trace.parse_trace_lines` and
:func:`kvreuse.trace.trace_requests`) and one simulation per ``--policy`` over ``--replicas``
replicas are timed, each on its own, and the verdict is parse + the slowest simulation, in CPU
seconds of this one process (wall seconds are printed too; on a shared machine they count the
waits for a core that other processes cause).
The first line says whether the compiled core runs (``make native``).
Run: ``.venv/bin/python benchmarks/trace_speed.py [--requests 1000000]
[--policy round_robin,cache_aware]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path

from kvreuse import native
from kvreuse.sim import FleetConfig, ReplicaConfig, summarize
from kvreuse.sim.runner import simulate
from kvreuse.testing.mooncake import iter_synthetic_mooncake
from kvreuse.trace import parse_trace_lines, trace_requests

TARGET_S = 60.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--policy", default="round_robin,cache_aware")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--cache-tokens", type=int, default=200_000)
    parser.add_argument("--rate", type=float, default=40.0, help="requests per second")
    args = parser.parse_args()
    print(f"core: {native.status().reason}")
    print(f"load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "trace.jsonl"
        start = time.perf_counter()
        with path.open("w") as out:
            for line in iter_synthetic_mooncake(
                seed=1, requests=args.requests, requests_per_second=args.rate
            ):
                out.write(line + "\n")
        print(f"generated {args.requests:,} requests ({path.stat().st_size / 1e6:,.0f} MB) in "
              f"{time.perf_counter() - start:.1f} s (not timed)")
        start, start_cpu = time.perf_counter(), time.process_time()
        with path.open("rb") as lines:
            records = parse_trace_lines(lines, str(path))
        requests, units = trace_requests(records, 512, "block")
        del records
        parse_s = time.process_time() - start_cpu
        parse_wall = time.perf_counter() - start
    print(f"parse: {parse_s:.1f} CPU s, {parse_wall:.1f} wall s "
          f"({len(requests) / parse_s:,.0f} lines per CPU second)")
    config = FleetConfig(
        args.replicas, ReplicaConfig(pool_tokens=args.cache_tokens), kv_event_lag_s=0.0
    )
    slowest = ("", 0.0)
    for policy in args.policy.split(","):
        gc.collect()
        start, start_cpu = time.perf_counter(), time.process_time()
        run = simulate(policy, {}, config, requests, units=units)
        sim_s = time.process_time() - start_cpu
        wall = time.perf_counter() - start
        summary = summarize(run)
        del run
        print(f"  {policy:<18} x{args.replicas}: simulated in {sim_s:.1f} CPU s, {wall:.1f} "
              f"wall s ({len(requests) / sim_s:,.0f} req per CPU second); token hit "
              f"{summary.token_hit_rate:.1%}, TTFT p95 {summary.ttft_p95_s:.3f} s")
        if sim_s > slowest[1]:
            slowest = (policy, sim_s)
    total = parse_s + slowest[1]
    verdict = "PASS" if total < TARGET_S and args.requests >= 1_000_000 else "FAIL"
    if args.requests < 1_000_000:
        verdict = "info"
    label = "compiled core" if native.status().compiled else "pure-Python core"
    print(f"[{verdict}] {args.requests:,} trace requests: parse {parse_s:.1f} + slowest "
          f"simulation ({slowest[0]}) {slowest[1]:.1f} = {total:.1f} CPU s (target < "
          f"{TARGET_S:g} s for 1,000,000) [{label}]")


if __name__ == "__main__":
    main()
