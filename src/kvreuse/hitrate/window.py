"""Windowed token hit rate per instance, and step-change alerts.

Counters only grow; the hit rate over a window is the ratio of their increases, exactly what
``rate(hits[5m]) / rate(queries[5m])`` computes in PromQL. A counter that goes down means the
engine restarted: the window restarts from that scrape. Time is passed in.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvreuse.errors import ConfigError
from kvreuse.hitrate.prometheus import CacheCounters


@dataclass(frozen=True, slots=True)
class RateReading:
    """One instance's hit rate after a scrape at time ``t``.

    ``window_rate`` is cached/queried tokens over the last ``covered_seconds`` (``None`` without
    queried tokens in the window); ``lifetime_rate`` over the counters' whole life. Gauge-only
    engines give the engine's own rate in both.
    """

    t: float
    instance: str
    family: str
    window_rate: float | None
    lifetime_rate: float | None
    window_queries: float
    window_hits: float
    covered_seconds: float
    reset: bool = False
    # The engine reported more cached than queried tokens (a rate over 100 % is no rate): both
    # rates are None then, and the reading says so.
    inconsistent: bool = False


class WindowedHitRate:
    """Keeps the scrapes of one instance that span the window. O(1) amortised per scrape."""

    def __init__(self, instance: str, window_seconds: float) -> None:
        if window_seconds <= 0:
            raise ConfigError(f"--window must be positive, got {window_seconds}")
        self.instance = instance
        self.window_seconds = window_seconds
        self._scrapes: deque[tuple[float, float, float]] = deque()

    def observe(self, t: float, counters: CacheCounters) -> RateReading:
        if counters.hits is None or counters.queries is None:
            rate = counters.gauge_rate
            return RateReading(t, self.instance, counters.family, rate, rate, 0.0, 0.0, 0.0)
        reset = bool(self._scrapes) and (
            counters.hits < self._scrapes[-1][1] or counters.queries < self._scrapes[-1][2]
        )
        if reset:
            self._scrapes.clear()
        self._scrapes.append((t, counters.hits, counters.queries))
        # Keep one scrape at or before the window start as the baseline.
        while len(self._scrapes) > 2 and self._scrapes[1][0] <= t - self.window_seconds:
            self._scrapes.popleft()
        start_t, start_hits, start_queries = self._scrapes[0]
        delta_hits = counters.hits - start_hits
        delta_queries = counters.queries - start_queries
        inconsistent = delta_hits > delta_queries or counters.hits > counters.queries
        window_rate = (delta_hits / delta_queries
                       if delta_queries > 0 and not inconsistent else None)
        lifetime = (counters.hits / counters.queries
                    if counters.queries > 0 and not inconsistent else None)
        return RateReading(
            t,
            self.instance,
            counters.family,
            window_rate,
            lifetime,
            delta_queries,
            delta_hits,
            t - start_t,
            reset,
            inconsistent,
        )


@dataclass(frozen=True, slots=True)
class FingerprintChange:
    """The deployed prompt fingerprint changed at ``t``."""

    t: float
    old: str
    new: str


@dataclass(frozen=True, slots=True)
class StepAlert:
    """The windowed hit rate fell by ``drop_points`` percentage points against the previous
    window. ``fingerprint_change`` is a template change shortly before, if one was seen."""

    t: float
    instance: str
    baseline_rate: float
    current_rate: float
    drop_points: float
    fingerprint_change: FingerprintChange | None = None

    def describe(self) -> str:
        text = (
            f"{self.instance}: token hit rate fell {self.drop_points:.1f} points "
            f"({self.baseline_rate:.1%} -> {self.current_rate:.1%})"
        )
        change = self.fingerprint_change
        if change is not None:
            text += (
                f"; the prompt fingerprint changed {self.t - change.t:.0f} s earlier "
                f"({change.old[:12]} -> {change.new[:12]}): expect a cold-cache period"
            )
        return text


class StepDetector:
    """Fires once when the windowed rate drops more than ``threshold_points`` below the rate one
    window earlier; re-arms when the rate recovers to within half the threshold."""

    def __init__(
        self, threshold_points: float, window_seconds: float, min_queries: float = 1.0
    ) -> None:
        if threshold_points <= 0:
            raise ConfigError(f"--drop must be positive percentage points, got {threshold_points}")
        self.threshold = threshold_points / 100.0
        self.window_seconds = window_seconds
        self.min_queries = min_queries
        self._history: deque[tuple[float, float]] = deque()
        self._fired = False
        self._changes: deque[FingerprintChange] = deque()

    def note_fingerprint_change(self, change: FingerprintChange) -> None:
        self._changes.append(change)

    def _baseline(self, t: float) -> float | None:
        cutoff = t - self.window_seconds
        baseline = None
        for when, rate in self._history:
            if when <= cutoff:
                baseline = rate
            else:
                break
        return baseline

    def observe(self, reading: RateReading) -> StepAlert | None:
        rate = reading.window_rate
        if rate is None or reading.window_queries < self.min_queries:
            return None
        t = reading.t
        baseline = self._baseline(t)
        self._history.append((t, rate))
        horizon = t - 3 * self.window_seconds
        while len(self._history) > 1 and self._history[1][0] <= horizon:
            self._history.popleft()
        while self._changes and self._changes[0].t < horizon:
            self._changes.popleft()
        if baseline is None:
            return None
        drop = baseline - rate
        if self._fired:
            if drop < self.threshold / 2:
                self._fired = False
            return None
        if drop <= self.threshold:
            return None
        self._fired = True
        change = next(
            (c for c in reversed(self._changes) if t - 2 * self.window_seconds <= c.t <= t), None
        )
        return StepAlert(t, reading.instance, baseline, rate, drop * 100.0, change)
