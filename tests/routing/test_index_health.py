"""The trust state of a KV-event index, from its predictions and the engine's realized hits."""

from __future__ import annotations

import pytest

from kvreuse.errors import ConfigError
from kvreuse.routing.index_health import EXACT, SUSPECT, HealthSettings, IndexHealth


def test_exact_predictions_stay_exact() -> None:
    """Predictions that the engine realizes never make the index suspect."""
    health = IndexHealth()
    for i in range(100):
        assert health.observe(64 * (i % 4), 64 * (i % 4), float(i)) is None
    assert health.state == EXACT and health.window_error() == 0.0


def test_one_race_is_not_a_blind_index() -> None:
    """A single shortfall (a block evicted between decision and prefill) changes nothing."""
    health = IndexHealth()
    for i in range(10):
        health.observe(128, 128, float(i))
    assert health.observe(128, 0, 10.0) is None
    assert health.state == EXACT


def test_persistent_shortfall_makes_it_suspect_and_asks_a_resync() -> None:
    """Realized hits persistently below predictions: suspect, and a rebuild is wanted once,
    then again only after resync_every_s."""
    health = IndexHealth(HealthSettings(resync_every_s=30.0))
    changes = [health.observe(256, 0, float(i)) for i in range(3)]
    assert changes == [None, None, SUSPECT]
    assert health.suspect and health.window_error() == 1.0
    assert health.wants_resync(3.0)
    health.resync_requested(3.0)
    assert not health.wants_resync(10.0) and health.wants_resync(33.0)
    assert health.shortfall_tokens == 768


def test_underprediction_alone_is_not_suspect() -> None:
    """An index that predicts less than the engine has (cold, partly rebuilt) is honest."""
    health = IndexHealth()
    for i in range(50):
        assert health.observe(0, 512, float(i)) is None
        assert health.observe(32, 512, float(i)) is None
    assert health.state == EXACT and health.excess_tokens > 0


def test_it_returns_to_exact_once_predictions_hold_again() -> None:
    """After recover_after held predictions (and min_suspect_s) it is exact again; a shortfall
    meanwhile restarts the count."""
    health = IndexHealth(HealthSettings(recover_after=3, min_suspect_s=1.0))
    for i in range(3):
        health.observe(100, 0, 0.0 + i * 0.01)
    assert health.suspect
    assert health.observe(100, 100, 0.1) is None
    assert health.observe(100, 100, 0.2) is None
    assert health.observe(100, 10, 0.3) is None  # short again: the count restarts
    assert health.observe(100, 100, 0.4) is None
    assert health.observe(100, 100, 0.5) is None
    assert health.observe(100, 100, 0.6) is None  # three held, but only 0.6 s suspect
    assert health.observe(0, 0, 1.5) == EXACT
    assert health.transitions == 2 and not health.wants_resync(100.0)


def test_settings_are_checked() -> None:
    """Impossible thresholds are refused with a message."""
    with pytest.raises(ConfigError):
        HealthSettings(window=2, min_shortfalls=3)
    with pytest.raises(ConfigError):
        HealthSettings(suspect_ratio=1.0)
    with pytest.raises(ValueError):
        IndexHealth().observe(-1, 0, 0.0)
