"""What a named scenario is made of: sourced parameters, the runs it compares, stated results.

The tables (:mod:`kvreuse.sim.scenario_params`) fill these types with the seeds' numbers; the
builders (:mod:`kvreuse.sim.scenarios`) turn them into traffic and fleets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvreuse.sim.config import FleetConfig
from kvreuse.sim.requests import SimRequest

GIB = 1 << 30
BYTES_PER_TOKEN = 128 * 1024
"""Seed 000/001: an 8B GQA model in 16-bit precision keeps 128 KiB of KV per token."""


def gib_to_tokens(gib: float, bytes_per_token: int = BYTES_PER_TOKEN) -> int:
    return int(gib * GIB) // bytes_per_token


@dataclass(frozen=True, slots=True)
class Param:
    """A scenario parameter and where its value comes from."""

    name: str
    value: Any
    source: str


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One comparison row: a policy on a fleet size, under a variant, with policy options."""

    policy: str
    replicas: int
    variant: str = ""
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        extra = ",".join(f"{k}={fmt_value(v)}" for k, v in self.options)
        name = f"{self.policy}[{extra}]" if extra else self.policy
        return f"{name} ({self.variant})" if self.variant else name


def fmt_value(value: Any) -> str:
    """A parameter value as text (``inf`` for an infinite float)."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return str(value)


@dataclass(frozen=True, slots=True)
class Expectation:
    """A stated result: ``metric`` of the run matching ``policy``/``replicas``/``variant``/
    ``options`` lies in ``[low, high]``."""

    policy: str
    replicas: int
    metric: str
    low: float
    high: float
    source: str
    variant: str = ""
    options: tuple[tuple[str, Any], ...] = ()

    def matches(self, spec: RunSpec) -> bool:
        return (spec.policy, spec.replicas, spec.variant, spec.options) == (
            self.policy,
            self.replicas,
            self.variant,
            self.options,
        )


RequestsFactory = Callable[[int, str, float], list[SimRequest]]
"""``requests(seed, variant, scale)``: the traffic, sorted by arrival."""

FleetFactory = Callable[[int, str], FleetConfig]
"""``fleet(replicas, variant)``: the replicas' configuration."""


@dataclass(frozen=True, slots=True)
class Scenario:
    """A named comparison. ``requests(seed, variant, scale)`` builds the traffic (``scale``
    shortens the measured window for quick runs); ``fleet(replicas, variant)`` the replicas."""

    name: str
    summary: str
    params: tuple[Param, ...]
    runs: tuple[RunSpec, ...]
    requests: RequestsFactory
    fleet: FleetFactory
    expectations: tuple[Expectation, ...] = ()
    policy_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    sweep_option: str | None = None

    def parameters(self) -> dict[str, Any]:
        return {
            p.name: fmt_value(p.value)
            if isinstance(p.value, float) and math.isinf(p.value)
            else p.value
            for p in self.params
        }

    def select(
        self, policies: Sequence[str] | None = None, replicas: Sequence[int] | None = None
    ) -> list[RunSpec]:
        """The scenario's runs, or the cross product of ``policies`` × ``replicas`` × the
        scenario's variants when either is given."""
        if not policies and not replicas:
            return list(self.runs)
        variants = list(dict.fromkeys(spec.variant for spec in self.runs))
        chosen_policies = list(policies) if policies else list(
            dict.fromkeys(spec.policy for spec in self.runs)
        )
        chosen_replicas = list(replicas) if replicas else list(
            dict.fromkeys(spec.replicas for spec in self.runs)
        )
        return [
            RunSpec(policy, n, variant)
            for variant in variants
            for policy in chosen_policies
            for n in chosen_replicas
        ]
