"""PrefillFit: a fleet's prefill speed from timed first tokens (kvreuse.routing.cost_fit)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.errors import ConfigError
from kvreuse.routing.base import CostModel
from kvreuse.routing.cost_fit import (
    MAX_OVERHEAD_S,
    MAX_STEP,
    MAX_TOKENS_PER_S,
    MIN_TOKENS_PER_S,
    PrefillFit,
    PrefillSample,
)

PRIOR = CostModel()  # 10,000 tokens/s, 15 ms


def engine_sample(rng: random.Random, rate: float, overhead: float,
                  noise: float = 0.1) -> PrefillSample:
    """A request timed on a serial engine of that speed: a queue of 0-5 requests ahead."""
    ahead = rng.randint(0, 5)
    tokens_ahead = sum(rng.randint(50, 4000) for _ in range(ahead))
    uncached = rng.randint(50, 4000)
    seconds = overhead * (ahead + 1) + (tokens_ahead + uncached) / rate
    return PrefillSample(ahead, tokens_ahead, uncached,
                         seconds * rng.uniform(1 - noise, 1 + noise))


def predicted(model: CostModel, sample: PrefillSample) -> float:
    return (model.overhead_s * (sample.requests_ahead + 1)
            + (sample.tokens_ahead + sample.uncached_tokens) / model.prefill_tokens_per_s)


def test_before_any_sample_the_model_is_the_prior() -> None:
    """An unfed fit answers with the configured cost model."""
    fit = PrefillFit(PRIOR)
    assert fit.model() == PRIOR and fit.samples == 0


@pytest.mark.parametrize(("rate", "overhead"), [
    (10_000.0, 0.015), (2_000.0, 0.03), (500.0, 0.2), (100_000.0, 0.005), (50_000.0, 0.0)])
def test_it_finds_an_engines_speed_from_hundreds_of_first_tokens(
        rate: float, overhead: float) -> None:
    """300 noisy samples predict a request's time within 5 %, 600 the rate within 10 %."""
    rng = random.Random(7)
    fit = PrefillFit(PRIOR)
    typical = PrefillSample(2, 4000, 2000, 0.0)
    truth = overhead * 3 + 6000 / rate
    for _ in range(300):
        fit.observe(engine_sample(rng, rate, overhead))
    assert predicted(fit.model(), typical) == pytest.approx(truth, rel=0.05), fit.model()
    for _ in range(300):
        fit.observe(engine_sample(rng, rate, overhead))
    assert fit.model().prefill_tokens_per_s == pytest.approx(rate, rel=0.10), fit.model()


def test_samples_of_one_mix_predict_that_mix_and_keep_the_priors_split() -> None:
    """When every sample costs the same, the fit predicts that cost; the split stays sane."""
    fit = PrefillFit(PRIOR)
    for _ in range(300):
        fit.observe(PrefillSample(0, 0, 1000, 0.03 + 1000 / 2000))
    model = fit.model()
    assert predicted(model, PrefillSample(0, 0, 1000, 0.0)) == pytest.approx(0.53, rel=0.02)
    assert 0 < model.overhead_s < 0.1, model


def test_a_change_of_speed_is_followed() -> None:
    """An engine that becomes 4x slower is tracked within 5 % a thousand samples later."""
    rng = random.Random(3)
    fit = PrefillFit(PRIOR)
    for _ in range(1000):
        fit.observe(engine_sample(rng, 8000.0, 0.01, noise=0.0))
    for _ in range(1000):
        fit.observe(engine_sample(rng, 2000.0, 0.01, noise=0.0))
    assert fit.model().prefill_tokens_per_s == pytest.approx(2000.0, rel=0.05)


def test_one_stalled_answer_moves_the_fit_a_bounded_step() -> None:
    """An answer a million times late counts as at most MAX_STEP times the prediction."""
    rng = random.Random(5)
    fit = PrefillFit(PRIOR)
    for _ in range(100):
        fit.observe(engine_sample(rng, 10_000.0, 0.015, noise=0.0))
    before = fit.model()
    typical = PrefillSample(0, 0, 2000, 0.0)
    fit.observe(PrefillSample(0, 0, 2000, 1e6))
    after = fit.model()
    assert predicted(after, typical) < predicted(before, typical) * 1.25, (before, after)
    assert MAX_STEP > 1


@pytest.mark.parametrize("seconds", [-1.0, math.nan, math.inf, -math.inf])
def test_a_sample_with_an_impossible_time_is_ignored(seconds: float) -> None:
    """Negative, NaN or infinite seconds change nothing."""
    fit = PrefillFit(PRIOR)
    fit.observe(PrefillSample(0, 0, 100, seconds))
    assert fit.samples == 0 and fit.model() == PRIOR


def test_a_sample_with_negative_counts_is_ignored() -> None:
    """Counts below zero are not a queue: the sample changes nothing."""
    fit = PrefillFit(PRIOR)
    fit.observe(PrefillSample(-1, 0, 100, 0.1))
    fit.observe(PrefillSample(0, -5, 100, 0.1))
    assert fit.samples == 0 and fit.model() == PRIOR


def test_a_zero_overhead_prior_learns_only_the_rate() -> None:
    """With a prior of no overhead, nothing to prefill says nothing and is skipped."""
    fit = PrefillFit(CostModel(overhead_s=0.0))
    fit.observe(PrefillSample(0, 0, 0, 0.5))
    assert fit.samples == 0
    fit.observe(PrefillSample(0, 0, 1000, 0.5))
    assert fit.samples == 1 and fit.model().overhead_s == 0.0


@pytest.mark.parametrize(("memory", "prior"), [(0.5, 4.0), (256.0, 0.0), (math.nan, 4.0)])
def test_settings_out_of_range_are_refused(memory: float, prior: float) -> None:
    """A memory under one sample or a prior of no weight is a ConfigError."""
    with pytest.raises(ConfigError):
        PrefillFit(PRIOR, memory_samples=memory, prior_samples=prior)


samples = st.builds(
    PrefillSample,
    requests_ahead=st.integers(0, 10_000),
    tokens_ahead=st.integers(0, 10**9),
    uncached_tokens=st.integers(0, 10**7),
    seconds=st.floats(allow_nan=True, allow_infinity=True),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(samples, max_size=60))
def test_whatever_it_is_fed_the_model_stays_within_bounds(fed: list[PrefillSample]) -> None:
    """Any samples leave a finite model inside the module's bounds."""
    fit = PrefillFit(PRIOR)
    for sample in fed:
        fit.observe(sample)
        model = fit.model()
        assert MIN_TOKENS_PER_S <= model.prefill_tokens_per_s <= MAX_TOKENS_PER_S, model
        assert 0.0 <= model.overhead_s <= MAX_OVERHEAD_S, model
