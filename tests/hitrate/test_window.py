"""Windowed hit rate from counters, counter resets, and step-change alerts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvreuse.errors import ConfigError
from kvreuse.hitrate.prometheus import CacheCounters
from kvreuse.hitrate.window import FingerprintChange, StepAlert, StepDetector, WindowedHitRate


def counters(hits: float, queries: float) -> CacheCounters:
    return CacheCounters("vllm", hits, queries)


def test_window_rate_is_ratio_of_increases() -> None:
    """Over a 60 s window the rate is Δhits/Δqueries between the window's ends."""
    tracker = WindowedHitRate("a", 60)
    tracker.observe(0, counters(0, 0))
    tracker.observe(30, counters(50, 100))
    reading = tracker.observe(60, counters(150, 200))
    assert reading.window_rate == pytest.approx(0.75)
    assert reading.covered_seconds == 60


def test_old_scrapes_leave_the_window() -> None:
    """After the window slides, only recent increases count."""
    tracker = WindowedHitRate("a", 60)
    for t, hits, queries in [(0, 0, 0), (60, 100, 100), (120, 100, 200)]:
        reading = tracker.observe(t, counters(hits, queries))
    assert reading.window_rate == pytest.approx(0.0)
    assert reading.lifetime_rate == pytest.approx(0.5)


def test_counter_reset_restarts_the_window() -> None:
    """A counter that goes down (engine restart) starts a fresh window."""
    tracker = WindowedHitRate("a", 60)
    tracker.observe(0, counters(500, 1000))
    reading = tracker.observe(10, counters(5, 10))
    assert reading.reset and reading.window_rate is None
    assert tracker.observe(20, counters(15, 20)).window_rate == pytest.approx(1.0)


def test_no_queries_means_no_rate() -> None:
    """An idle window reports no rate rather than 0 %."""
    tracker = WindowedHitRate("a", 60)
    tracker.observe(0, counters(10, 10))
    assert tracker.observe(30, counters(10, 10)).window_rate is None


def test_more_cached_than_queried_tokens_is_no_rate_and_says_so() -> None:
    """Counters whose cached tokens outgrow the queried ones (a broken or forged exporter)
    give no rate, not one over 100 %, and the reading is marked inconsistent."""
    tracker = WindowedHitRate("a", 60)
    tracker.observe(0, counters(0, 0))
    reading = tracker.observe(30, counters(300, 100))
    assert reading.inconsistent
    assert reading.window_rate is None and reading.lifetime_rate is None
    healthy = WindowedHitRate("b", 60)
    healthy.observe(0, counters(0, 0))
    assert not healthy.observe(30, counters(50, 100)).inconsistent


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 1000)), min_size=2, max_size=30))
def test_any_counters_give_a_fraction_or_no_rate(steps: list[tuple[int, int]]) -> None:
    """Property: whatever the counters, both rates are None or lie in [0, 1]."""
    tracker = WindowedHitRate("a", 50)
    hits = queries = 0.0
    for t, (h, q) in enumerate(steps):
        hits, queries = hits + h, queries + q
        reading = tracker.observe(t * 10, counters(hits, queries))
        for rate in (reading.window_rate, reading.lifetime_rate):
            assert rate is None or 0.0 <= rate <= 1.0


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 1000)), min_size=2, max_size=30))
def test_window_rate_is_a_fraction(steps: list[tuple[int, int]]) -> None:
    """Property: with hits <= queries in every step the windowed rate lies in [0, 1]."""
    tracker = WindowedHitRate("a", 50)
    hits = queries = 0.0
    for t, (h, q) in enumerate(steps):
        queries += max(h, q)
        hits += min(h, q)
        rate = tracker.observe(t * 10, counters(hits, queries)).window_rate
        assert rate is None or 0.0 <= rate <= 1.0


def _feed(detector: StepDetector, rates: list[float], window: float = 60) -> list[StepAlert]:
    tracker = WindowedHitRate("a", window)
    hits = queries = 0.0
    alerts = []
    for step, rate in enumerate(rates):
        queries += 1000
        hits += 1000 * rate
        alert = detector.observe(tracker.observe(step * 30.0, counters(hits, queries)))
        if alert is not None:
            alerts.append(alert)
    return alerts


def test_step_drop_fires_once() -> None:
    """A fall from 75 % to 40 % fires one alert as soon as the window has fallen 10 points."""
    detector = StepDetector(threshold_points=10, window_seconds=60)
    alerts = _feed(detector, [0.75] * 8 + [0.40] * 8)
    assert len(alerts) == 1
    alert = alerts[0]
    assert alert.baseline_rate == pytest.approx(0.75)
    assert alert.drop_points > 10
    assert alert.t == 240.0  # the first window holding the drop


def test_small_wobble_does_not_fire() -> None:
    """Drops under the threshold are noise."""
    assert _feed(StepDetector(10, 60), [0.75, 0.70, 0.76, 0.71, 0.74, 0.69, 0.75, 0.70]) == []


def test_alert_names_a_recent_fingerprint_change() -> None:
    """A fingerprint change shortly before the drop is attached to the alert."""
    detector = StepDetector(10, 60)
    detector.note_fingerprint_change(FingerprintChange(230.0, "aaaa", "bbbb"))
    alerts = _feed(detector, [0.75] * 8 + [0.30] * 4)
    assert len(alerts) == 1
    alert = alerts[0]
    assert alert.fingerprint_change is not None
    assert "fingerprint changed" in alert.describe()


def test_bad_parameters_are_config_errors() -> None:
    """A non-positive window or threshold says which option to fix."""
    with pytest.raises(ConfigError, match="--window"):
        WindowedHitRate("a", 0)
    with pytest.raises(ConfigError, match="--drop"):
        StepDetector(0, 60)
