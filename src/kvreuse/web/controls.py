"""The lab's controls: one frozen value per run, parsed from JSON or a query string.

Every knob on the page is a field of :class:`LabControls`. Parsing is strict because the body comes
from a browser anyone can edit: an unknown field, a wrong type or an out-of-range value raises
:class:`~kvreuse.errors.InputFormatError` whose ``where`` is the field name, and the server turns
that into a 400 naming it. Ranges are bounded so one request cannot tie up the server for minutes
(the limits say what the lab is for, not what the simulator can do: use ``kvreuse simulate`` for
bigger runs).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from kvreuse import defaults
from kvreuse.errors import InputFormatError

BYTES_PER_TOKEN = 128 * 1024
"""Seed 001's illustrative KV size per token, used to show the cache size in GiB."""


@dataclass(frozen=True, slots=True)
class LabControls:
    """One lab run. ``cache_tokens`` is the KV pool per replica in tokens; ``cache_enabled=False``
    means no prefix reuse at all (the pool still holds running requests). ``spill_threshold_s`` is
    the predicted queue-delay gap above which a cache-aware router leaves the best-matching replica
    (ignored by policies without a spill rule). ``timestamp_at`` puts the current second into
    every system prompt at that token (seed 001's mission two), ``None`` for no timestamp.
    ``mission`` names a preset whose goal is checked.

    The defaults are the lab's opening view, read from :mod:`kvreuse.defaults` (the values
    ``kvreuse simulate`` uses): belgavi's support chat with its 1 GiB caches behind round robin
    on six replicas.
    """

    scenario: str = defaults.LAB_SCENARIO
    replicas: int = defaults.LAB_REPLICAS
    cache_enabled: bool = True
    cache_tokens: int = defaults.CACHE_TOKENS
    routing: str = defaults.LAB_ROUTING
    spill_threshold_s: float = defaults.SPILL_THRESHOLD_S
    scheduling: str = defaults.SCHEDULING
    arrival_rate: float = defaults.ARRIVAL_RATE
    duration_s: float = defaults.DURATION_S
    seed: int = defaults.SEED
    timestamp_at: int | None = None
    mission: str | None = None

    @property
    def cache_gib(self) -> float:
        """The per-replica pool in GiB at :data:`BYTES_PER_TOKEN`."""
        return self.cache_tokens * BYTES_PER_TOKEN / 2**30

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready field values (the same keys :func:`parse_controls` accepts)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class ControlChoices:
    """Names a field may take; the adapter fills these from the simulator's registries."""

    scenarios: tuple[str, ...]
    routing: tuple[str, ...]
    scheduling: tuple[str, ...]
    missions: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Limits:
    """Inclusive bounds of the numeric fields."""

    max_replicas: int = 16
    max_cache_tokens: int = 4_000_000
    max_arrival_rate: float = 200.0
    max_duration_s: float = 300.0
    max_spill_threshold_s: float = 60.0
    max_seed: int = 2**31 - 1
    max_timestamp_at: int = 1_000_000
    max_requests: int = 20_000
    """Requests one run may simulate (warm-up included): about 200 req/s for 80 s, a few
    seconds and a few hundred MB; ``kvreuse simulate`` is for bigger runs."""


LIMITS = Limits()


class RunCancelled(Exception):
    """A run stopped before its end because whoever asked for it is gone (the server sets the
    run's cancel event when the client disconnects)."""

    @classmethod
    def raise_if_set(cls, cancel: threading.Event | None) -> None:
        """Raise one when ``cancel`` is set (None: the run cannot be cancelled). O(1)."""
        if cancel is not None and cancel.is_set():
            raise cls("the run was cancelled")


def _int(name: str, value: Any, low: int, high: int) -> int:
    # bool is an int subclass in Python; `true` for a count is a caller mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputFormatError(f"must be a whole number, got {value!r}", where=name)
    if isinstance(value, float) and not value.is_integer():
        raise InputFormatError(f"must be a whole number, got {value!r}", where=name)
    number = int(value)
    if not low <= number <= high:
        raise InputFormatError(f"must be between {low} and {high}, got {number}", where=name)
    return number


def _float(name: str, value: Any, low: float, high: float, *, open_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputFormatError(f"must be a number, got {value!r}", where=name)
    number = float(value)
    too_low = number <= low if open_low else number < low
    if not math.isfinite(number) or too_low or number > high:
        bound = f"> {low}" if open_low else f">= {low}"
        raise InputFormatError(f"must be {bound} and <= {high}, got {value!r}", where=name)
    return number


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InputFormatError(f"must be true or false, got {value!r}", where=name)
    return value


def _choice(name: str, value: Any, allowed: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise InputFormatError(
            f"unknown value {value!r}; choose one of: {', '.join(allowed)}", where=name
        )
    return value


def parse_controls(
    body: Any, choices: ControlChoices, base: LabControls | None = None
) -> LabControls:
    """Validate a JSON object into :class:`LabControls`; absent fields keep ``base``'s values.

    Raises :class:`InputFormatError` (``where`` = the field) for a non-object body, an unknown
    field, a wrong type or an out-of-range value. O(fields).
    """
    if not isinstance(body, Mapping):
        raise InputFormatError(
            f"the body must be a JSON object of controls, got {type(body).__name__}", where="body"
        )
    start = base if base is not None else LabControls()
    known = {f.name for f in fields(LabControls)}
    unknown = sorted(str(k) for k in body if k not in known)
    if unknown:
        raise InputFormatError(
            f"unknown field; the controls are: {', '.join(sorted(known))}", where=unknown[0]
        )
    lim = LIMITS
    parsers: dict[str, Callable[[Any], Any]] = {
        "scenario": lambda v: _choice("scenario", v, choices.scenarios),
        "replicas": lambda v: _int("replicas", v, 1, lim.max_replicas),
        "cache_enabled": lambda v: _bool("cache_enabled", v),
        "cache_tokens": lambda v: _int("cache_tokens", v, 0, lim.max_cache_tokens),
        "routing": lambda v: _choice("routing", v, choices.routing),
        "spill_threshold_s": lambda v: _float(
            "spill_threshold_s", v, 0.0, lim.max_spill_threshold_s
        ),
        "scheduling": lambda v: _choice("scheduling", v, choices.scheduling),
        "arrival_rate": lambda v: _float(
            "arrival_rate", v, 0.0, lim.max_arrival_rate, open_low=True
        ),
        "duration_s": lambda v: _float("duration_s", v, 1.0, lim.max_duration_s),
        "seed": lambda v: _int("seed", v, 0, lim.max_seed),
        "timestamp_at": lambda v: (
            None if v is None else _int("timestamp_at", v, 0, lim.max_timestamp_at)
        ),
        "mission": lambda v: None if v is None else _choice("mission", v, choices.missions),
    }
    changes = {name: parsers[name](value) for name, value in body.items()}
    return replace(start, **changes)


def parse_query(
    query: Mapping[str, str], choices: ControlChoices, base: LabControls | None = None
) -> LabControls:
    """The same as :func:`parse_controls` for URL query strings (every value is text): numbers,
    ``true``/``false`` and ``none`` (for ``timestamp_at``) are converted first; unknown keys
    are rejected the same way."""
    typed: dict[str, Any] = {}
    numeric = {
        "replicas",
        "cache_tokens",
        "spill_threshold_s",
        "arrival_rate",
        "duration_s",
        "seed",
        "timestamp_at",
    }
    for key, text in query.items():
        if text.lower() in ("none", "null") and key in ("timestamp_at", "mission"):
            typed[key] = None
        elif key in numeric:
            try:
                typed[key] = int(text) if text.lstrip("-").isdigit() else float(text)
            except ValueError:
                raise InputFormatError(f"must be a number, got {text!r}", where=key) from None
        elif key == "cache_enabled":
            lowered = text.lower()
            if lowered not in ("true", "false", "1", "0"):
                raise InputFormatError(f"must be true or false, got {text!r}", where=key)
            typed[key] = lowered in ("true", "1")
        else:
            typed[key] = text
    return parse_controls(typed, choices, base)
