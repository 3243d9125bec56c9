"""A clock tests advance by hand, injected wherever kvreuse takes a ``clock``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ManualClock:
    """Returns ``now`` until told otherwise; never reads the wall clock."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move time forward (never backward) and return the new time."""
        assert seconds >= 0, "a clock must not run backward"
        self.now += seconds
        return self.now
