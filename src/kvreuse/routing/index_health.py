"""Is an upstream's KV-event index still telling the truth? Prediction against realization.

For every answered request the gateway knows what the upstream's index predicted (cached
prompt tokens, by the engine's own hit rule) and what the engine then reported
(``usage.prompt_tokens_details.cached_tokens``). An index fed by a complete event stream
predicts exactly; one that missed events without noticing (a lost removal, a forged store, an
engine whose cache turned over behind the gateway's back) predicts *more* than the engine has.
:class:`IndexHealth` watches that shortfall and says when to stop trusting the index
(``suspect``) and when to trust it again (``exact``).

Rules, per upstream (all counts in requests whose index predicted something):

* Over the last ``window`` such requests, if at least ``min_shortfalls`` fell short of their
  prediction by more than ``tolerance_tokens`` **and** the tokens missing add up to more than
  ``suspect_ratio`` of the tokens predicted, the index is suspect. A single race (a block
  evicted between the decision and the prefill) does neither.
* While suspect the caller routes on another estimate and asks for a rebuild; :meth:`wants_resync`
  says when (at once, then every ``resync_every_s`` while it stays suspect).
* It is exact again after ``recover_after`` consecutive requests whose prediction held (realized
  at least predicted minus the tolerance, and something predicted or nothing realized) and at
  least ``min_suspect_s`` after it became suspect; a shortfall restarts that count.

Pure: time is passed in; no clocks, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvreuse.errors import ConfigError

EXACT = "exact"
SUSPECT = "suspect"


@dataclass(frozen=True, slots=True)
class HealthSettings:
    """Thresholds of :class:`IndexHealth` (see the module docstring)."""

    window: int = 16
    min_shortfalls: int = 3
    suspect_ratio: float = 0.5
    tolerance_tokens: int = 0
    recover_after: int = 4
    min_suspect_s: float = 1.0
    resync_every_s: float = 30.0

    def __post_init__(self) -> None:
        if self.window < 1 or self.min_shortfalls < 1 or self.recover_after < 1:
            raise ConfigError("window, min_shortfalls and recover_after must be >= 1")
        if self.min_shortfalls > self.window:
            raise ConfigError(f"min_shortfalls ({self.min_shortfalls}) cannot exceed window "
                              f"({self.window})")
        if not 0.0 <= self.suspect_ratio < 1.0:
            raise ConfigError(f"suspect_ratio must be in [0, 1), got {self.suspect_ratio}")
        if self.tolerance_tokens < 0 or self.min_suspect_s < 0 or self.resync_every_s <= 0:
            raise ConfigError("tolerance_tokens and min_suspect_s must be >= 0, "
                              "resync_every_s > 0")


@dataclass(frozen=True, slots=True)
class Observation:
    """One answered request: the index's prediction and the engine's cached tokens."""

    predicted: int
    realized: int


class IndexHealth:
    """The trust state of one upstream's index; see the module docstring."""

    def __init__(self, settings: HealthSettings | None = None) -> None:
        self.settings = settings or HealthSettings()
        self.state = EXACT
        self.suspect_since: float | None = None
        self.transitions = 0
        self.predicted_tokens = 0  # over every observation
        self.shortfall_tokens = 0  # predicted but not realized
        self.excess_tokens = 0  # realized but not predicted (a cold or partial index)
        self._recent: deque[Observation] = deque(maxlen=self.settings.window)
        self._held_in_a_row = 0
        self._last_resync: float | None = None

    @property
    def suspect(self) -> bool:
        return self.state == SUSPECT

    def observe(self, predicted: int, realized: int, now: float) -> str | None:
        """Called once per answered request with usage. Returns the new state when this
        observation changes it, else None. O(window)."""
        if predicted < 0 or realized < 0:
            raise ValueError(f"token counts must be >= 0, got {predicted}, {realized}")
        settings = self.settings
        self.predicted_tokens += predicted
        self.shortfall_tokens += max(predicted - realized, 0)
        self.excess_tokens += max(realized - predicted, 0)
        short = predicted - realized > settings.tolerance_tokens
        if predicted > 0:
            self._recent.append(Observation(predicted, realized))
        if self.state == EXACT:
            if short and self._looks_blind():
                return self._become(SUSPECT, now)
            return None
        if short:
            self._held_in_a_row = 0
        elif predicted > 0 or realized == 0:
            self._held_in_a_row += 1
        assert self.suspect_since is not None, "suspect without a start time"
        if (self._held_in_a_row >= settings.recover_after
                and now - self.suspect_since >= settings.min_suspect_s):
            return self._become(EXACT, now)
        return None

    def wants_resync(self, now: float) -> bool:
        """True when a suspect index should be rebuilt now (the caller then calls
        :meth:`resync_requested`)."""
        if self.state != SUSPECT:
            return False
        last = self._last_resync
        return last is None or now - last >= self.settings.resync_every_s

    def resync_requested(self, now: float) -> None:
        self._last_resync = now

    def window_error(self) -> float:
        """Share of the recently predicted tokens the engine did not have (0 when none were
        predicted): the prediction error the metrics show. O(window)."""
        predicted = sum(o.predicted for o in self._recent)
        if not predicted:
            return 0.0
        return sum(max(o.predicted - o.realized, 0) for o in self._recent) / predicted

    def _looks_blind(self) -> bool:
        settings = self.settings
        shortfalls = sum(
            1 for o in self._recent if o.predicted - o.realized > settings.tolerance_tokens)
        return (shortfalls >= settings.min_shortfalls
                and self.window_error() > settings.suspect_ratio)

    def _become(self, state: str, now: float) -> str:
        self.state = state
        self.transitions += 1
        self._held_in_a_row = 0
        if state == SUSPECT:
            self.suspect_since = now
            self._last_resync = None
        else:
            self.suspect_since = None
            self._recent.clear()  # judge the trusted period on its own observations
        return state
