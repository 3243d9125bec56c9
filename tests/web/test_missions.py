"""The four missions: each preset misses its goal and a known answer meets it (real sim runs)."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from kvreuse.web.adapter import SimLab
from kvreuse.web.controls import LabControls, parse_controls
from kvreuse.web.missions import MISSIONS, Condition, Mission, check_goal

LAB = SimLab()
_run = cache(LAB.run)  # runs are deterministic per controls; several tests share some

ANSWERS: dict[str, dict[str, Any]] = {
    "mission-1": {"cache_enabled": True},
    "mission-2": {"timestamp_at": 1496},
    "mission-3": {"replicas": 3, "routing": "cache_aware"},
    "mission-4": {"spill_threshold_s": 0.1},
}
"""One way to solve each mission (the tests check the goal is reachable, not the only way)."""


def _controls(mission_id: str, changes: dict[str, Any]) -> LabControls:
    preset = parse_controls(dict(MISSIONS[mission_id].preset), LAB.choices())
    return parse_controls({**changes, "mission": mission_id}, LAB.choices(), preset)


def test_there_are_four_missions_with_valid_presets() -> None:
    """Seed 001's lab has four missions; every preset is a valid set of controls."""
    assert list(MISSIONS) == ["mission-1", "mission-2", "mission-3", "mission-4"]
    for mission in MISSIONS.values():
        controls = parse_controls(dict(mission.preset), LAB.choices())
        assert controls.scenario == mission.preset["scenario"]


@pytest.mark.parametrize("mission_id", list(MISSIONS))
def test_the_preset_does_not_meet_the_goal(mission_id: str) -> None:
    """A mission starts unsolved."""
    result = _run(_controls(mission_id, {}))
    assert result.goal is not None and result.goal.mission_id == mission_id
    assert not result.goal.met


@pytest.mark.parametrize("mission_id", list(MISSIONS))
def test_a_known_answer_meets_the_goal(mission_id: str) -> None:
    """The goal is reachable on the simulator as it is."""
    result = _run(_controls(mission_id, ANSWERS[mission_id]))
    assert result.goal is not None
    assert result.goal.met, result.goal.conditions


def test_mission_four_rejects_both_extremes() -> None:
    """Seed 001: the right spill threshold is neither zero nor infinite (60 s never spills)."""
    for spill in (0.0, 60.0):
        result = _run(_controls("mission-4", {"spill_threshold_s": spill}))
        assert result.goal is not None and not result.goal.met, spill


def test_lowering_the_load_does_not_count() -> None:
    """Mission three at half the arrival rate fails the same-load condition."""
    result = _run(_controls("mission-3", {**ANSWERS["mission-3"], "arrival_rate": 15.0}))
    assert result.goal is not None and not result.goal.met
    failed = [c.label for c in result.goal.conditions if not c.met]
    assert failed == ["the same load: at least 30 req/s"]


def test_another_scenario_does_not_count() -> None:
    """A goal is only met on the mission's own traffic."""
    mission = Mission(
        "m", "t", "s", "g", {"scenario": "mission-4"}, (Condition("replicas", ">=", 1, "any"),), "h"
    )
    tiles = {"replicas": 2.0}
    assert check_goal(mission, LabControls(scenario="mission-4"), tiles).met
    assert not check_goal(mission, LabControls(scenario="belgavi"), tiles).met


def test_an_absent_timestamp_reads_as_minus_one() -> None:
    """``timestamp_at`` None fails "the timestamp stays in the prompt" (>= 0)."""
    mission = MISSIONS["mission-2"]
    tiles = {"token_hit_rate": 0.9}
    present = LabControls(scenario="mission-2", timestamp_at=1000)
    absent = LabControls(scenario="mission-2", timestamp_at=None)
    assert check_goal(mission, present, tiles).met
    assert not check_goal(mission, absent, tiles).met


def test_condition_values_are_displayed_in_their_units() -> None:
    """Rates in %, times in s, an absent timestamp as 'none', the traffic check as yes/no."""
    goal = check_goal(
        MISSIONS["mission-2"],
        LabControls(scenario="belgavi", timestamp_at=None),
        {"token_hit_rate": 0.7251, "ttft_p95_s": 0.2},
    )
    shown = {c.subject: c.display for c in goal.conditions}
    assert shown == {
        "timestamp_at": "none",
        "token_hit_rate": "72.5 %",
        "arrival_rate": "30",
        "scenario": "no",
    }
