"""The simulator's events: frozen dataclasses, each with the ``PRIORITY`` that breaks ties at
equal times (the rule is in :mod:`kvreuse.sim.event_loop`).

They live apart from the event loop because the loop is part of the compiled core
(:mod:`kvreuse.native`) and these classes are not: they stay plain dataclasses (with
:func:`~kvreuse.frozen.fast_init`), which mypyc cannot build with class-level constants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kvreuse.frozen import fast_init
from kvreuse.routing.events import KvEvent


@fast_init
@dataclass(frozen=True, slots=True)
class SpeedChange:
    """``replica``'s prefill speed becomes ``speed`` (``FleetConfig.speed_changes``): first at
    its instant, so any prefill started then runs at the new speed."""

    PRIORITY: ClassVar[int] = -1
    replica: int
    speed: float


@fast_init
@dataclass(frozen=True, slots=True)
class Finish:
    """A request's last output token: unpin its KV, insert prompt + output into the cache."""

    PRIORITY: ClassVar[int] = 0
    replica: int
    job: Any


@fast_init
@dataclass(frozen=True, slots=True)
class PrefillDone:
    """A replica finished prefilling ``job``: first token out, decode starts."""

    PRIORITY: ClassVar[int] = 1
    replica: int
    job: Any


@fast_init
@dataclass(frozen=True, slots=True)
class KvDelivery:
    """A replica's cache event reaches the router (after the configured lag)."""

    PRIORITY: ClassVar[int] = 2
    event: KvEvent


@fast_init
@dataclass(frozen=True, slots=True)
class FirstByte:
    """A first token reaches the router, ``FleetConfig.first_byte_lag_s`` after ``replica``
    made it: the router stops counting the request's ``estimate`` of queued prefill tokens."""

    PRIORITY: ClassVar[int] = 3
    replica: int
    estimate: int


@fast_init
@dataclass(frozen=True, slots=True)
class LastByte:
    """A response's end reaches the router, ``FleetConfig.last_byte_lag_s`` after ``replica``
    finished ``job``: the router stops counting it in flight and tells the policy it finished.
    Shares :class:`FirstByte`'s priority (both are the router hearing back); equal times run in
    the order they were scheduled."""

    PRIORITY: ClassVar[int] = 3
    replica: int
    job: Any


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The router's view of replica load is refreshed (lagged load view)."""

    PRIORITY: ClassVar[int] = 4


@fast_init
@dataclass(frozen=True, slots=True)
class Arrival:
    """Request number ``index`` of the workload reaches the router."""

    PRIORITY: ClassVar[int] = 5
    index: int


Event = (SpeedChange | Finish | PrefillDone | KvDelivery | FirstByte | LastByte | LoadSnapshot
         | Arrival)
