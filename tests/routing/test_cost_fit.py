"""PrefillFit and RelativeSpeeds: a fleet's prefill speed, and each replica's over the fleet's,
from timed first tokens (kvreuse.routing.cost_fit)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvreuse.errors import ConfigError
from kvreuse.routing.base import CostModel
from kvreuse.routing.cost_fit import (
    ALIKE_WITHIN,
    MAX_LOG_STEP,
    MAX_OVERHEAD_S,
    MAX_RELATIVE_SPEED,
    MAX_STEP,
    MAX_TOKENS_PER_S,
    MIN_TOKENS_PER_S,
    PrefillFit,
    PrefillSample,
    RelativeSpeeds,
    _banded_speeds,
    _routed_speeds,
    prediction_parts,
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


# ---------------------------------------------------------------------------- RelativeSpeeds


def serve_fleet(true_speeds: dict[str, float], answers: int, seed: int = 11,
                noise: float = 0.1) -> tuple[PrefillFit, RelativeSpeeds]:
    """Replicas at ``true_speeds`` times 8,000 tokens/s (20 ms overhead), timed as the gateway
    times them: each request's queue and prompt in weighted units (divided by the speed
    believed when it was sent), the fit and the speeds both fed its first token."""
    rng = random.Random(seed)
    fit, speeds = PrefillFit(PRIOR), RelativeSpeeds()
    names = sorted(true_speeds)
    for _ in range(answers):
        replica = rng.choice(names)
        believed = speeds.speed(replica)
        ahead = rng.randint(0, 4)
        raw_ahead = sum(rng.randint(50, 3000) for _ in range(ahead))
        raw_uncached = rng.randint(50, 3000)
        seconds = 0.02 * (ahead + 1) + (raw_ahead + raw_uncached) / (8000.0 * true_speeds[replica])
        sample = PrefillSample(ahead, int(raw_ahead / believed), int(raw_uncached / believed),
                               seconds * rng.uniform(1 - noise, 1 + noise))
        overhead_part, token_part = prediction_parts(fit.model(), sample)
        predicted_s = overhead_part + token_part
        share = token_part / predicted_s
        fit.observe(sample)
        speeds.observe(replica, predicted_s, share, sample.seconds)
        speeds.check_invariants()
    return fit, speeds


def test_before_any_sample_every_replica_runs_at_the_fleets_speed() -> None:
    """With nothing timed, every speed, the untimed one's included, is 1."""
    speeds = RelativeSpeeds()
    assert speeds.speed("a") == speeds.unmeasured_speed() == 1.0 and dict(speeds.speeds()) == {}


def test_a_replica_never_timed_is_assumed_as_fast_as_the_fastest_timed() -> None:
    """With a slow and a fast replica timed, a third never timed reads as the fast one, not
    as their mean (which would send it too little to be timed)."""
    _, speeds = serve_fleet({"slow": 0.25, "fast": 1.0}, 400)
    assert speeds.speed("slow") < 0.5 * speeds.speed("fast")
    assert speeds.speed("untimed") == speeds.unmeasured_speed() == speeds.speed("fast")


def test_a_newcomer_starts_at_the_fastest_speed() -> None:
    """A replica's first answer on time, after a slow and a fast one were timed, leaves it
    level with the fast one."""
    _, speeds = serve_fleet({"slow": 0.25, "fast": 1.0}, 400)
    speeds.observe("new", 0.1, 1.0, 0.1)  # exactly as predicted at the speed assumed
    speeds.check_invariants()
    assert speeds.speed("new") == pytest.approx(speeds.speed("fast"))


def test_one_replica_four_times_slower_is_found() -> None:
    """Among four replicas, one at a quarter of the others' speed is measured within 15 %."""
    _, speeds = serve_fleet({"slow": 0.25, "a": 1.0, "b": 1.0, "c": 1.0}, 2000)
    ratios = [speeds.speed("slow") / speeds.speed(fast) for fast in "abc"]
    assert all(ratio == pytest.approx(0.25, rel=0.15) for ratio in ratios), speeds.speeds()


def test_the_fit_and_the_speeds_predict_each_replicas_answers() -> None:
    """On a fleet of three speeds, the fit times a replica's speed predicts its time."""
    truth = {"half": 0.5, "one": 1.0, "double": 2.0}
    fit, speeds = serve_fleet(truth, 3000, noise=0.0)
    model = fit.model()
    for name, true in truth.items():
        measured = model.prefill_tokens_per_s * speeds.speed(name)
        assert measured == pytest.approx(8000.0 * true, rel=0.15), (name, model, speeds.speeds())


def test_alike_replicas_stay_alike() -> None:
    """Four replicas of one speed, noisy answers: every speed is exactly 1."""
    _, speeds = serve_fleet({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}, 3000, noise=0.3)
    assert all(speed == 1.0 for speed in speeds.speeds().values()), speeds.speeds()


def test_a_replica_that_recovers_is_followed() -> None:
    """A replica slow for 1,500 answers, then back to speed, returns within 15 % of the others
    in 1,500 more."""
    _, speeds = serve_fleet({"sick": 0.25, "a": 1.0, "b": 1.0}, 1500)
    assert speeds.speed("sick") < 0.5
    rng = random.Random(2)
    for _ in range(1500):
        replica = rng.choice(["sick", "a", "b"])
        # Recovered: every replica now answers as predicted for its speed's units.
        share = 0.9
        predicted_s = 0.2
        speeds.observe(replica, predicted_s, share,
                       predicted_s * speeds.speed(replica) * rng.uniform(0.9, 1.1))
    assert speeds.speed("sick") / speeds.speed("a") == pytest.approx(1.0, rel=0.15)


def settle(speeds: RelativeSpeeds, truth: dict[str, float], rounds: int) -> None:
    """``rounds`` answers from each replica, each exactly as long as its true speed (relative
    to the fleet's model) makes it against the speed believed."""
    for _ in range(rounds):
        for replica, true in truth.items():
            speeds.observe(replica, 0.1, 1.0, 0.1 * speeds.speed(replica) / true)
            speeds.check_invariants()


def test_one_stalled_answer_moves_a_speed_a_bounded_step() -> None:
    """After 400 answers on time from replicas twice as fast as one another, one a million
    times late lowers the slow one's speed by at most exp(MAX_LOG_STEP / 32)."""
    speeds = RelativeSpeeds()
    settle(speeds, {"a": 0.5, "b": 1.0}, 400)
    before = speeds.speed("b") / speeds.speed("a")
    assert before == pytest.approx(2.0, rel=0.01)
    speeds.observe("a", 0.1, 1.0, 1e5)
    ratio = speeds.speed("b") / speeds.speed("a")
    assert before < ratio <= before * math.exp(MAX_LOG_STEP / 32) + 1e-9, (before, ratio)


def test_replicas_within_the_alike_band_are_routed_on_as_one_speed() -> None:
    """Three replicas whose answers make them 0.85, 1 and 1.15 times the fleet's speed (the
    time model's own errors on identical hardware) all read as one speed."""
    speeds = RelativeSpeeds()
    settle(speeds, {"a": 0.85, "b": 1.0, "c": 1.15}, 400)
    assert speeds.speed("a") == speeds.speed("b") == speeds.speed("c"), speeds.speeds()


def test_a_replica_outside_the_alike_band_keeps_its_own_speed() -> None:
    """Among three alike replicas, one 1.6 times slower (just outside ALIKE_WITHIN) reads
    at its own speed."""
    speeds = RelativeSpeeds()
    settle(speeds, {"slow": 1 / 1.6, "a": 1.0, "b": 1.0}, 400)
    assert speeds.speed("a") == speeds.speed("b")
    assert speeds.speed("a") / speeds.speed("slow") == pytest.approx(1.6, rel=0.02)
    assert ALIKE_WITHIN < 1.6


def test_a_fleet_half_fast_half_slow_keeps_both_speeds() -> None:
    """Two replicas twice as fast as the other two keep the two speeds, each kind routed
    as one."""
    speeds = RelativeSpeeds()
    settle(speeds, {"s1": 0.5, "s2": 0.5, "f1": 1.0, "f2": 1.0}, 400)
    assert speeds.speed("f1") / speeds.speed("s1") == pytest.approx(2.0, rel=0.02)
    assert speeds.speed("f1") == speeds.speed("f2") and speeds.speed("s1") == speeds.speed("s2")


def test_a_replicas_first_answer_moves_it_at_most_half_a_step() -> None:
    """A replica's very first answer, however late, lowers its speed by at most
    exp(MAX_LOG_STEP / 2) against the fleet."""
    speeds = RelativeSpeeds()
    speeds.observe("b", 0.1, 1.0, 0.1)
    speeds.observe("a", 0.1, 1.0, 1e5)
    ratio = speeds.speed("b") / speeds.speed("a")
    assert 1.0 < ratio <= math.exp(MAX_LOG_STEP / 2) + 1e-12, ratio


def test_a_slow_replica_is_found_within_its_first_forty_answers() -> None:
    """One replica of four at a quarter speed is measured within 25 % after 160 answers."""
    _, speeds = serve_fleet({"slow": 0.25, "a": 1.0, "b": 1.0, "c": 1.0}, 160)
    ratio = speeds.speed("slow") / speeds.speed("a")
    assert ratio == pytest.approx(0.25, rel=0.25), speeds.speeds()


def test_overhead_only_answers_say_nothing_of_speed() -> None:
    """A first token predicted as all overhead (share 0) leaves the speed alone, however
    late."""
    speeds = RelativeSpeeds()
    for _ in range(50):
        speeds.observe("a", 0.02, 0.0, 2.0)
        speeds.observe("b", 0.02, 0.0, 0.02)
    assert speeds.speed("a") == speeds.speed("b") == 1.0


def test_speeds_stay_within_bounds() -> None:
    """A replica a thousand times slower is held at MAX_RELATIVE_SPEED below the fleet."""
    _, speeds = serve_fleet({"dead": 0.001, "a": 1.0}, 3000, noise=0.0)
    assert speeds.speed("a") / speeds.speed("dead") <= MAX_RELATIVE_SPEED ** 2 + 1e-9
    assert speeds.speed("dead") >= 1 / MAX_RELATIVE_SPEED - 1e-12


def test_forgetting_a_replica_renormalises_the_others() -> None:
    """A replica removed leaves the others centred on 1; a newcomer starts at 1."""
    _, speeds = serve_fleet({"slow": 0.25, "a": 1.0, "b": 1.0}, 1500)
    speeds.forget("slow")
    speeds.check_invariants()
    assert set(speeds.speeds()) == {"a", "b"}
    assert speeds.speed("a") * speeds.speed("b") == pytest.approx(1.0)
    speeds.observe("new", 0.1, 1.0, 0.1)
    speeds.check_invariants()
    assert speeds.speed("new") == pytest.approx(1.0, rel=0.05)


@settings(max_examples=200, deadline=None)
@example(fed=[("a", 1.0, 0.0, 1.0), ("b", 1.0, 1.0, 4.0), ("a", 1.2711610061536464e+308, 1.0, 1.0)],
         forgotten=[])  # a prediction rescaled past the largest float: was NaN speeds
@given(st.lists(st.tuples(st.sampled_from("abcd"),
                          st.floats(allow_nan=True, allow_infinity=True),
                          st.floats(allow_nan=True, allow_infinity=True),
                          st.floats(allow_nan=True, allow_infinity=True)), max_size=60),
       st.lists(st.sampled_from("abcd"), max_size=3))
def test_whatever_it_is_fed_speeds_stay_finite_and_bounded(
        fed: list[tuple[str, float, float, float]], forgotten: list[str]) -> None:
    """Any samples, and any replicas forgotten, leave finite speeds within bounds."""
    speeds = RelativeSpeeds()
    for replica, predicted_s, share, seconds in fed:
        speeds.observe(replica, predicted_s, share, seconds)
        speeds.check_invariants()
    for replica in forgotten:
        speeds.forget(replica)
        speeds.check_invariants()
    for speed in speeds.speeds().values():
        assert 1 / MAX_RELATIVE_SPEED - 1e-12 <= speed <= MAX_RELATIVE_SPEED + 1e-12


def test_a_memory_under_one_sample_is_refused() -> None:
    """RelativeSpeeds(memory_samples=0.5) is a ConfigError."""
    with pytest.raises(ConfigError):
        RelativeSpeeds(memory_samples=0.5)


@given(st.lists(st.floats(-0.5, 0.5), min_size=1, max_size=12))
def test_routed_speeds_keep_the_learned_order_and_centre(logs: list[float]) -> None:
    """A replica learned faster is never routed slower, the routed speeds' geometric mean
    is 1, and learned speeds all within ALIKE_WITHIN of one another are routed as 1."""
    learned = {f"r{i}": value - sum(logs) / len(logs) for i, value in enumerate(logs)}
    routed = _routed_speeds(learned)
    by_learned = sorted(learned, key=learned.__getitem__)
    assert all(routed[a] <= routed[b] for a, b in itertools.pairwise(by_learned))
    assert math.fsum(math.log(speed) for speed in routed.values()) == pytest.approx(0.0, abs=1e-9)
    if max(logs) - min(logs) < math.log(ALIKE_WITHIN):
        assert all(speed == pytest.approx(1.0) for speed in routed.values())


@settings(max_examples=60)
@given(st.integers(0, 2**32 - 1), st.integers(1, 10))
def test_speeds_from_the_spread_passed_through_match_speeds_computed_afresh(
        seed: int, replicas: int) -> None:
    """After every answer, on fleets from alike to 100x apart (clipped), the speeds routed
    on (from the spread found while centring) are exactly those of the centred logs."""
    rng = random.Random(seed)
    slowness = {f"r{i}": rng.choice([1.0, 1.0, 0.5, 0.25, 0.01, 100.0])
                for i in range(replicas)}
    speeds = RelativeSpeeds()
    for _ in range(120):
        replica = rng.choice(list(slowness))
        predicted_s = rng.uniform(0.01, 2.0)
        speeds.observe(replica, predicted_s, rng.random(),
                       predicted_s / slowness[replica] * rng.uniform(0.7, 1.4))
        afresh = _routed_speeds(speeds._log_speed)
        assert speeds.speeds() == afresh
        assert speeds._fastest == max(afresh.values())


@given(st.lists(st.floats(-0.2, 0.2), min_size=1, max_size=12))
def test_an_alike_fleets_shortcut_matches_the_sliding_window(logs: list[float]) -> None:
    """Learned speeds all within ALIKE_WITHIN: the O(n) shortcut routes each as the window
    does, to rounding."""
    learned = {f"r{i}": value - sum(logs) / len(logs) for i, value in enumerate(logs)}
    assert max(logs) - min(logs) < math.log(ALIKE_WITHIN)
    shortcut, window = _routed_speeds(learned), _banded_speeds(learned)
    assert shortcut.keys() == window.keys()
    for replica, speed in shortcut.items():
        assert speed == 1.0
        assert window[replica] == pytest.approx(speed, rel=1e-12)
