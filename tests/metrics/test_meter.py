"""Reuse metrics and their denominators."""

from __future__ import annotations

import pytest

from kvreuse.errors import ConfigError
from kvreuse.metrics import RequestObservation, ReuseMeter, band_label


def seed_004_population() -> list[RequestObservation]:
    """Seed 004's warmed interval: tenant A 80 x (1,024 shared + 500), tenant B 20 x 600."""
    tenant_a = [
        RequestObservation(prompt_tokens=1524, cached_tokens=768, eligible_tokens=1024,
                           namespace="tenant-a")
        for _ in range(80)
    ]
    tenant_b = [
        RequestObservation(prompt_tokens=600, cached_tokens=0, eligible_tokens=0,
                           namespace="tenant-b")
        for _ in range(20)
    ]
    return tenant_a + tenant_b


def test_seed_004_token_hit_rate() -> None:
    """61,440 cached of 133,920 prompt tokens is a 45.9 % token hit rate, not 75 %."""
    meter = ReuseMeter()
    meter.observe_all(seed_004_population())
    overall = meter.overall()
    assert overall.cached_tokens == 61_440
    assert overall.prompt_tokens == 133_920
    assert overall.token_hit_rate == pytest.approx(0.4588, abs=5e-4)


def test_seed_004_reuse_effectiveness() -> None:
    """Within tenant A's eligible shared prefixes the effectiveness is 75 %."""
    meter = ReuseMeter()
    meter.observe_all(seed_004_population())
    assert meter.overall().eligible_tokens == 81_920
    assert meter.overall().reuse_effectiveness == pytest.approx(0.75)


def test_request_hit_rate_flatters() -> None:
    """A 16-token hit on a 20,000-token prompt counts as a request hit but barely a token hit."""
    meter = ReuseMeter()
    meter.observe(RequestObservation(prompt_tokens=20_000, cached_tokens=16))
    overall = meter.overall()
    assert overall.request_hit_rate == 1.0
    assert overall.token_hit_rate < 0.001


def test_bands_split_by_prompt_length() -> None:
    """Observations land in the band of their prompt length."""
    meter = ReuseMeter(bands=(1000,))
    meter.observe(RequestObservation(prompt_tokens=600, cached_tokens=0))
    meter.observe(RequestObservation(prompt_tokens=1524, cached_tokens=768))
    bands = {s.label: s for s in meter.by_band()}
    assert set(bands) == {"0-999", "1000+"}
    assert bands["1000+"].token_hit_rate == pytest.approx(768 / 1524)
    assert bands["0-999"].token_hit_rate == 0.0


def test_band_label_boundaries() -> None:
    """Band upper bounds are exclusive."""
    assert band_label(511) == "0-511"
    assert band_label(512) == "512-2047"
    assert band_label(40_000) == "32768+"


def test_by_namespace() -> None:
    """Per-namespace summaries keep tenants apart."""
    meter = ReuseMeter()
    meter.observe_all(seed_004_population())
    by_ns = {s.label: s for s in meter.by_namespace()}
    assert by_ns["tenant-a"].token_hit_rate == pytest.approx(61_440 / (80 * 1524))
    assert by_ns["tenant-b"].requests == 20


def test_missing_eligible_counts_whole_prompt() -> None:
    """Without an eligible count, effectiveness falls back to the whole prompt (stated)."""
    meter = ReuseMeter()
    meter.observe(RequestObservation(prompt_tokens=100, cached_tokens=50))
    assert meter.overall().reuse_effectiveness == meter.overall().token_hit_rate == 0.5


def test_empty_meter_reports_zero_not_nan() -> None:
    """An empty population has rates of 0 rather than dividing by zero."""
    overall = ReuseMeter().overall()
    assert overall.token_hit_rate == 0.0 and overall.request_hit_rate == 0.0


def test_cached_above_prompt_is_rejected() -> None:
    """More cached than prompt tokens is a caller mistake naming both numbers."""
    with pytest.raises(ConfigError, match="cannot exceed"):
        RequestObservation(prompt_tokens=10, cached_tokens=11)


def test_bands_must_increase() -> None:
    """Unsorted band bounds are rejected."""
    with pytest.raises(ConfigError, match="increasing"):
        ReuseMeter(bands=(100, 50))


def test_as_dict_states_denominators() -> None:
    """JSON output carries the numerators and denominators, not just the ratios."""
    meter = ReuseMeter()
    meter.observe_all(seed_004_population())
    data = meter.overall().as_dict()
    assert data["prompt_tokens"] == 133_920 and data["eligible_tokens"] == 81_920
