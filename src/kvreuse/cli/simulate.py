"""``kvreuse simulate``: run a named scenario or replay a trace through routing policies.

    kvreuse simulate --scenario belgavi [--policy a,b] [--replicas 3,6] [--seed N]
                     [--json FILE] [--report FILE.html]
    kvreuse simulate --trace FILE --replicas N --cache-tokens C --policy round_robin,exact

Prints a table (one row per policy × fleet size × variant); ``--json`` writes
``{"scenario", "seed", "parameters", "runs": [...], "bounds": {...}}``; ``--report`` writes a
self-contained HTML page with PNG plots (needs the ``report`` extra: matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvreuse.errors import ConfigError
from kvreuse.routing import POLICIES
from kvreuse.routing.relative_spill import SLACKS
from kvreuse.sim.config import CACHE_KINDS, SCHEDULERS, FleetConfig, ReplicaConfig
from kvreuse.sim.requests import SimRequest
from kvreuse.sim.runner import ScenarioRun, check, run_spec
from kvreuse.sim.scenarios import SPILLS, RunSpec, Scenario, get_scenario
from kvreuse.sim.trace import Bounds, compute_bounds, parse_trace


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "simulate", help="simulate a fleet: a named scenario or a trace through routing policies"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--scenario", help="a name from `kvreuse scenarios`")
    source.add_argument("--trace", type=Path, help="Mooncake-format JSONL trace to replay")
    parser.add_argument("--policy", help=f"comma-separated policies: {', '.join(POLICIES)}")
    parser.add_argument("--replicas", help="comma-separated fleet sizes, e.g. 3,6")
    parser.add_argument("--seed", type=int, default=0, help="workload and policy seed (0)")
    parser.add_argument("--json", type=Path, help="write results as JSON to this file")
    parser.add_argument("--report", type=Path, help="write an HTML report with plots here")
    parser.add_argument(
        "--scale", type=float, default=1.0,
        help="multiply the scenario's measured duration (e.g. 0.25 for a quick look)",
    )
    parser.add_argument("--cache-tokens", type=int, help="KV pool per replica, in tokens")
    parser.add_argument(
        "--trace-block-size", type=int, default=512, help="tokens per trace hash id (512)"
    )
    parser.add_argument("--prefill-rate", type=float, default=10_000.0,
                        help="trace: prefill tokens per second per replica (10000)")
    parser.add_argument("--overhead", type=float, default=0.015,
                        help="trace: prefill overhead per request, seconds (0.015)")
    parser.add_argument("--tpot", type=float, default=0.02,
                        help="trace: decode seconds per output token (0.02)")
    parser.add_argument("--scheduling", choices=SCHEDULERS, help="replica queue order")
    parser.add_argument(
        "--cache-kind", choices=tuple(CACHE_KINDS),
        help="replica cache: radix (SGLang, token granular) or block (vLLM's block pool)",
    )
    parser.add_argument(
        "--block-size", type=int, help="tokens per block with --cache-kind block (16)"
    )
    parser.add_argument("--load-lag", type=float, help="router's load view refresh, seconds")
    parser.add_argument("--kv-lag", type=float, help="KV event delay to the router, seconds")
    parser.set_defaults(func=run)


def _split(text: str | None) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()] if text else []


def _replica_counts(text: str | None) -> list[int]:
    counts = []
    for part in _split(text):
        try:
            value = int(part)
        except ValueError:
            raise ConfigError(f"--replicas takes integers like 3,6; got {part!r}") from None
        if value < 1:
            raise ConfigError(f"--replicas must be >= 1, got {value}")
        counts.append(value)
    return counts


def _policies(text: str | None) -> list[str]:
    names = _split(text)
    for name in names:
        if name not in POLICIES:
            raise ConfigError(f"unknown policy {name!r}; choose from: {', '.join(POLICIES)}")
    return names


def _adjust(config: FleetConfig, args: argparse.Namespace) -> FleetConfig:
    replica = config.replica
    if args.cache_tokens is not None:
        replica = replace(replica, pool_tokens=args.cache_tokens)
    if args.scheduling is not None:
        replica = replace(replica, scheduling=args.scheduling)
    if args.cache_kind is not None:
        replica = replace(replica, cache_kind=args.cache_kind)
    if args.block_size is not None:
        replica = replace(replica, block_size=args.block_size)
    config = replace(config, replica=replica)
    if args.load_lag is not None:
        config = replace(config, load_lag_s=args.load_lag)
    if args.kv_lag is not None:
        config = replace(config, kv_event_lag_s=args.kv_lag)
    return config


def _trace_scenario(args: argparse.Namespace, requests: list[SimRequest]) -> Scenario:
    if args.cache_tokens is None:
        raise ConfigError("--trace needs --cache-tokens (the KV pool of one replica, in tokens)")
    replica = ReplicaConfig(
        pool_tokens=args.cache_tokens,
        prefill_tokens_per_s=args.prefill_rate,
        overhead_s=args.overhead,
        time_per_output_token_s=args.tpot,
    )
    counts = _replica_counts(args.replicas) or [8]
    policies = _policies(args.policy) or ["round_robin", "cache_aware"]

    def fleet(replicas: int, variant: str) -> FleetConfig:
        return FleetConfig(replicas=replicas, replica=replica, kv_event_lag_s=0.0)

    return Scenario(
        name=f"trace:{args.trace.name}",
        summary=f"replay of {args.trace}",
        params=(),
        runs=tuple(RunSpec(p, n) for p in policies for n in counts),
        requests=lambda seed, variant, scale: requests,
        fleet=fleet,
    )


def run(args: argparse.Namespace) -> int:
    # Piped output (make demo, CI logs) gets a table wide enough to read, not rich's 80.
    console = Console() if Console().is_terminal else Console(width=110)
    if args.trace is not None:
        try:
            with args.trace.open(encoding="utf-8") as lines:
                requests = parse_trace(lines, args.trace_block_size, str(args.trace))
        except OSError as exc:
            raise ConfigError(f"cannot read --trace {args.trace}: {exc.strerror}") from None
        scenario = _trace_scenario(args, requests)
        specs = list(scenario.runs)
        parameters: dict[str, Any] = {
            "trace": str(args.trace),
            "trace_block_size": args.trace_block_size,
            "cache_tokens": args.cache_tokens,
            "prefill_tokens_per_s": args.prefill_rate,
            "overhead_s": args.overhead,
            "time_per_output_token_s": args.tpot,
            "requests": len(requests),
        }
    else:
        scenario = get_scenario(args.scenario)
        specs = scenario.select(_policies(args.policy), _replica_counts(args.replicas))
        parameters = scenario.parameters()
        if args.scale != 1.0:
            parameters["scale"] = args.scale
    if args.scale <= 0:
        raise ConfigError(f"--scale must be > 0, got {args.scale}")
    for option in ("cache_kind", "block_size", "scheduling", "load_lag", "kv_lag"):
        if getattr(args, option) is not None:
            parameters[option] = getattr(args, option)

    traffic: dict[str, list[SimRequest]] = {}
    for spec in specs:
        if spec.variant not in traffic:
            traffic[spec.variant] = scenario.requests(args.seed, spec.variant, args.scale)
    total = sum(len(traffic[s.variant]) for s in specs)
    rows: list[ScenarioRun] = []
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=console, transient=True, disable=total < 20_000,
    ) as progress:
        task = progress.add_task("simulating", total=total)
        done_before = 0
        for spec in specs:
            requests = traffic[spec.variant]
            fleet = _adjust(scenario.fleet(spec.replicas, spec.variant), args)

            def hook(label: str, done: int, _total: int, base: int = done_before) -> None:
                progress.update(task, completed=base + done, description=label)

            rows.append(run_spec(scenario, spec, requests, args.seed, hook, fleet))
            done_before += len(requests)
            progress.update(task, completed=done_before)

    bounds_variant = next((s.variant for s in specs if s.variant != "no_cache"), specs[0].variant)
    widest = max(s.replicas for s in specs)
    pool = _adjust(scenario.fleet(widest, bounds_variant), args).replica.pool_tokens
    bounds = compute_bounds(traffic[bounds_variant], widest, pool)
    _print_table(console, scenario, rows, bounds)

    if args.json is not None:
        payload = {
            "scenario": scenario.name,
            "seed": args.seed,
            "parameters": parameters,
            "runs": [_run_json(row) for row in rows],
            "bounds": bounds.as_dict(),
        }
        args.json.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
        console.print(f"wrote {args.json}")
    if args.report is not None:
        from kvreuse.cli.simreport import write_report

        sweep = _sweep(scenario, rows, traffic, args)
        knob = _slack_sweep(scenario, rows, traffic, args)
        write_report(args.report, scenario, rows, bounds, sweep, parameters, seed=args.seed,
                     knob=knob)
        console.print(f"report: {args.report}")
    return 0


def _sweep(
    scenario: Scenario,
    rows: Sequence[ScenarioRun],
    traffic: dict[str, list[SimRequest]],
    args: argparse.Namespace,
) -> list[ScenarioRun]:
    """Runs for the spill-threshold plot: the scenario's own sweep, else one on its traffic."""
    if scenario.sweep_option is not None:
        return [r for r in rows if any(k == scenario.sweep_option for k, _ in r.spec.options)]
    variant = next((r.spec.variant for r in rows if r.spec.variant != "no_cache"), None)
    if variant is None:
        return []
    replicas = min(r.spec.replicas for r in rows)
    out = []
    for spill in SPILLS:
        spec = RunSpec("cache_aware", replicas, variant, (("spill_threshold_s", spill),))
        fleet = _adjust(scenario.fleet(replicas, variant), args)
        out.append(run_spec(scenario, spec, traffic[variant], args.seed, None, fleet))
    return out


def _slack_sweep(
    scenario: Scenario,
    rows: Sequence[ScenarioRun],
    traffic: dict[str, list[SimRequest]],
    args: argparse.Namespace,
) -> list[ScenarioRun]:
    """relative_spill over its knob's values (SLACKS) on the first cached variant's traffic,
    at the smallest fleet of the run: the curve its one trade-off moves along."""
    variant = next((r.spec.variant for r in rows if r.spec.variant != "no_cache"), None)
    if variant is None:
        return []
    replicas = min(r.spec.replicas for r in rows)
    fleet = _adjust(scenario.fleet(replicas, variant), args)
    return [
        run_spec(scenario, RunSpec("relative_spill", replicas, variant, (("slack", slack),)),
                 traffic[variant], args.seed, None, fleet)
        for slack in SLACKS
    ]


def _json_default(value: Any) -> Any:
    return str(value)


def _run_json(row: ScenarioRun) -> dict[str, Any]:
    out: dict[str, Any] = dict(row.summary.as_dict())
    out["policy"] = row.spec.policy
    out["label"] = row.spec.label
    out["variant"] = row.spec.variant
    out["options"] = {
        k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in row.spec.options
    }
    return out


def _figure(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _print_table(
    console: Console, scenario: Scenario, rows: Sequence[ScenarioRun], bounds: Bounds
) -> None:
    table = Table(
        title=f"{scenario.name}: {scenario.summary}", box=box.SIMPLE_HEAD, padding=(0, 0, 0, 1)
    )
    # Policy labels are what a reader scans for: never cut them. Two-line headers and no right
    # padding keep the table within about 105 columns.
    table.add_column("policy", no_wrap=True)
    for name in (
        "replicas", "token\nhit", "request\nhit", "prefill\nGPU-s/1k", "TTFT\np50", "TTFT\np95",
        "max/mean\nload", "evicted\ntokens", "requests",
    ):
        table.add_column(name, justify="right", no_wrap=True)
    for row in rows:
        s = row.summary
        table.add_row(
            s.policy, str(s.replicas), f"{s.token_hit_rate:.1%}", f"{s.request_hit_rate:.1%}",
            f"{s.prefill_gpu_s_per_1k:.1f}", f"{s.ttft_p50_s:.3f}s", f"{s.ttft_p95_s:.3f}s",
            f"{s.max_over_mean_load:.2f}", f"{s.evicted_tokens:,}", f"{s.requests:,}",
        )
    console.print(table)
    console.print(
        f"bounds over {bounds.replicas} x {bounds.cache_tokens:,} tokens: infinite cache "
        f"{bounds.infinite_hit_rate:.1%}, pooled LRU {bounds.pooled_lru_hit_rate:.1%}"
    )
    for verdict in check(scenario, rows):
        exp = verdict.expectation
        mark = "[green]in range[/green]" if verdict.ok else "[red]OUT OF RANGE[/red]"
        console.print(
            f"{mark} {exp.policy} x{exp.replicas}{' ' + exp.variant if exp.variant else ''} "
            f"{exp.metric} = {_figure(verdict.value)} (seed range {exp.low:g}-{exp.high:g}; "
            f"{exp.source})"
        )
