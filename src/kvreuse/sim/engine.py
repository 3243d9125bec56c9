"""The discrete-event engine: the one owner of simulated time and of the event heap.

Ordering rule. Events are popped in increasing ``(time, priority, seq)``:

* ``time`` — simulated seconds;
* ``priority`` — the event class's ``PRIORITY`` when two events share a time: a request that
  finishes (0) frees its memory and inserts its answer before a prefill that completes at the
  same instant (1) picks the next request, KV events due then (2) reach the router before the
  load snapshot (3) it routes with, and arrivals (4) come last, so a request arriving exactly
  when a turn finishes already sees that turn cached;
* ``seq`` — the order :meth:`Engine.schedule` was called, so equal ``(time, priority)`` events
  run first-scheduled first. Nothing else (no object ids, no hashes) can affect the order, which
  is what makes a seeded run repeat exactly.

Events are frozen dataclasses; handlers never touch the heap except through ``schedule``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from kvreuse.routing.events import KvEvent


@dataclass(frozen=True, slots=True)
class Finish:
    """A request's last output token: unpin its KV, insert prompt + output into the cache."""

    PRIORITY: ClassVar[int] = 0
    replica: int
    job: Any


@dataclass(frozen=True, slots=True)
class PrefillDone:
    """A replica finished prefilling ``job``: first token out, decode starts."""

    PRIORITY: ClassVar[int] = 1
    replica: int
    job: Any


@dataclass(frozen=True, slots=True)
class KvDelivery:
    """A replica's cache event reaches the router (after the configured lag)."""

    PRIORITY: ClassVar[int] = 2
    event: KvEvent


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The router's view of replica load is refreshed (lagged load view)."""

    PRIORITY: ClassVar[int] = 3


@dataclass(frozen=True, slots=True)
class Arrival:
    """Request number ``index`` of the workload reaches the router."""

    PRIORITY: ClassVar[int] = 4
    index: int


Event = Finish | PrefillDone | KvDelivery | LoadSnapshot | Arrival


class Engine:
    """Clock plus heap. ``run`` pops events in order and hands each to its handler."""

    __slots__ = ("_heap", "_seq", "now", "processed")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = 0
        self.now = 0.0
        self.processed = 0

    def schedule(self, time: float, event: Event) -> None:
        """Queue ``event`` at ``time`` (never in the past). O(log h)."""
        assert time >= self.now, f"event {event!r} scheduled at {time} before now {self.now}"
        self._seq += 1
        heapq.heappush(self._heap, (time, event.PRIORITY, self._seq, event))

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, handlers: dict[type, Callable[[Any], None]]) -> None:
        """Pop and dispatch until the heap is empty. A handler may schedule more events."""
        heap = self._heap
        pop = heapq.heappop
        while heap:
            time, _, _, event = pop(heap)
            self.now = time
            self.processed += 1
            handlers[type(event)](event)
