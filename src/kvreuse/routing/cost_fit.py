"""A fleet's prefill speed, learned from the first tokens its replicas send back.

:class:`~kvreuse.routing.base.CostModel` turns queued tokens into seconds for the policies that
predict time (``relative_spill``'s ``R`` and a prefix's demand, ``cost``, ``cache_aware``'s
spill bound, ``least_load``). Its constants (10,000 prefill tokens a second, 15 ms a request)
are seed 001's; real engines differ by orders of magnitude (the tiny Llama of tests/vllm on
vLLM's CPU build, a small model on a GPU, a 70B model on the same GPU). Scale alone cancels out
of most comparisons a policy makes, which weigh one replica's predicted wait against another's,
but not out of all of them: a prefix's demand (its requests a second times each one's prefill
seconds) is compared with a number of replicas, and the fixed per-request overhead is weighed
against tokens. A gateway therefore measures the speed it routes on (:class:`PrefillFit`).

The model is the simulator's serial prefill (:mod:`kvreuse.sim.replica`): a request sent to a
replica with ``n`` requests and ``T`` prompt tokens ahead of it that the router has not yet
heard a first token of, itself ``u`` tokens the router predicts uncached, has its first token
after about::

    seconds = overhead × (n + 1) + (T + u) / rate

(the :mod:`kvreuse.routing.ttft` prediction). :class:`PrefillFit` finds ``overhead`` and
``1 / rate`` by least squares, with three choices:

* **Relative errors.** Each sample is divided by what the prior model predicts for it, so a
  request that waited 30 s behind a queue does not outweigh a hundred 50 ms answers, and the
  two unknowns become dimensionless factors on the prior's (a well-conditioned 2 × 2 system
  whatever the units).
* **Forgetting.** Each sample multiplies the weight of those before it by ``1 - 1 /
  memory_samples`` (256): an engine that slows down (a longer context, a colder GPU, another
  tenant's batch) is followed within a few hundred requests.
* **An anchor.** The prior counts as ``prior_samples`` (4) samples that agree with it exactly
  (ridge regression towards it), forgotten like any sample down to ``MIN_ANCHOR``: the first
  answers move the fit a little, a few dozen decide it, a few hundred leave nothing of the
  prior, and when every sample has the same mix of ``n`` and tokens (the data then say only
  what their sum costs) what is left of it splits that cost between overhead and rate.

* **Bounded steps.** A sample counts as at most ``MAX_STEP`` (8) times, and at least
  1 / ``MAX_STEP`` of, what the current fit predicts for it: one answer, however late or early
  (a request stalled behind a full KV pool, a paused process, a reply that was not a first
  token), moves the fit by a bounded amount, while a real change of speed, even a hundredfold,
  is followed in a few dozen samples, each allowed a step of up to 8 from the last.

The fitted values are kept within ``[0, MAX_OVERHEAD_S]`` and ``[MIN_TOKENS_PER_S,
MAX_TOKENS_PER_S]``.

**One replica slower than the others.** One fit per model assumes its replicas alike. A fleet
of mixed hardware, or one replica degraded (a GPU at low clocks, a noisy neighbour, a failing
link), is not: a replica four times slower, seen as average, is sent as many queued tokens
as the others and makes its requests wait four times as long. :class:`RelativeSpeeds` learns
each replica's speed relative to the fleet from how its first tokens compare with the fit's
prediction (a stochastic approximation of the log ratio, weighted by the share of the
prediction that tokens make up, since the speed scales only that part; a running mean over a
replica's first 32 answers, then a memory of 32), normalised to a
geometric mean of 1 over the replicas so that the fit and the speeds do not trade a common
factor. A gateway multiplies each upstream's weight by it: the load the policies see is
queued tokens over speed.

**Speeds within a factor** ``ALIKE_WITHIN`` **(1.5) of one another are routed on as one.** The
time model has errors of its own that are no replica's speed: a prefill under way is counted
whole (its answer comes sooner than predicted), a prefix predicted cached was evicted, a request
waits behind a full KV pool. They fall unevenly on replicas that play different parts (the one
holding a hot prefix always has a prefill under way), so on identical replicas learned speeds
wander: 0.78 to 1.21 within one run of the simulator's belgavi on three alike replicas. Routed
on, that skew made the default's p95 collapse from 0.4 s to 3-4.5 s in 5 of 30 jittered runs
(``benchmarks/default_vs_peers.py --prefill-speeds 1``). So each replica is routed on at the
median of the learned speeds within the band of its own: replicas that differ by less than the
model's own errors are one speed, kinds of hardware twice as fast as one another (or a replica
throttled to a quarter) keep theirs. The speeds are still learned exactly (each answer is
judged against the replica's learned speed, not the one routed on, so the band never feeds
back into what is learned); only what routing reads is banded. What is lost: a replica truly
1.3 times slower than the others is routed as one of them.

**A replica not yet timed is assumed as fast as the fastest timed one** (and starts there at
its first answer). A replica assumed slow is sent little, so it is timed late or never: in
the simulator's multi-model workload with one replica at a quarter speed, the slow replica
answered first, a fast one not yet timed read at the fleet's mean of the two measured (half
its true speed), and it took no request of that model for 53 s. Over six jittered runs the
default's p95 was 0.8-29 s, against 1.0-4.1 s with the true speeds; assumed fastest,
0.8-7.2 s at a hit rate 1.2 points higher on average. The optimism costs a few answers: a
slow newcomer's first answers move it half, a third, a quarter of the way (at most
``MAX_LOG_STEP`` each).

Pure: no clock; the caller measures the seconds. O(1) per sample and per read, except
:meth:`RelativeSpeeds.observe`, O(replicas) to renormalise (O(replicas log replicas) while
the speeds span more than the alike band).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from kvreuse.errors import ConfigError
from kvreuse.routing.base import CostModel

MAX_OVERHEAD_S = 1.0
MIN_TOKENS_PER_S = 10.0
MAX_TOKENS_PER_S = 1e9
MIN_ANCHOR = 1e-3
"""The anchor's weight, in samples, once it has faded."""
MAX_STEP = 8.0
"""A sample's seconds are clipped to [1/MAX_STEP, MAX_STEP] times the current fit's
prediction for it."""


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """What a router knew when it sent a request (its load view of the replica, in the units
    the policies see: weighted) and how long the first token took."""

    requests_ahead: int
    tokens_ahead: int
    uncached_tokens: int
    seconds: float


def prediction_parts(model: CostModel, sample: PrefillSample) -> tuple[float, float]:
    """What ``model`` predicts for ``sample``'s first token, in seconds, as its two parts:
    the requests' overheads and the tokens over the rate. O(1)."""
    return (model.overhead_s * (sample.requests_ahead + 1),
            (sample.tokens_ahead + sample.uncached_tokens) / model.prefill_tokens_per_s)


class PrefillFit:
    """See the module docstring. Not thread-safe, like the policies it feeds."""

    __slots__ = ("_decay", "_model", "_prior", "_prior_samples", "_suu", "_suv", "_suz", "_svv",
                 "_svz", "samples")

    def __init__(self, prior: CostModel, *, memory_samples: float = 256.0,
                 prior_samples: float = 4.0) -> None:
        if not memory_samples >= 1:
            raise ConfigError(f"memory_samples must be >= 1, got {memory_samples!r}")
        if not prior_samples > 0:
            raise ConfigError(f"prior_samples must be > 0, got {prior_samples!r}")
        self._prior = prior
        self._prior_samples = prior_samples
        self._decay = 1.0 - 1.0 / memory_samples
        self._suu = self._suv = self._svv = self._suz = self._svz = 0.0
        self._model = prior
        self.samples = 0
        """Samples observed (their weight decays; this count does not)."""

    @property
    def prior(self) -> CostModel:
        return self._prior

    def observe(self, sample: PrefillSample) -> None:
        """Fold one first token in. Samples with nothing to predict (a negative or non-finite
        time, negative counts) are ignored. O(1)."""
        seconds = sample.seconds
        if not (seconds >= 0 and seconds < float("inf")) or min(
                sample.requests_ahead, sample.tokens_ahead, sample.uncached_tokens) < 0:
            return
        overhead_part, token_part = prediction_parts(self._prior, sample)
        predicted = overhead_part + token_part
        if predicted <= 0:  # a zero overhead and nothing to prefill: says nothing of either
            return
        u, v = overhead_part / predicted, token_part / predicted
        expected = sum(prediction_parts(self._model, sample))
        if expected > 0:
            seconds = min(max(seconds, expected / MAX_STEP), expected * MAX_STEP)
        z = seconds / predicted
        d = self._decay
        self._suu = self._suu * d + u * u
        self._suv = self._suv * d + u * v
        self._svv = self._svv * d + v * v
        self._suz = self._suz * d + u * z
        self._svz = self._svz * d + v * z
        self.samples += 1
        self._model = self._solve()

    def model(self) -> CostModel:
        """The cost model the samples so far support (the prior before any). O(1)."""
        return self._model

    def _solve(self) -> CostModel:
        """Ridge least squares for the factors (alpha on the overhead, beta on seconds per
        token), each kept >= 0, then the values kept within the module's bounds."""
        # The anchor fades with the samples' own memory, down to a trace that keeps the system
        # solvable when every sample has the same mix.
        lam = max(self._prior_samples * self._decay ** self.samples, MIN_ANCHOR)
        a11, a12, a22 = self._suu + lam, self._suv, self._svv + lam
        b1, b2 = self._suz + lam, self._svz + lam
        det = a11 * a22 - a12 * a12  # > 0: both diagonals exceed lam > 0 and Cauchy-Schwarz
        alpha = (b1 * a22 - b2 * a12) / det
        beta = (a11 * b2 - a12 * b1) / det
        if alpha < 0:  # the tokens explain more than all of it: no overhead
            alpha, beta = 0.0, b2 / a22
        elif beta < 0:  # the request count explains more than all of it
            alpha, beta = b1 / a11, 0.0
        prior = self._prior
        overhead = min(alpha * prior.overhead_s, MAX_OVERHEAD_S)
        seconds_per_token = beta / prior.prefill_tokens_per_s
        rate = (MAX_TOKENS_PER_S if seconds_per_token <= 1 / MAX_TOKENS_PER_S
                else max(1.0 / seconds_per_token, MIN_TOKENS_PER_S))
        return CostModel(prefill_tokens_per_s=rate, overhead_s=overhead)


MAX_RELATIVE_SPEED = 8.0
"""A replica's learned speed stays within [1/8, 8] times the fleet's (geometric mean)."""
ALIKE_WITHIN = 1.5
"""Learned speeds within this factor of one another are routed on as one (module
docstring)."""
MAX_LOG_STEP = math.log(4.0)
"""One answer's log ratio counts as at most this much (a stalled request moves a replica's
speed by at most ``rate × log 4``)."""


class RelativeSpeeds:
    """Each replica's prefill speed relative to the fleet's: see the module docstring.

    ``observe(replica, predicted_s, token_share, seconds)`` after each timed first token;
    ``speed(replica)`` is the fastest observed replica's speed for a replica never observed
    (1.0 before any), and 1.0 for every replica until some differ. Not thread-safe, like the
    policies it feeds."""

    __slots__ = ("_fastest", "_log_speed", "_rate", "_seen", "_speed")

    def __init__(self, *, memory_samples: float = 32.0) -> None:
        if not memory_samples >= 1:
            raise ConfigError(f"memory_samples must be >= 1, got {memory_samples!r}")
        self._rate = 1.0 / memory_samples
        self._log_speed: dict[str, float] = {}  # not normalised
        self._speed: dict[str, float] = {}  # normalised: what speed() answers
        self._fastest = 1.0  # the largest of _speed's values (1.0 when empty)
        self._seen: dict[str, int] = {}  # samples per replica

    def observe(self, replica: str, predicted_s: float, token_share: float,
                seconds: float) -> None:
        """Fold in one first token of ``replica``: it came after ``seconds``, where the
        fleet's model (with this replica's speed then) predicted ``predicted_s``, of which the
        share ``token_share`` (0 to 1) was tokens over speed. Samples with nothing to compare
        (a non-positive or non-finite time) are ignored. O(replicas)."""
        if not (0 < seconds < math.inf and 0 < predicted_s < math.inf):
            return
        # NaN fails both comparisons: it says nothing, like a share of 0.
        share = token_share if 0.0 <= token_share <= 1.0 else float(token_share > 1.0)
        believed = self.speed(replica)  # what the prediction divided its tokens by
        logs = self._log_speed
        if replica not in logs:  # a newcomer starts where it was assumed: at the fastest
            logs[replica] = max(logs.values()) if logs else 0.0
        # Judged at the learned speed, not the one routed on (they differ within the alike
        # band): else the band's rounding would be learned as the replica's error, and its
        # learned speed would drift out of the band and back.
        token_part = share * predicted_s
        rescaled = token_part * believed / math.exp(logs[replica])
        predicted_s += rescaled - token_part
        if not 0 < predicted_s < math.inf:  # the rescaled tokens under- or overflowed
            return
        share = rescaled / predicted_s
        step = min(max(math.log(predicted_s) - math.log(seconds), -MAX_LOG_STEP), MAX_LOG_STEP)
        # A replica's first answers average (1/2, 1/3, ...), so a slow one is found within a
        # few dozen of them; later ones decay at the configured memory.
        seen = self._seen[replica] = self._seen.get(replica, 0) + 1
        logs[replica] += max(1.0 / (seen + 1), self._rate) * share * step
        self._normalise()

    def speed(self, replica: str) -> float:
        """The replica's learned speed over the fleet's; for one never observed, the
        fastest observed replica's (:meth:`unmeasured_speed`). O(1)."""
        return self._speed.get(replica, self._fastest)

    def unmeasured_speed(self) -> float:
        """What a replica never observed is assumed at: the fastest observed one's speed
        (1.0 before any observation). O(1)."""
        return self._fastest

    def speeds(self) -> Mapping[str, float]:
        """Every observed replica's speed (a view, for metrics)."""
        return self._speed

    def forget(self, replica: str) -> None:
        """``replica`` left the fleet: the others' speeds are renormalised without it.
        O(replicas)."""
        self._seen.pop(replica, None)
        if self._log_speed.pop(replica, None) is not None:
            self._normalise()

    def check_invariants(self) -> None:
        """Learned logs within bounds and centred (mean 0) unless one is held at a bound;
        the speeds routed on derived from them (:func:`_routed_speeds`). O(replicas log
        replicas)."""
        speeds, logs = self._speed, self._log_speed
        assert speeds.keys() == logs.keys(), "speeds and their logs name other replicas"
        assert self._fastest == max(speeds.values(), default=1.0), "fastest speed stale"
        bound = math.log(MAX_RELATIVE_SPEED)
        for replica, value in logs.items():
            assert -bound <= value <= bound, f"{replica}: log speed {value} out of bounds"
        assert not logs or speeds == _routed_speeds(logs), "routed speeds not the learned ones'"
        if logs and all(abs(value) < bound for value in logs.values()):
            mean = sum(logs.values()) / len(logs)
            assert abs(mean) < 1e-9, f"log speeds not centred: mean {mean}"

    def _normalise(self) -> None:
        logs = self._log_speed
        if not logs:
            self._speed = {}
            self._fastest = 1.0
            return
        # Centre the logs so the fleet and the speeds cannot trade a common factor, and keep
        # each within bounds (stored clipped, so a replica recovers at once). Clipping is
        # rare, and one comprehension halves this per-answer cost on large fleets.
        mean = sum(logs.values()) / len(logs)
        bound = math.log(MAX_RELATIVE_SPEED)
        # Centring and clipping are monotone, in floats too, so the centred extremes are
        # the extremes centred: no pass over the centred logs to find their spread.
        lowest, highest = min(logs.values()) - mean, max(logs.values()) - mean
        if -bound <= lowest and highest <= bound:
            logs = {replica: value - mean for replica, value in logs.items()}
        else:
            logs = {replica: min(max(value - mean, -bound), bound)
                    for replica, value in logs.items()}
            lowest, highest = max(lowest, -bound), min(highest, bound)
        self._log_speed = logs
        self._speed = _routed_speeds(logs, highest - lowest)
        self._fastest = max(self._speed.values())


def _routed_speeds(logs: Mapping[str, float], spread: float | None = None
                   ) -> dict[str, float]:
    """The speeds routed on for learned (centred) log speeds ``logs``: each replica at the
    lower median of the learned speeds within ``ALIKE_WITHIN`` of its own (its own among
    them), centred again (a geometric mean of 1) and kept within bounds. A median of a window
    sliding up the sorted speeds never falls, so a replica learned faster is never routed
    slower. O(n log n); O(n) when every learned speed is within the band of every other (an
    alike fleet, the common case), since then each is routed at the same median: 1.0 once
    centred. ``spread``: the largest log minus the smallest, where the caller knows it."""
    if spread is None:
        spread = max(logs.values()) - min(logs.values())
    if spread < math.log(ALIKE_WITHIN):
        return dict.fromkeys(logs, 1.0)
    return _banded_speeds(logs)


def _banded_speeds(logs: Mapping[str, float]) -> dict[str, float]:
    """:func:`_routed_speeds` by its sliding window, whatever the spread. O(n log n)."""
    band = math.log(ALIKE_WITHIN)
    ordered = sorted(logs.values())
    routed_by_log: dict[float, float] = {}
    low = high = 0
    for value in ordered:
        while ordered[low] <= value - band:
            low += 1
        while high < len(ordered) and ordered[high] < value + band:
            high += 1
        routed_by_log[value] = ordered[low + (high - low - 1) // 2]
    mean = sum(routed_by_log[value] for value in logs.values()) / len(logs)
    bound = math.log(MAX_RELATIVE_SPEED)
    return {replica: math.exp(min(max(routed_by_log[value] - mean, -bound), bound))
            for replica, value in logs.items()}


def observe_first_token(fit: PrefillFit, speeds: RelativeSpeeds, replica: str | None,
                        sample: PrefillSample) -> None:
    """One first token of a model's fleet, folded into its fit and (unless ``replica`` is
    ``None``: it left the fleet since) its replica's relative speed, judged against what the
    fit predicted before this sample. What ``kvreuse route`` does per timed answer and the
    simulator's measuring router does per prefill (``FleetConfig.speed_view``). O(replicas)."""
    overhead_part, token_part = prediction_parts(fit.model(), sample)
    fit.observe(sample)
    if replica is not None:
        predicted = overhead_part + token_part
        speeds.observe(replica, predicted, token_part / predicted if predicted > 0 else 0.0,
                       sample.seconds)
