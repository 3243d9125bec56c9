"""A digest of every seeded simulator run, to prove speed work changed no result.

Prints one line per run, ``SCENARIO LABEL DIGEST``: each scenario's own runs, then every
registered policy (default options, the scenario's first fleet size) on each scenario, then
every policy on the shared Mooncake trace at block granularity (8 replicas of 200,000 tokens,
KV events without lag). The digest is the first 16 hex digits of the sha256 of the run's
records, evictions, prefill busy times, requests and blocked admissions per replica, event
count and end time. Run it on two trees and diff the outputs (the first line says which core
ran; a compiled and a pure-Python core must agree too):

    PYTHONPATH=src .venv/bin/python benchmarks/sim_digests.py > after.txt
    diff <(grep -v '^#' before.txt) <(grep -v '^#' after.txt)

Several minutes on one core (``--scale`` shrinks the scenarios' traffic).
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from kvreuse import native
from kvreuse.errors import ConfigError
from kvreuse.routing.registry import policy_names
from kvreuse.sim import FleetConfig, ReplicaConfig
from kvreuse.sim.requests import FleetRun
from kvreuse.sim.runner import run_scenario, simulate
from kvreuse.sim.scenarios import SCENARIOS, RunSpec
from kvreuse.trace import parse_trace_lines, trace_requests

TRACE = Path(__file__).resolve().parents[1].parent / "shared/data/mooncake_synthetic_trace.jsonl"


def digest(run: FleetRun) -> str:
    state = (run.records, run.evicted_tokens, run.prefill_busy_s, run.requests_per_replica,
             run.blocked_admissions, run.events_processed, run.end_time_s)
    return hashlib.sha256(repr(state).encode()).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--trace", type=Path, default=TRACE)
    args = parser.parse_args()
    print(f"# core: {native.status().reason}; scale {args.scale:g}")
    for name, scenario in SCENARIOS.items():
        specs = list(scenario.runs)
        specs += [RunSpec(policy, scenario.runs[0].replicas) for policy in policy_names()]
        for spec in specs:
            try:
                rows = run_scenario(scenario, 0, [spec], args.scale)
            except ConfigError as exc:  # a policy this scenario cannot run: say so, go on
                print(f"{name} {spec.label} refused: {exc}", flush=True)
                continue
            print(f"{name} {spec.label} {digest(rows[0].run)}", flush=True)
    if not args.trace.exists():
        print(f"# no trace at {args.trace}: trace runs skipped")
        return
    with args.trace.open("rb") as lines:
        records = parse_trace_lines(lines, str(args.trace))
    requests, units = trace_requests(records, 512, "block")
    config = FleetConfig(8, ReplicaConfig(pool_tokens=200_000), kv_event_lag_s=0.0)
    for policy in policy_names():
        run = simulate(policy, {}, config, requests, 0, units=units)
        print(f"mooncake block {policy} {digest(run)}", flush=True)


if __name__ == "__main__":
    main()
