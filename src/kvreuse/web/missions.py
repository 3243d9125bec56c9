"""The four missions of seed 001's lab as guided presets with checkable goals.

A mission is a starting configuration (``preset``: control values the page loads) and a goal: a
list of :class:`Condition` on the run's tiles and on the controls. The server checks the goal
after every run that names the mission and returns which conditions hold; the page keeps a star
per met mission in the browser's localStorage.

Conditions on controls stop a goal from being met by changing the problem instead of solving it
(serving mission three's load at a lower arrival rate, say). The thresholds were placed, with the
simulator's default seeds, between what the preset gives and what a good answer gives; the
tests in ``tests/web/test_missions.py`` run both sides so a simulator change that moves them shows.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kvreuse.errors import ConfigError
from kvreuse.web.controls import LabControls

COMPARATORS: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
}


@dataclass(frozen=True, slots=True)
class Condition:
    """``subject op value``: ``subject`` is a tile name or a numeric/boolean control name."""

    subject: str
    op: str
    value: float
    label: str

    def __post_init__(self) -> None:
        if self.op not in COMPARATORS:
            raise ConfigError(f"op must be one of {', '.join(COMPARATORS)}, got {self.op!r}")


@dataclass(frozen=True, slots=True)
class Mission:
    """A guided preset. ``preset`` holds control values as the page sends them."""

    mission_id: str
    title: str
    story: str
    goal: str
    preset: Mapping[str, Any]
    conditions: tuple[Condition, ...]
    hint: str


@dataclass(frozen=True, slots=True)
class ConditionResult:
    """One condition of a goal, checked: ``actual`` is the run's value of ``subject``."""

    subject: str
    label: str
    met: bool
    actual: float

    @property
    def display(self) -> str:
        """``actual`` as the page shows it (a rate in %, a time in s, a count)."""
        if self.subject == "scenario":
            return "yes" if self.met else "no"
        if self.subject.endswith("_rate") and self.subject != "arrival_rate":
            return f"{100 * self.actual:.1f} %"
        if self.subject.endswith("_s"):
            return f"{self.actual:.3f} s"
        if self.actual < 0:
            return "none"
        if self.actual.is_integer():
            return f"{int(self.actual)}"
        return f"{self.actual:.2f}"


@dataclass(frozen=True, slots=True)
class GoalResult:
    """Whether every condition of ``mission_id`` holds for one run."""

    mission_id: str
    met: bool
    conditions: tuple[ConditionResult, ...]


def check_goal(mission: Mission, controls: LabControls, tiles: Mapping[str, float]) -> GoalResult:
    """Evaluate ``mission``'s conditions against a run. Tiles shadow controls of the same name
    (``replicas`` is both and equal); an unset optional control reads as -1. The run must also
    use the mission's traffic (its ``scenario``), or nothing else it shows would count.
    O(conditions)."""
    values: dict[str, float] = {}
    for key, value in controls.as_dict().items():
        if value is None:
            values[key] = -1.0  # "absent" (no timestamp): below every real position
        elif isinstance(value, int | float):  # bool included: True == 1.0
            values[key] = float(value)
    values.update({k: float(v) for k, v in tiles.items()})
    results = []
    for cond in mission.conditions:
        assert cond.subject in values, f"mission {mission.mission_id} checks unknown {cond.subject}"
        actual = values[cond.subject]
        results.append(
            ConditionResult(
                cond.subject, cond.label, COMPARATORS[cond.op](actual, cond.value), actual
            )
        )
    scenario = mission.preset.get("scenario")
    if scenario is not None:
        same = controls.scenario == scenario
        results.append(
            ConditionResult("scenario", f"on the mission's traffic ({scenario})", same, float(same))
        )
    return GoalResult(mission.mission_id, all(r.met for r in results), tuple(results))


def mission_to_json(mission: Mission) -> dict[str, Any]:
    """What ``GET /api/missions`` returns per mission."""
    return {
        "id": mission.mission_id,
        "title": mission.title,
        "story": mission.story,
        "goal": mission.goal,
        "hint": mission.hint,
        "preset": dict(mission.preset),
        "conditions": [asdict(c) for c in mission.conditions],  # subject, op, value, label
    }


def goal_to_json(result: GoalResult) -> dict[str, Any]:
    return {
        "mission": result.mission_id,
        "met": result.met,
        # subject, label, met, actual, then how the page shows actual
        "conditions": [{**asdict(c), "display": c.display} for c in result.conditions],
    }


BELGAVI_RATE = 30.0
"""Seed 001: 'a support chat at 30 requests per second'. Goals require at least this load."""

_SAME_LOAD = Condition("arrival_rate", ">=", BELGAVI_RATE, "the same load: at least 30 req/s")

MISSIONS: dict[str, Mission] = {
    m.mission_id: m
    for m in (
        Mission(
            mission_id="mission-1",
            title="1 · Keep the KV you already paid for",
            story="Belgavi's support chat runs on six replicas behind a round-robin proxy with "
            "prefix caching off: every request prefills its 1,500-token system prompt and the "
            "whole conversation again.",
            goal="Serve the same traffic on the same six replicas with prefill under 140 "
            "GPU-seconds per 1,000 requests.",
            preset={
                "scenario": "mission-1",
                "cache_enabled": False,
                "replicas": 6,
                "routing": "round_robin",
                "arrival_rate": BELGAVI_RATE,
            },
            conditions=(
                Condition("prefill_gpu_s_per_1k", "<", 140.0, "prefill under 140 GPU-s per 1k"),
                Condition("replicas", "==", 6, "six replicas"),
                _SAME_LOAD,
            ),
            hint="What does the cache checkbox do? Watch the green part of the bars.",
        ),
        Mission(
            mission_id="mission-2",
            title="2 · The timestamp",
            story="A release put the current time, to the second, into the system prompt: 200 "
            "tokens in, with 1,300 after it. Nothing errors; the hit rate just fell from the "
            "mid-70s to the low 40s.",
            goal="Keep the timestamp in the system prompt (the product needs it) and bring the "
            "token hit rate back above 65 %.",
            preset={
                "scenario": "mission-2",
                "replicas": 6,
                "routing": "exact",
                "timestamp_at": 200,
                "arrival_rate": BELGAVI_RATE,
            },
            conditions=(
                Condition("timestamp_at", ">=", 0, "the timestamp stays in the system prompt"),
                Condition("token_hit_rate", ">", 0.65, "token hit rate above 65 %"),
                _SAME_LOAD,
            ),
            hint="A prefix cache matches from the first token: what comes after a value that "
            "changes every second can never be reused.",
        ),
        Mission(
            mission_id="mission-3",
            title="3 · Half the fleet",
            story="Round robin on six replicas scatters every conversation: the next turn lands "
            "on the replica holding its history one time in six.",
            goal="Serve the same load on 3 replicas with p95 TTFT under 0.4 s.",
            preset={
                "scenario": "mission-3",
                "replicas": 6,
                "routing": "round_robin",
                "arrival_rate": BELGAVI_RATE,
            },
            conditions=(
                Condition("replicas", "<=", 3, "at most 3 replicas"),
                Condition("ttft_p95_s", "<", 0.4, "p95 TTFT under 0.4 s"),
                _SAME_LOAD,
            ),
            hint="Fewer replicas with round robin cannot keep up. Route on prefixes.",
        ),
        Mission(
            mission_id="mission-4",
            title="4 · Surge and burst",
            story="Two tenants share four replicas; acme surges by half for twenty seconds and "
            "then everyone bursts. Pure affinity piles acme onto its replicas; pure load "
            "balancing scatters every prefix.",
            goal="Find a spill threshold that keeps p95 TTFT under 0.3 s and the token hit "
            "rate above 69 % on 4 replicas.",
            preset={
                "scenario": "mission-4",
                "replicas": 4,
                "routing": "exact",
                "spill_threshold_s": 0.0,
                "arrival_rate": BELGAVI_RATE,
            },
            conditions=(
                Condition("replicas", "<=", 4, "at most 4 replicas"),
                Condition("ttft_p95_s", "<", 0.3, "p95 TTFT under 0.3 s"),
                Condition("token_hit_rate", ">", 0.69, "token hit rate above 69 %"),
                _SAME_LOAD,
            ),
            hint="Zero spills everything to the least loaded replica; a huge threshold never "
            "spills. The answer is in between.",
        ),
    )
}
"""The four missions of seed 001's lab, in order."""
