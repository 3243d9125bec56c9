"""``kvreuse simulate``: run a named scenario or replay a trace through routing policies.

    kvreuse simulate --scenario belgavi [--policy a,b[key=value]] [--replicas 3,6] [--seed N]
                     [--policy-option KEY=VALUE] [--json FILE|-] [--report FILE.html]
    kvreuse simulate --trace FILE --replicas N --cache-tokens C --policy round_robin,exact

Prints a table (one row per run, labelled with its policy options and variant, plus a no-cache
baseline of each policy on its fleet size); ``--json`` writes ``{"scenario", "seed",
"parameters", "runs": [...], "bounds": {...}, "bounds_by_replicas": [...]}`` (``-``: to
stdout, the table then goes to stderr); ``--report`` writes a self-contained HTML page with PNG
plots (needs the ``report`` extra: matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from kvreuse import defaults
from kvreuse.cli.args import (
    bounded,
    key_value,
    non_negative_float,
    output_file,
    policy_spec,
    positive_float,
    positive_int,
    speed_change,
    speed_list,
    split_policies,
    trace_file,
)
from kvreuse.cli.files import write_whole
from kvreuse.cli.tables import make_console, print_table, progress_bar
from kvreuse.errors import ConfigError, require_at_least
from kvreuse.routing import POLICIES, policy_option_names
from kvreuse.routing.base import CostModel
from kvreuse.routing.relative_spill import SLACKS
from kvreuse.sim.config import (
    CACHE_KINDS,
    LOAD_VIEWS,
    SCHEDULERS,
    SPEED_VIEWS,
    FleetConfig,
    ReplicaConfig,
    speeds_for,
)
from kvreuse.sim.requests import SimRequest
from kvreuse.sim.runner import ScenarioRun, Verdict, check, run_spec
from kvreuse.sim.scenarios import SPILLS, RunSpec, Scenario, get_scenario
from kvreuse.sim.trace import Bounds, fleet_bounds
from kvreuse.sim.units import TraceUnits
from kvreuse.trace import DEFAULT_BLOCK_TOKENS, GRANULARITIES, parse_trace_lines, trace_requests

MAX_SCALE = 100.0
"""A hundred times a scenario's window is hours of simulated traffic: more is a typing mistake."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "simulate", help="simulate a fleet: a named scenario or a trace through routing policies"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--scenario", help="a name from `kvreuse scenarios`")
    source.add_argument("--trace", type=Path, help="Mooncake-format JSONL trace to replay")
    parser.add_argument(
        "--policy",
        help=f"comma-separated policies: {', '.join(POLICIES)}; options in brackets as the "
        "table labels print them, e.g. prefix_hash[overload=None]",
    )
    parser.add_argument(
        "--policy-option", action="append", default=[], metavar="KEY=VALUE",
        help="a policy keyword option for every chosen policy that takes it, as `kvreuse "
        "route` takes it, e.g. overload=null or spill_threshold_s=0.1 (repeatable)",
    )
    parser.add_argument("--replicas", help="comma-separated fleet sizes, e.g. 3,6")
    parser.add_argument(
        "--seed", type=int, default=defaults.SEED,
        help=f"workload and policy seed ({defaults.SEED})",
    )
    parser.add_argument(
        "--no-baseline", action="store_true",
        help="leave out the no-cache baseline row of each policy and fleet size",
    )
    parser.add_argument(
        "--json", type=output_file, metavar="FILE",
        help="write results as JSON to this file (- for stdout; the table goes to stderr)",
    )
    parser.add_argument("--report", type=output_file, help="write an HTML report with plots here")
    parser.add_argument(
        "--lab-url", default=defaults.lab_base_url(), metavar="URL",
        help="where the report's 'open in lab' links point: the address `kvreuse lab` serves "
        f"on (default {defaults.lab_base_url()})",
    )
    parser.add_argument(
        "--scale", type=bounded(positive_float, MAX_SCALE), default=1.0,
        help="multiply the scenario's measured duration (e.g. 0.25 for a quick look; at most "
        f"{MAX_SCALE:g})",
    )
    parser.add_argument(
        "--cache-tokens", type=positive_int, help="KV pool per replica, in tokens"
    )
    parser.add_argument(
        "--trace-block-size", type=int, default=DEFAULT_BLOCK_TOKENS,
        help=f"tokens per trace hash id ({DEFAULT_BLOCK_TOKENS})",
    )
    parser.add_argument(
        "--trace-granularity", choices=GRANULARITIES, default="block",
        help="trace: simulate one hash id as one unit of block tokens (block, fast) or expand "
             "each id into its tokens (token, exact lengths)",
    )
    parser.add_argument("--prefill-rate", type=float, default=defaults.TRACE_PREFILL_TOKENS_PER_S,
                        help="trace: prefill tokens per second per replica "
                        f"({defaults.TRACE_PREFILL_TOKENS_PER_S:g})")
    parser.add_argument("--overhead", type=float, default=defaults.TRACE_OVERHEAD_S,
                        help="trace: prefill overhead per request, seconds "
                        f"({defaults.TRACE_OVERHEAD_S:g})")
    parser.add_argument("--tpot", type=float, default=defaults.TRACE_TIME_PER_OUTPUT_TOKEN_S,
                        help="trace: decode seconds per output token "
                        f"({defaults.TRACE_TIME_PER_OUTPUT_TOKEN_S:g})")
    parser.add_argument("--scheduling", choices=SCHEDULERS, help="replica queue order")
    parser.add_argument(
        "--cache-kind", choices=tuple(CACHE_KINDS),
        help="replica cache: radix (SGLang, token granular) or block (vLLM's block pool)",
    )
    parser.add_argument(
        "--block-size", type=positive_int, help="tokens per block with --cache-kind block (16)"
    )
    parser.add_argument(
        "--load-lag", type=non_negative_float, help="router's load view refresh, seconds"
    )
    parser.add_argument(
        "--kv-lag", type=non_negative_float, help="KV event delay to the router, seconds"
    )
    parser.add_argument(
        "--load-view", choices=LOAD_VIEWS,
        help="whose queue the router sees: the replica's own (replica, the default) or what a "
        "gateway knows, the prompts it sent less its predicted hits until each first token "
        "(router; as kvreuse route counts)",
    )
    parser.add_argument(
        "--first-byte-lag", type=non_negative_float,
        help="with --load-view router: seconds from a replica's first token until the router "
        "hears of it (the response's HTTP hop; 0.002 models kvreuse route on one host)",
    )
    parser.add_argument(
        "--last-byte-lag", type=non_negative_float,
        help="with --load-view router: seconds from a replica's last token until the router "
        "hears the response end and stops counting it in flight (0.008 models kvreuse route "
        "on one host)",
    )
    parser.add_argument(
        "--prefill-speeds", type=speed_list, metavar="S1,S2,...",
        help="replicas of other speeds: the first replicas' prefill rates as multiples of the "
        "configured one (0.25,1: the first at a quarter, the second at the full rate); "
        "replicas beyond the list run at 1",
    )
    parser.add_argument(
        "--speed-change", type=speed_change, action="append", metavar="AT:REPLICA:SPEED",
        help="a replica's prefill speed changes mid-run: from AT simulated seconds on, the "
        "prefills REPLICA (an index: 0 or r0) starts run at SPEED times the configured rate "
        "(30:r0:0.25 throttles r0 at 30 s; 90:r0:1 restores it); repeatable",
    )
    parser.add_argument(
        "--speed-view", choices=SPEED_VIEWS,
        help="with --prefill-speeds or --speed-change, what the router knows of the speeds: "
        "measured from first tokens as kvreuse route does (the default), known (upstreams "
        "given weight=), or alike (kvreuse route --fixed-prefill)",
    )
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
        require_at_least("--replicas", value, 1)
        counts.append(value)
    return counts


Choice = tuple[str, tuple[tuple[str, Any], ...]]
"""A policy name and its options, as a :class:`RunSpec` holds them."""


def _policies(text: str | None) -> list[Choice]:
    chosen: list[Choice] = []
    for item in split_policies(text or ""):
        name, options = policy_spec(item)
        if name not in POLICIES:
            raise ConfigError(f"unknown policy {name!r}; choose from: {', '.join(POLICIES)}")
        accepted = policy_option_names(name)
        for key in options:
            if key not in accepted:
                raise ConfigError(
                    f"--policy {item}: {name} has no option {key!r}; it takes: "
                    f"{', '.join(sorted(accepted)) or 'none'}"
                )
        chosen.append((name, tuple(options.items())))
    return chosen


def _select(scenario: Scenario, chosen: list[Choice], counts: list[int]) -> list[RunSpec]:
    """The scenario's runs, or every chosen policy (default: the scenario's own, with their
    options) on every chosen fleet size (default: the scenario's) under each of its variants."""
    if not chosen and not counts:
        return list(scenario.runs)
    variants = list(dict.fromkeys(spec.variant for spec in scenario.runs))
    policies = chosen or list(dict.fromkeys((s.policy, s.options) for s in scenario.runs))
    sizes = counts or list(dict.fromkeys(spec.replicas for spec in scenario.runs))
    return [
        RunSpec(policy, n, variant, options)
        for variant in variants
        for policy, options in policies
        for n in sizes
    ]


def _with_options(specs: list[RunSpec], items: Sequence[str]) -> list[RunSpec]:
    """``--policy-option KEY=VALUE`` set on every run whose policy takes ``KEY``."""
    out = list(specs)
    for item in items:
        key, value = key_value(item, "--policy-option")
        takers = [i for i, s in enumerate(out) if key in policy_option_names(s.policy)]
        if not takers:
            names = sorted({s.policy for s in out})
            raise ConfigError(
                f"--policy-option {item}: none of the chosen policies ({', '.join(names)}) "
                f"takes {key!r}"
            )
        for i in takers:
            spec = out[i]
            options = dict(spec.options)
            options[key] = value
            out[i] = replace(spec, options=tuple(options.items()))
    return out


def _with_baselines(specs: list[RunSpec]) -> list[RunSpec]:
    """Each (policy, fleet size) once more with prefix caching off, unless the runs have it:
    what the same routing costs when nothing is reused, so every row's saving can be read."""
    have = {(s.policy, s.replicas) for s in specs if s.variant == "no_cache"}
    extra = []
    for spec in specs:
        key = (spec.policy, spec.replicas)
        if key not in have:
            have.add(key)
            extra.append(RunSpec(spec.policy, spec.replicas, "no_cache"))
    return specs + extra


def _given(**values: Any) -> dict[str, Any]:
    """The flags' values that were given (not None), by the config field they replace."""
    return {name: value for name, value in values.items() if value is not None}


def _adjust(config: FleetConfig, args: argparse.Namespace, variant: str = "") -> FleetConfig:
    replica = config.replica
    if variant == "no_cache":
        replica = replace(replica, prefix_caching=False)
    replica = replace(replica, **_given(pool_tokens=args.cache_tokens, scheduling=args.scheduling,
                                        cache_kind=args.cache_kind, block_size=args.block_size))
    speeds = speeds_for(args.prefill_speeds, config.replicas)
    changes = tuple(args.speed_change or ())
    if speeds is None and not changes and args.speed_view is not None:
        raise ConfigError("--speed-view says what the router knows of the replicas' speeds: "
                          "give --prefill-speeds or --speed-change too")
    for _, index, _ in changes:
        if index >= config.replicas:
            raise ConfigError(f"--speed-change names replica r{index}, but a fleet of "
                              f"{config.replicas} has r0 to r{config.replicas - 1}")
    return replace(config, replica=replica, **_given(
        load_lag_s=args.load_lag, kv_event_lag_s=args.kv_lag, load_view=args.load_view,
        first_byte_lag_s=args.first_byte_lag, last_byte_lag_s=args.last_byte_lag,
        prefill_speeds=speeds, speed_view=args.speed_view, speed_changes=changes or None))


def _trace_scenario(args: argparse.Namespace, requests: list[SimRequest]) -> Scenario:
    if args.cache_tokens is None:
        raise ConfigError("--trace needs --cache-tokens (the KV pool of one replica, in tokens)")
    for flag, value in (("--prefill-rate", args.prefill_rate), ("--overhead", args.overhead),
                        ("--tpot", args.tpot)):
        if not math.isfinite(value):
            raise ConfigError(f"{flag} must be a finite number, got {value}")
    replica = ReplicaConfig(
        pool_tokens=args.cache_tokens,
        prefill_tokens_per_s=args.prefill_rate,
        overhead_s=args.overhead,
        time_per_output_token_s=args.tpot,
    )
    counts = _replica_counts(args.replicas) or [defaults.TRACE_REPLICAS]
    policies = _policies(args.policy) or [(p, ()) for p in defaults.TRACE_POLICIES]

    def fleet(replicas: int, variant: str) -> FleetConfig:
        return FleetConfig(replicas=replicas, replica=replica, kv_event_lag_s=0.0)

    return Scenario(
        name=f"trace:{args.trace.name}",
        summary=f"replay of {args.trace}",
        params=(),
        runs=tuple(RunSpec(p, n, "", options) for p, options in policies for n in counts),
        requests=lambda seed, variant, scale: requests,
        fleet=fleet,
    )


def run(args: argparse.Namespace) -> int:
    to_stdout = args.json is not None and str(args.json) == "-"
    # With --json -, stdout carries the JSON alone; people read the table on stderr.
    console = make_console(stderr=to_stdout)
    units: TraceUnits | None = None
    cost: CostModel | None = None
    if args.trace is not None:
        try:
            with trace_file(args.trace, "--trace").open("rb") as lines:
                records = parse_trace_lines(lines, str(args.trace), args.trace_block_size)
        except OSError as exc:
            raise ConfigError(f"cannot read --trace {args.trace}: {exc.strerror}") from None
        requests, units = trace_requests(
            records, args.trace_block_size, args.trace_granularity, str(args.trace)
        )
        cost = CostModel(prefill_tokens_per_s=args.prefill_rate, overhead_s=args.overhead)
        scenario = _trace_scenario(args, requests)
        specs = list(scenario.runs)
        parameters: dict[str, Any] = {
            "trace": str(args.trace),
            "trace_block_size": args.trace_block_size,
            "trace_granularity": args.trace_granularity,
            "cache_tokens": args.cache_tokens,
            "prefill_tokens_per_s": args.prefill_rate,
            "overhead_s": args.overhead,
            "time_per_output_token_s": args.tpot,
            "requests": len(requests),
        }
    else:
        scenario = get_scenario(args.scenario)
        specs = _select(scenario, _policies(args.policy), _replica_counts(args.replicas))
        parameters = scenario.parameters()
        if args.scale != 1.0:
            parameters["scale"] = args.scale
    if args.scale <= 0:
        raise ConfigError(f"--scale must be > 0, got {args.scale}")
    specs = _with_options(specs, args.policy_option)
    asked = set(specs)
    if not args.no_baseline:
        specs = _with_baselines(specs)
    for option in ("cache_kind", "block_size", "scheduling", "load_lag", "kv_lag", "load_view",
                   "first_byte_lag", "last_byte_lag", "prefill_speeds", "speed_view",
                   "speed_change"):
        if getattr(args, option) is not None:
            value = getattr(args, option)
            parameters[option] = (list(value) if isinstance(value, tuple)
                                  else [list(v) for v in value] if isinstance(value, list)
                                  else value)
    if args.cache_tokens is not None and args.trace is None:
        parameters["pool_tokens"] = args.cache_tokens

    traffic: dict[str, list[SimRequest]] = {}
    for spec in specs:
        if spec.variant not in traffic:
            traffic[spec.variant] = scenario.requests(args.seed, spec.variant, args.scale)
    total = sum(len(traffic[s.variant]) for s in specs)
    rows: list[ScenarioRun] = []
    with progress_bar(console, disable=total < 20_000) as progress:
        task = progress.add_task("simulating", total=total)
        done_before = 0
        for spec in specs:
            requests = traffic[spec.variant]
            fleet = _adjust(scenario.fleet(spec.replicas, spec.variant), args, spec.variant)

            def hook(label: str, done: int, _total: int, base: int = done_before) -> None:
                progress.update(task, completed=base + done, description=label)

            rows.append(run_spec(scenario, spec, requests, args.seed, hook, fleet, units, cost))
            done_before += len(requests)
            progress.update(task, completed=done_before)

    cached_specs = [s for s in specs if s.variant != "no_cache"] or specs
    bounds_variant = cached_specs[0].variant
    # One reference per fleet size: a pooled cache of 6 replicas' memory says nothing about 3.
    every_bounds = fleet_bounds(traffic[bounds_variant], [
        (n, _adjust(scenario.fleet(n, bounds_variant), args).replica.pool_tokens)
        for n in sorted({s.replicas for s in cached_specs})
    ], units)
    bounds = every_bounds[-1]
    changed = _changed_flags(args)
    _print_table(console, scenario, rows, every_bounds, changed)

    if args.json is not None:
        payload = {
            "scenario": scenario.name,
            "seed": args.seed,
            "parameters": parameters,
            "runs": [_run_json(row) for row in rows],
            "bounds": bounds.as_dict(),
            "bounds_by_replicas": [b.as_dict() for b in every_bounds],
        }
        text = json.dumps(payload, indent=2, default=str) + "\n"
        if to_stdout:
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            write_whole(args.json, text, "--json")
            console.print(f"wrote {args.json}")
    if args.report is not None:
        from kvreuse.cli.simreport import LabLinks, write_report

        sweep = _sweep(scenario, rows, traffic, args, units, cost)
        knob = _knob_sweep("relative_spill", "slack", SLACKS,
                          scenario, rows, traffic, args, units, cost)
        links = LabLinks(
            base_url=args.lab_url,
            scale=args.scale,
            cache_tokens=args.cache_tokens,
            scheduling=args.scheduling,
            # the lab's replicas are radix trees with no information delays
            showable=args.cache_kind in (None, "radix") and args.block_size is None
            and args.load_lag is None and args.kv_lag is None and args.load_view is None
            and args.first_byte_lag is None and args.last_byte_lag is None
            and args.prefill_speeds is None and args.speed_change is None,
        )
        write_report(
            args.report, scenario, rows, every_bounds, sweep, parameters, seed=args.seed,
            links=links, changed=changed, knob=knob,
            plotted=[row for row in rows if row.spec in asked],
        )
        console.print(f"report: {args.report}")
    return 0


def _sweep(
    scenario: Scenario,
    rows: Sequence[ScenarioRun],
    traffic: dict[str, list[SimRequest]],
    args: argparse.Namespace,
    units: TraceUnits | None,
    cost: CostModel | None,
) -> list[ScenarioRun]:
    """Runs for the spill-threshold plot: the scenario's own sweep, else one on its traffic."""
    if scenario.sweep_option is not None:
        return [r for r in rows if any(k == scenario.sweep_option for k, _ in r.spec.options)]
    return _knob_sweep("cache_aware", "spill_threshold_s", SPILLS,
                       scenario, rows, traffic, args, units, cost)


def _knob_sweep(
    policy: str,
    option: str,
    values: Sequence[float],
    scenario: Scenario,
    rows: Sequence[ScenarioRun],
    traffic: dict[str, list[SimRequest]],
    args: argparse.Namespace,
    units: TraceUnits | None,
    cost: CostModel | None,
) -> list[ScenarioRun]:
    """``policy`` over ``values`` of its ``option`` on the first cached variant's traffic, at the
    smallest fleet of the run: the curve that one trade-off moves along."""
    variant = next((r.spec.variant for r in rows if r.spec.variant != "no_cache"), None)
    if variant is None:
        return []
    replicas = min(r.spec.replicas for r in rows)
    fleet = _adjust(scenario.fleet(replicas, variant), args)
    return [
        run_spec(scenario, RunSpec(policy, replicas, variant, ((option, value),)),
                 traffic[variant], args.seed, None, fleet, units, cost)
        for value in values
    ]


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


CHANGE_REASONS: dict[str, str] = {
    "scale": "--scale {value} measures {percent} of the scenario's window (the ranges are for "
    "the whole window)",
    "cache_tokens": "--cache-tokens {value} replaces the scenario's KV pool",
    "cache_kind": "--cache-kind {value} replaces the replicas' radix trees (the ranges assume "
    "radix trees)",
    "block_size": "--block-size {value} changes the cache's granularity",
    "scheduling": "--scheduling {value} changes the replicas' queue order",
    "load_lag": "--load-lag {value} delays the router's view of load",
    "kv_lag": "--kv-lag {value} delays the router's KV events",
    "load_view": "--load-view {value} changes what the router knows of the queues",
    "first_byte_lag": "--first-byte-lag {value} delays when the router hears of first tokens",
    "last_byte_lag": "--last-byte-lag {value} delays when the router hears of finished requests",
    "prefill_speeds": "--prefill-speeds {value} makes replicas prefill at other speeds",
    "speed_view": "--speed-view {value} changes what the router knows of the replicas' speeds",
    "speed_change": "--speed-change {value} changes replicas' speeds mid-run",
    "seed": "--seed {value} draws other traffic (the ranges were checked with seed 0)",
}
"""Why a figure may leave the range the scenario states: the flags that change the setup."""


def _changed_flags(args: argparse.Namespace) -> list[str]:
    """One reason per flag that moves the run away from the scenario as stated."""
    reasons = []
    if args.scale != 1.0:
        reasons.append(
            CHANGE_REASONS["scale"].format(value=f"{args.scale:g}", percent=f"{args.scale:.0%}")
        )
    for name in ("cache_tokens", "cache_kind", "block_size", "scheduling", "load_lag", "kv_lag",
                 "load_view", "first_byte_lag", "last_byte_lag", "prefill_speeds", "speed_view",
                 "speed_change"):
        value = getattr(args, name)
        if isinstance(value, tuple):
            value = ",".join(f"{v:g}" for v in value)
        elif isinstance(value, list):  # --speed-change, repeated
            value = " ".join(f"{at:g}:r{index}:{speed:g}" for at, index, speed in value)
        if value is not None:
            reasons.append(CHANGE_REASONS[name].format(value=value))
    if args.seed != defaults.SEED:
        reasons.append(CHANGE_REASONS["seed"].format(value=args.seed))
    return reasons


def verdict_reason(verdict: Verdict, changed: Sequence[str]) -> str:
    """Why ``verdict`` is out of its range: how far, and which flags changed the setup (or that
    none did, so the model and the stated figure disagree)."""
    exp = verdict.expectation
    if verdict.value < exp.low:
        where = f"{_figure(exp.low - verdict.value)} below the range"
    else:
        where = f"{_figure(verdict.value - exp.high)} above the range"
    if changed:
        return f"{where}, because {'; '.join(changed)}"
    return f"{where} with the scenario as stated: the simulation and the stated figure disagree"


def run_label(row: ScenarioRun) -> str:
    """A run's full label and fleet size, as every table and plot names it."""
    return f"{row.spec.label} x{row.spec.replicas}"


SUMMARY_HEADERS = (
    "run", "token\nhit", "request\nhit", "prefill\nGPU-s/1k", "TTFT\np50 s", "TTFT\np95 s",
    "max/mean\nload", "evicted\ntokens", "requests",
)


def summary_cells(row: ScenarioRun) -> list[str]:
    s = row.summary
    return [
        run_label(row), f"{s.token_hit_rate:.1%}", f"{s.request_hit_rate:.1%}",
        f"{s.prefill_gpu_s_per_1k:.1f}", f"{s.ttft_p50_s:.3f}", f"{s.ttft_p95_s:.3f}",
        f"{s.max_over_mean_load:.2f}", f"{s.evicted_tokens:,}", f"{s.requests:,}",
    ]


def bounds_text(every_bounds: Sequence[Bounds]) -> list[str]:
    """The reference hit rates per fleet size, with what each does and does not promise."""
    first = every_bounds[0]
    lines = [
        f"infinite cache {first.infinite_hit_rate:.1%}: a ceiling, no routing reuses more than "
        "a cache that never forgets. Pooled LRU: one LRU cache holding all replicas' memory, a "
        "reference, not a ceiling (LRU is not the best eviction, and a router that keeps each "
        "prefix on one replica can beat it):"
    ]
    for bounds in every_bounds:
        lines.append(
            f"  x{bounds.replicas}: pooled LRU of {bounds.replicas} x {bounds.cache_tokens:,} "
            f"tokens {bounds.pooled_lru_hit_rate:.1%}"
        )
    return lines


def _print_table(
    console: Console,
    scenario: Scenario,
    rows: Sequence[ScenarioRun],
    every_bounds: Sequence[Bounds],
    changed: Sequence[str],
) -> None:
    print_table(
        console, f"{scenario.name}: {scenario.summary}", SUMMARY_HEADERS,
        [summary_cells(row) for row in rows],
    )
    for line in bounds_text(every_bounds):
        console.print(line, highlight=False)
    for verdict in check(scenario, rows):
        exp = verdict.expectation
        mark = "[green]in range[/green]" if verdict.ok else "[red]OUT OF RANGE[/red]"
        reason = "" if verdict.ok else f"; {verdict_reason(verdict, changed)}"
        console.print(
            f"{mark} {exp.policy} x{exp.replicas}{' ' + exp.variant if exp.variant else ''} "
            f"{exp.metric} = {_figure(verdict.value)} (range {exp.low:g}-{exp.high:g}; "
            f"{exp.source}){reason}",
            highlight=False,
        )
