"""The one percentile every report uses (kvreuse.sim.summary)."""

from __future__ import annotations

import math

from kvreuse.sim.summary import percentile


def test_percentile_is_nearest_rank() -> None:
    """The value at rank ceil(fraction * n), counting from 1; at least the smallest."""
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [percentile(values, f) for f in (0.0, 0.2, 0.5, 0.61, 0.99, 1.0)] == [
        1.0, 1.0, 3.0, 4.0, 5.0, 5.0]


def test_percentile_of_nothing_is_the_callers_empty_value() -> None:
    """No values give 0.0 unless the caller names another figure (the load reports say NaN)."""
    assert percentile([], 0.5) == 0.0
    assert math.isnan(percentile([], 0.99, empty=math.nan))
