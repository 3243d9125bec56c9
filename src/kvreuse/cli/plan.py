"""``kvreuse plan``: the cheapest fleet that meets an SLO on a trace.

    kvreuse plan --trace FILE --slo ttft_p95=0.5 [--slo mean_queue=0.1]
                 [--replicas 2,4,6,8] [--policy round_robin,cache_aware,...]
                 [--cache-tokens 100000,200000] [--knob 0.1,0.2]
                 [--workers N | --serial | --ray [ADDRESS]] [--cache-dir DIR | --no-cache]
                 [--json FILE] [--report FILE.html]

Searches replicas × policy × cache size × the policy's knob (:mod:`kvreuse.sim.plan`), prints
the winner (fewest replicas, then least prefill GPU time, meeting every SLO), the Pareto front
and the command that reproduces the winning cell. Cells run on a local process pool by default
(``--workers``, default: the CPUs), one after another with ``--serial``, or on Ray with ``--ray``
(a local instance without an address; ``pip install 'kvreuse[ray]'``); each cell is a pure
function of its inputs, so all three give identical results. Finished cells are cached (one JSON
file per cell under ``--cache-dir``, keyed by the trace's bytes and every setting), so an
interrupted plan resumes where it stopped. A worker that dies costs its cell a rerun, not
the plan (:mod:`kvreuse.cli.plan_workers`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from kvreuse import __version__
from kvreuse.cli.args import (
    non_negative_float,
    output_file,
    positive_float,
    positive_int,
    speed_list,
    trace_file,
)
from kvreuse.cli.files import CannotWrite, write_whole, written_beside
from kvreuse.cli.plan_workers import PoolWorkers, RayWorkers, Traffic, WorkerInit, run_cells
from kvreuse.cli.tables import make_console, print_table, progress_bar
from kvreuse.errors import ConfigError, InputFormatError, WorkerDiedError
from kvreuse.json_input import parse_json
from kvreuse.routing import POLICIES
from kvreuse.sim.config import ReplicaConfig, speeds_for
from kvreuse.sim.plan import (
    DEFAULT_POLICIES,
    KNOBS,
    SLO_METRICS,
    Cell,
    CellResult,
    Slo,
    caches_too_small,
    choose,
    grid,
    pareto_front,
    parse_slo,
    run_cell,
)
from kvreuse.sim.units import TraceUnits
from kvreuse.trace import DEFAULT_BLOCK_TOKENS, GRANULARITIES

DEFAULT_REPLICAS = "2,4,6,8"
DEFAULT_CACHE_TOKENS = "100000,200000,400000"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="search replicas x policy x cache size for the cheapest fleet meeting an SLO",
        description=__doc__.split("\n\n")[2] if __doc__ else None,
    )
    parser.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    parser.add_argument(
        "--slo", action="append", required=True, metavar="METRIC=SECONDS",
        help=f"a limit to meet (repeatable); METRIC: {', '.join(SLO_METRICS)}",
    )
    parser.add_argument("--replicas", default=DEFAULT_REPLICAS,
                        help=f"fleet sizes to try ({DEFAULT_REPLICAS})")
    parser.add_argument("--policy", default=",".join(DEFAULT_POLICIES),
                        help=f"policies to try ({','.join(DEFAULT_POLICIES)})")
    parser.add_argument("--cache-tokens", default=DEFAULT_CACHE_TOKENS,
                        help=f"KV pool sizes per replica to try, tokens ({DEFAULT_CACHE_TOKENS})")
    parser.add_argument(
        "--knob",
        help="values of the policy's knob to try, replacing its defaults (knobs: "
        + "; ".join(f"{p}: {k} {','.join(str(v) for v in vs)}" for p, (k, vs) in KNOBS.items())
        + ")",
    )
    parser.add_argument("--trace-block-size", type=positive_int, default=DEFAULT_BLOCK_TOKENS,
                        help=f"tokens per trace hash id ({DEFAULT_BLOCK_TOKENS})")
    parser.add_argument("--trace-granularity", choices=GRANULARITIES, default="block",
                        help="simulate one id per unit (block) or every token (token)")
    parser.add_argument("--prefill-rate", type=positive_float, default=10_000.0,
                        help="prefill tokens per second per replica (10000)")
    parser.add_argument("--overhead", type=non_negative_float, default=0.015,
                        help="prefill overhead per request, seconds (0.015)")
    parser.add_argument("--tpot", type=non_negative_float, default=0.02,
                        help="decode seconds per output token (0.02)")
    parser.add_argument(
        "--prefill-speeds", type=speed_list, default=(), metavar="S1,S2,...",
        help="replicas you already have of other speeds: every fleet's first replicas prefill "
        "at these multiples of --prefill-rate (the rest at 1), and the router measures them "
        "as kvreuse route does",
    )
    parser.add_argument("--seed", type=int, default=0, help="policy seed (0)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--serial", action="store_true", help="run cells one after another")
    where.add_argument(
        "--ray", nargs="?", const="", metavar="ADDRESS",
        help="run cells on Ray: a cluster's address, or a local instance without one",
    )
    parser.add_argument("--workers", type=positive_int,
                        help="parallel workers (default, and at most here: the CPUs this machine "
                             "gives the plan; on a Ray cluster, any number)")
    parser.add_argument("--cache-dir", type=Path,
                        help="where finished cells are kept (default ~/.cache/kvreuse/plan)")
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write cells")
    parser.add_argument("--json", type=output_file,
                        help="write the cells, front and winner as JSON")
    parser.add_argument("--report", type=output_file, help="write an HTML report with plots here")
    parser.set_defaults(func=run)


def _split(text: str, flag: str, kind: Callable[[str], Any]) -> list[Any]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            out.append(kind(part))
        except (ValueError, argparse.ArgumentTypeError):
            raise ConfigError(f"{flag}: {part!r} is not a valid value") from None
    if not out:
        raise ConfigError(f"{flag} needs at least one value")
    return out


# ---------------------------------------------------------------- the cell cache


class CellCache:
    """One JSON file per finished cell, named by a digest of the trace and every setting.

    A cache that cannot be written (a full disk, a read-only home) does not stop the plan: the
    first failed write is reported once, later cells are not written, and the plan goes on to
    its answer (the cells are the work; the cache only saves redoing them)."""

    def __init__(self, directory: Path | None, fingerprint: str) -> None:
        self.directory = directory
        self.fingerprint = fingerprint
        self.stored = 0
        self.write_error: str | None = None

    def _path(self, cell: Cell) -> Path | None:
        if self.directory is None:
            return None
        digest = hashlib.sha256(f"{self.fingerprint}|{cell.key()}".encode()).hexdigest()[:32]
        return self.directory / f"{digest}.json"

    def load(self, cell: Cell) -> CellResult | None:
        path = self._path(cell)
        if path is None or not path.is_file():
            return None
        try:
            result = CellResult.from_dict(parse_json(path.read_bytes(), allow_non_finite=True))
        except (OSError, InputFormatError, ValueError, KeyError, TypeError):
            return None  # a torn or foreign file: the cell is simply run again
        return result if result.cell == cell else None

    def store(self, result: CellResult) -> str | None:
        """Keep ``result``; the first write that fails returns what went wrong (to be shown
        once), and every store after it does nothing."""
        path = self._path(result.cell)
        if path is None or self.write_error is not None:
            return None
        try:
            with written_beside(path, make_parents=True) as sink:  # never half a cell, if killed
                sink.write(json.dumps(result.as_dict()))
        except CannotWrite as exc:
            self.write_error = f"{exc.reason} ({path.parent})"
            return (f"cannot write the plan cache: {self.write_error}; the plan goes on, "
                    f"keeping no more cells ({self.stored} kept)")
        self.stored += 1
        return None

    def kept(self) -> str:
        """Where the finished cells are, for a plan that stopped before its answer."""
        if self.directory is None:
            return "--no-cache: they are not kept"
        if self.write_error is not None:
            return (f"{self.stored} of them are in {self.directory} (writing more failed: "
                    f"{self.write_error})")
        return f"they are in {self.directory}: the same command resumes there"


# ---------------------------------------------------------------- executors


def _serial(cells: Sequence[Cell], traffic: Traffic, replica: ReplicaConfig,
            seed: int) -> Iterator[CellResult]:
    for cell in cells:
        yield run_cell(cell, traffic.requests, traffic.units, replica, seed)


# ---------------------------------------------------------------- the command


def _command(args: argparse.Namespace, cell: Cell, slos: Sequence[Slo]) -> str:
    parts = ["kvreuse", "plan", "--trace", str(args.trace)]
    for slo in slos:
        parts += ["--slo", str(slo)]
    parts += ["--policy", cell.policy, "--replicas", str(cell.replicas),
              "--cache-tokens", str(cell.cache_tokens)]
    if cell.knob is not None:
        parts += ["--knob", f"{cell.knob:g}"]
    parts += _speeds_flag(cell)
    for flag, value, default in (
        ("--trace-block-size", args.trace_block_size, DEFAULT_BLOCK_TOKENS),
        ("--trace-granularity", args.trace_granularity, "block"),
        ("--prefill-rate", args.prefill_rate, 10_000.0),
        ("--overhead", args.overhead, 0.015),
        ("--tpot", args.tpot, 0.02),
        ("--seed", args.seed, 0),
    ):
        if value != default:
            parts += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return shlex.join([*parts, "--serial"])


def _simulate_command(args: argparse.Namespace, cell: Cell) -> str:
    """The same cell as one row of ``kvreuse simulate`` (same constants, seed, granularity)."""
    policy = cell.policy if cell.knob is None else f"{cell.policy}[{cell.knob_name}={cell.knob:g}]"
    parts = ["kvreuse", "simulate", "--trace", str(args.trace), "--policy", policy,
             "--replicas", str(cell.replicas), "--cache-tokens", str(cell.cache_tokens),
             "--trace-block-size", str(args.trace_block_size),
             "--trace-granularity", args.trace_granularity,
             "--prefill-rate", f"{args.prefill_rate:g}", "--overhead", f"{args.overhead:g}",
             "--tpot", f"{args.tpot:g}", "--seed", str(args.seed), "--no-baseline",
             *_speeds_flag(cell)]
    return shlex.join(parts)


def _speeds_flag(cell: Cell) -> list[str]:
    """``--prefill-speeds`` as the cell was planned with (none for alike replicas)."""
    if not cell.prefill_speeds:
        return []
    return ["--prefill-speeds", ",".join(f"{speed:g}" for speed in cell.prefill_speeds)]


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvreuse" / "plan"


def run(args: argparse.Namespace) -> int:
    console = make_console()
    slos = [parse_slo(text) for text in args.slo]
    policies = _split(args.policy, "--policy", str)
    for name in policies:
        if name not in POLICIES:
            raise ConfigError(f"unknown policy {name!r}; choose from: {', '.join(POLICIES)}")
    replicas = _split(args.replicas, "--replicas", positive_int)
    caches = _split(args.cache_tokens, "--cache-tokens", positive_int)
    knobs = _split(args.knob, "--knob", non_negative_float) if args.knob else None
    speeds: tuple[float, ...] = args.prefill_speeds
    grid(policies, replicas, caches, knobs, speeds)  # refuses a bad value before reading
    try:
        data = trace_file(args.trace, "--trace").read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read --trace {args.trace}: {exc.strerror}") from None
    replica = ReplicaConfig(prefill_tokens_per_s=args.prefill_rate, overhead_s=args.overhead,
                            time_per_output_token_s=args.tpot)
    source = str(args.trace)
    # Parsed here first, in this process: a bad trace is reported once, before any worker.
    traffic = Traffic(data, source, args.trace_block_size, args.trace_granularity)
    # A cache size that cannot hold the largest request is no fleet at all: it is left out
    # (and said so), rather than failing the search of the sizes that can.
    too_small = caches_too_small(caches, traffic.requests, traffic.units, replica)
    if len(too_small) == len(caches):
        raise ConfigError(f"no --cache-tokens value can hold the trace's largest request: "
                          f"{too_small[max(caches)]}")
    for size, refusal in too_small.items():
        console.print(f"[yellow]left out --cache-tokens {size:,}[/yellow]: {refusal}")
    cells = grid(policies, replicas, [c for c in caches if c not in too_small], knobs, speeds)
    settings = (hashlib.sha256(data).hexdigest(), args.trace_block_size, args.trace_granularity,
                replica, args.seed, __version__)
    cache = CellCache(None if args.no_cache else (args.cache_dir or _default_cache_dir()),
                      repr(settings))
    results: dict[Cell, CellResult] = {}
    todo = []
    for cell in cells:
        hit = cache.load(cell)
        if hit is None:
            todo.append(cell)
        else:
            results[cell] = hit
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = args.workers or cpus or 1
    on_this_machine = not args.ray  # the pool, or a local Ray instance (no address)
    if cpus and workers > cpus and on_this_machine and not args.serial:
        # A cell keeps one CPU busy and each process holds the whole trace: more processes
        # than CPUs here are no faster, only larger (1,000 would want about 40 GiB).
        console.print(f"[yellow]--workers {workers}[/yellow]: this machine gives the plan "
                      f"{cpus} CPUs, so {cpus} workers run (more would be no faster)",
                      highlight=False)
        workers = cpus
    workers = min(workers, len(todo) or 1)
    init: WorkerInit = (data, source, args.trace_block_size, args.trace_granularity, replica,
                        args.seed)
    stopped_after = len(results)
    try:
        with progress_bar(console) as progress:
            task = progress.add_task("cells", total=len(cells), completed=len(results))

            def warn(message: str) -> None:
                console.print(f"[yellow]{message}[/yellow]", markup=True, highlight=False)

            if args.serial or not todo:
                finished = _serial(todo, traffic, replica, args.seed)
            elif args.ray is not None:
                finished = run_cells(todo, RayWorkers(init, workers, args.ray), workers, warn)
            else:
                finished = run_cells(todo, PoolWorkers(init, workers), workers, warn)
            for result in finished:
                problem = cache.store(result)
                if problem is not None:
                    warn(problem)
                results[result.cell] = result
                stopped_after = len(results)
                progress.update(task, advance=1, description=f"cells ({result.cell.key()})")
    except (KeyboardInterrupt, WorkerDiedError) as stop:
        done = f"{stopped_after} of {len(cells)} cells finished; {cache.kept()}"
        if isinstance(stop, WorkerDiedError):
            raise WorkerDiedError(f"{stop}. {done}") from None
        console.print(f"[yellow]interrupted[/yellow]: {done}", highlight=False)
        return 130
    ordered = [results[cell] for cell in cells]
    winner = choose(ordered, slos)
    front = pareto_front(ordered, slos)
    _print(console, args, slos, ordered, front, winner, len(cells) - len(todo), traffic.units)
    command = _command(args, winner.cell, slos) if winner else None
    if args.json is not None:
        payload = {
            "trace": source,
            "slos": {s.metric: s.limit_s for s in slos},
            "requests": len(traffic.requests),
            "parameters": {
                "trace_block_size": args.trace_block_size,
                "trace_granularity": args.trace_granularity,
                "prefill_tokens_per_s": args.prefill_rate,
                "overhead_s": args.overhead,
                "time_per_output_token_s": args.tpot,
                "seed": args.seed,
            },
            "left_out_cache_tokens": {str(size): str(refusal)
                                      for size, refusal in too_small.items()},
            "cells": [r.as_dict() | {"meets_slo": r.meets(slos)} for r in ordered],
            "front": [r.as_dict() | {"meets_slo": r.meets(slos)} for r in front],
            "winner": None if winner is None else winner.as_dict(),
            "command": command,
            "simulate_command": _simulate_command(args, winner.cell) if winner else None,
        }
        write_whole(args.json, json.dumps(payload, indent=2) + "\n", "--json")
        console.print(f"wrote {args.json}")
    if args.report is not None:
        from kvreuse.cli.planreport import write_plan_report

        write_plan_report(args.report, source, slos, ordered, front, winner, command)
        console.print(f"report: {args.report}")
    return 0


PLAN_HEADERS = ("policy", "knob", "replicas", "cache\ntokens", "token\nhit", "prefill\nGPU-s",
                "TTFT\np50", "TTFT\np95", "TTFT\np99", "mean\nqueue", "SLO")
"""The Pareto table's columns (two-line headers keep it narrow)."""


def _print(console: Console, args: argparse.Namespace, slos: Sequence[Slo],
           results: Sequence[CellResult], front: Sequence[CellResult],
           winner: CellResult | None, cached: int, units: TraceUnits) -> None:
    rows = []
    for r in front:
        cell = r.cell
        knob = "" if cell.knob_name is None else f"{cell.knob_name}={cell.knob:g}"
        rows.append([
            cell.policy, knob, str(cell.replicas), f"{cell.cache_tokens:,}",
            f"{r.token_hit_rate:.1%}", f"{r.prefill_gpu_s:,.1f}", f"{r.ttft_p50_s:.3f}s",
            f"{r.ttft_p95_s:.3f}s", f"{r.ttft_p99_s:.3f}s", f"{r.mean_queue_s:.3f}s",
            "meets" if r.meets(slos) else "misses",
        ])
    # The shared printer: as wide as the terminal or COLUMNS, never a cut number.
    print_table(
        console,
        f"Pareto front over {len(results)} cells (replicas, prefill GPU-s, "
        f"{slos[0].metric}); {cached} from the cache",
        PLAN_HEADERS, rows, text_columns=(0, 1),
    )
    wanted = ", ".join(str(s) for s in slos)
    if winner is None:
        console.print(f"[red]no cell meets {wanted}[/red]: try more replicas (--replicas) or "
                      "bigger caches (--cache-tokens)")
        return
    cell = winner.cell
    knob = "" if cell.knob_name is None else f", {cell.knob_name}={cell.knob:g}"
    speeds = ""
    if cell.prefill_speeds:
        shown = speeds_for(cell.prefill_speeds, cell.replicas) or ()
        speeds = f" (prefill speeds {', '.join(f'{v:g}' for v in shown)})"
    console.print(
        f"[bold]winner[/bold] for {wanted}: {cell.policy}{knob} on {cell.replicas} replicas"
        f"{speeds} of {cell.cache_tokens:,} cache tokens: token hit "
        f"{winner.token_hit_rate:.1%}, TTFT p95 {winner.ttft_p95_s:.3f} s, p99 "
        f"{winner.ttft_p99_s:.3f} s, mean queue {winner.mean_queue_s:.3f} s, prefill "
        f"{winner.prefill_gpu_s:,.1f} GPU-s"
    )
    # markup=False: a policy's options are in brackets, which rich would take for styles.
    console.print(f"reproduce: {_command(args, cell, slos)}", soft_wrap=True, markup=False)
    console.print(f"or as a simulation: {_simulate_command(args, cell)}", soft_wrap=True,
                  markup=False)
    if units.tokens_per_unit > 1:
        console.print(f"(simulated at block granularity: one unit = {units.tokens_per_unit} "
                      "tokens; --trace-granularity token for exact lengths)")
