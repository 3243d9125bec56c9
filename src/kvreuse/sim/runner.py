"""Running a scenario's comparison: same traffic per variant, a fresh seeded policy per run."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvreuse.bulk import collector_paused
from kvreuse.errors import ConfigError, PoolTooSmallError
from kvreuse.routing import build_policy
from kvreuse.routing.base import CostModel
from kvreuse.sim.config import FleetConfig
from kvreuse.sim.fleet import FleetSimulator
from kvreuse.sim.requests import FleetRun, SimRequest
from kvreuse.sim.scenarios import Expectation, RunSpec, Scenario
from kvreuse.sim.summary import RunSummary, summarize
from kvreuse.sim.units import TraceUnits

ProgressHook = Callable[[str, int, int], None]
"""``progress(label, finished_requests, total_requests)``."""


@dataclass(frozen=True, slots=True)
class ScenarioRun:
    """One row of a comparison."""

    spec: RunSpec
    run: FleetRun
    summary: RunSummary


@dataclass(frozen=True, slots=True)
class Verdict:
    """An expectation checked against a run."""

    expectation: Expectation
    value: float
    ok: bool


def metric_value(summary: RunSummary, metric: str) -> float:
    """A summary field by name, plus ``prefilled_tokens``."""
    if metric == "prefilled_tokens":
        return float(summary.prompt_tokens - summary.cached_tokens)
    value = getattr(summary, metric, None)
    if not isinstance(value, int | float):
        raise ConfigError(f"unknown metric {metric!r}")
    return float(value)


def simulate(
    policy_name: str,
    options: dict[str, Any],
    config: FleetConfig,
    requests: Sequence[SimRequest],
    seed: int = 0,
    *,
    units: TraceUnits | None = None,
    cost: CostModel | None = None,
    progress: Callable[[int], None] | None = None,
) -> FleetRun:
    """One run of a fresh policy seeded with ``seed``. With ``units`` (block-granular traces)
    the requests are counted in those units while ``config``, ``cost`` and ``options`` stay in
    tokens, and so does the returned run."""
    if units is not None:
        options = units.policy_options(policy_name, options)
        cost = units.cost(cost or CostModel())
    policy = build_policy(policy_name, rng=random.Random(seed), cost=cost, **options)
    simulated = config if units is None else units.fleet(config)
    every = max(len(requests) // 50, 1)
    with _pool_errors_in_tokens(units):  # run() checks that every request fits, first
        run = FleetSimulator(simulated, policy).run(requests, progress, every)
    if units is None:
        return run
    with collector_paused():  # a million records, no cycles (kvreuse.bulk)
        return units.tokens_run(run, config)


def check_fits(config: FleetConfig, requests: Sequence[SimRequest],
               units: TraceUnits | None = None) -> None:
    """Raise :class:`PoolTooSmallError` (its figures in tokens) when the largest of ``requests``
    cannot fit one replica's pool of ``config`` (in tokens) even alone: what :func:`simulate`
    would refuse, asked before simulating (``kvreuse plan`` leaves such cache sizes out).
    O(requests)."""
    simulated = config if units is None else units.fleet(config)
    with _pool_errors_in_tokens(units):
        FleetSimulator(simulated, build_policy("round_robin")).check_fits(requests)


@contextlib.contextmanager
def _pool_errors_in_tokens(units: TraceUnits | None) -> Iterator[None]:
    """A :class:`PoolTooSmallError` raised inside, its figures counted in tokens of ``units``."""
    try:
        yield
    except PoolTooSmallError as exc:
        if units is None or units.tokens_per_unit == 1:
            raise
        raise exc.in_units_of(units.tokens_per_unit) from None


def run_spec(
    scenario: Scenario,
    spec: RunSpec,
    requests: Sequence[SimRequest],
    seed: int,
    progress: ProgressHook | None = None,
    fleet: FleetConfig | None = None,
    units: TraceUnits | None = None,
    cost: CostModel | None = None,
) -> ScenarioRun:
    """Simulate one :class:`RunSpec` on ``requests`` (see :func:`simulate` for ``units``)."""
    options: dict[str, Any] = dict(scenario.policy_options.get(spec.policy, {}))
    options.update(dict(spec.options))
    config = fleet or scenario.fleet(spec.replicas, spec.variant)
    if config.replicas != spec.replicas:
        config = replace(config, replicas=spec.replicas)
    hook = None
    if progress is not None:
        total = len(requests)

        def hook(done: int) -> None:
            progress(spec.label, done, total)

    run = simulate(
        spec.policy, options, config, requests, seed, units=units, cost=cost, progress=hook
    )
    return ScenarioRun(spec, run, summarize(run, spec.label))


def run_scenario(
    scenario: Scenario,
    seed: int = 0,
    specs: Sequence[RunSpec] | None = None,
    scale: float = 1.0,
    progress: ProgressHook | None = None,
) -> list[ScenarioRun]:
    """Run ``specs`` (default: the scenario's own). Traffic is generated once per variant."""
    chosen = list(specs) if specs is not None else list(scenario.runs)
    traffic: dict[str, list[SimRequest]] = {}
    out = []
    for spec in chosen:
        if spec.variant not in traffic:
            traffic[spec.variant] = scenario.requests(seed, spec.variant, scale)
        out.append(run_spec(scenario, spec, traffic[spec.variant], seed, progress))
    return out


def check(scenario: Scenario, runs: Sequence[ScenarioRun]) -> list[Verdict]:
    """Each expectation whose run is present, with its measured value."""
    verdicts = []
    for expectation in scenario.expectations:
        for row in runs:
            if expectation.matches(row.spec):
                value = metric_value(row.summary, expectation.metric)
                ok = expectation.low <= value <= expectation.high
                verdicts.append(Verdict(expectation, value, ok))
    return verdicts
