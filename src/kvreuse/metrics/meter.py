"""Reuse metrics, each with its denominator stated.

Seed 004: "Report two ratios with explicit denominators: cached tokens divided by all prompt tokens
for population-wide hit rate, and cached tokens divided by eligible shared-prefix tokens for reuse
effectiveness. Do not label either as merely hit rate, and do not use requests with any hit as the
denominator." We add the request hit rate only because dashboards show it, and we say it flatters:
a request that reuses 16 tokens of a 20,000-token prompt counts as a hit (seed 000).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from kvreuse.errors import ConfigError

DEFAULT_BANDS: tuple[int, ...] = (512, 2048, 8192, 32768)
"""Upper bounds (exclusive) of prompt-length bands; a last band is open-ended."""

ALL = "all"


@dataclass(frozen=True, slots=True)
class RequestObservation:
    """One request's prompt accounting.

    ``eligible_tokens`` are the prompt tokens that *could* have been served from cache (the part
    shared with earlier traffic under the same identity); ``cached_tokens`` is what was.
    """

    prompt_tokens: int
    cached_tokens: int
    eligible_tokens: int | None = None
    namespace: str = ""

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.cached_tokens < 0:
            raise ConfigError("prompt_tokens and cached_tokens must be >= 0")
        if self.cached_tokens > self.prompt_tokens:
            raise ConfigError(
                f"cached_tokens ({self.cached_tokens}) cannot exceed prompt_tokens "
                f"({self.prompt_tokens})"
            )
        if self.eligible_tokens is not None and not (
            self.cached_tokens <= self.eligible_tokens <= self.prompt_tokens
        ):
            raise ConfigError(
                "eligible_tokens must lie between cached_tokens and prompt_tokens, got "
                f"{self.eligible_tokens} (cached {self.cached_tokens}, prompt {self.prompt_tokens})"
            )


@dataclass(frozen=True, slots=True)
class ReuseSummary:
    """Totals for one population (a band, a namespace, or everything) and the three ratios."""

    label: str
    requests: int
    requests_with_hit: int
    prompt_tokens: int
    cached_tokens: int
    eligible_tokens: int

    @property
    def token_hit_rate(self) -> float:
        """Cached prompt tokens / all prompt tokens (the number to watch)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def reuse_effectiveness(self) -> float:
        """Cached prompt tokens / eligible shared-prefix tokens."""
        return self.cached_tokens / self.eligible_tokens if self.eligible_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        """Requests with any cached token / requests. Flattering: a 16-token hit counts."""
        return self.requests_with_hit / self.requests if self.requests else 0.0

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens that had to be computed."""
        return self.prompt_tokens - self.cached_tokens

    def as_dict(self) -> dict[str, float | int | str]:
        """Plain dict for JSON output: the fields (denominators included), then the ratios."""
        return {
            **asdict(self),
            "token_hit_rate": self.token_hit_rate,
            "reuse_effectiveness": self.reuse_effectiveness,
            "request_hit_rate": self.request_hit_rate,
        }


@dataclass(slots=True)
class _Totals:
    requests: int = 0
    requests_with_hit: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    eligible_tokens: int = 0

    def add(self, obs: RequestObservation) -> None:
        self.requests += 1
        self.requests_with_hit += obs.cached_tokens > 0
        self.prompt_tokens += obs.prompt_tokens
        self.cached_tokens += obs.cached_tokens
        self.eligible_tokens += (
            obs.prompt_tokens if obs.eligible_tokens is None else obs.eligible_tokens
        )

    def summary(self, label: str) -> ReuseSummary:
        return ReuseSummary(
            label,
            self.requests,
            self.requests_with_hit,
            self.prompt_tokens,
            self.cached_tokens,
            self.eligible_tokens,
        )


def band_label(prompt_tokens: int, bands: Sequence[int] = DEFAULT_BANDS) -> str:
    """Name of the prompt-length band holding ``prompt_tokens``, e.g. ``"512-2047"``."""
    lower = 0
    for upper in bands:
        if prompt_tokens < upper:
            return f"{lower}-{upper - 1}"
        lower = upper
    return f"{lower}+"


@dataclass(slots=True)
class ReuseMeter:
    """Accumulates :class:`RequestObservation` s; reports overall, per band and per namespace.

    When an observation carries no ``eligible_tokens``, every prompt token counts as eligible,
    so effectiveness then equals the token hit rate (stated, not hidden).
    """

    bands: tuple[int, ...] = DEFAULT_BANDS
    _overall: _Totals = field(default_factory=_Totals)
    _by_band: dict[str, _Totals] = field(default_factory=dict)
    _by_namespace: dict[str, _Totals] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if list(self.bands) != sorted(set(self.bands)) or any(b <= 0 for b in self.bands):
            raise ConfigError(f"bands must be increasing positive token counts, got {self.bands}")

    def observe(self, obs: RequestObservation) -> None:
        """Add one request. O(len(bands))."""
        self._overall.add(obs)
        self._by_band.setdefault(band_label(obs.prompt_tokens, self.bands), _Totals()).add(obs)
        self._by_namespace.setdefault(obs.namespace, _Totals()).add(obs)

    def observe_all(self, observations: Iterable[RequestObservation]) -> None:
        for obs in observations:
            self.observe(obs)

    def overall(self) -> ReuseSummary:
        return self._overall.summary(ALL)

    def by_band(self) -> list[ReuseSummary]:
        """One summary per band that saw traffic, shortest prompts first."""
        order = [band_label(0, self.bands)]
        order += [band_label(b, self.bands) for b in self.bands]
        return [self._by_band[b].summary(b) for b in order if b in self._by_band]

    def by_namespace(self) -> list[ReuseSummary]:
        return [self._by_namespace[ns].summary(ns) for ns in sorted(self._by_namespace)]
