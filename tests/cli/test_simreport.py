"""The report's plots: bars grouped under their tick, legends beside the plot, bands as
categories (no line drawn from one band to the next)."""

from __future__ import annotations

from typing import Any

import pytest

from kvreuse.cli.simreport import _bands, _load, _pyplot
from kvreuse.sim.runner import ScenarioRun, run_scenario
from kvreuse.sim.scenarios import get_scenario

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def mission_four() -> list[ScenarioRun]:
    scenario = get_scenario("mission-4")
    return run_scenario(scenario, specs=list(scenario.runs)[:3], scale=0.1)


def _legend_is_outside(fig: Any) -> bool:
    (ax,) = fig.axes
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    return bool(legend.x0 >= ax.get_window_extent().x1)


def test_load_bars_sit_over_their_replica_tick(mission_four: list[ScenarioRun]) -> None:
    """One tick per replica, under the middle of its group of bars; the legend hides none."""
    plt = _pyplot()
    fig = _load(plt, mission_four)
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"replica {k}" for k in (1, 2, 3, 4)]
    for k, tick in enumerate(ax.get_xticks()):
        centres = [b.get_x() + b.get_width() / 2 for b in ax.patches
                   if abs(b.get_x() + b.get_width() / 2 - k) < 0.5]
        assert len(centres) == len(mission_four)
        assert min(centres) < tick < max(centres)
        assert abs((min(centres) + max(centres)) / 2 - tick) < 1e-9
    assert _legend_is_outside(fig)
    plt.close(fig)


def test_prompt_length_bands_are_categories(mission_four: list[ScenarioRun]) -> None:
    """Bars per band, ticks named by band, and no line joining two categories."""
    plt = _pyplot()
    fig = _bands(plt, mission_four)
    (ax,) = fig.axes
    assert not ax.lines
    names = [t.get_text() for t in ax.get_xticklabels()]
    assert names and all("-" in name or "+" in name for name in names), names
    assert len(ax.patches) >= len(mission_four)
    assert _legend_is_outside(fig)
    plt.close(fig)
