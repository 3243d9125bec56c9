"""The discrete-event loop: the one owner of simulated time and of the event heap.

Ordering rule. Events are popped in increasing ``(time, priority, seq)``:

* ``time`` — simulated seconds;
* ``priority`` — the event class's ``PRIORITY`` when two events share a time: a replica's
  speed change (-1) comes first, so a prefill started at its instant runs at the new speed; a
  request that finishes (0) frees its memory and inserts its answer before a prefill that
  completes at the same instant (1) picks the next request, KV events (2) and first tokens and
  response ends (3) due then reach the router before the load snapshot (4) it routes with, and
  arrivals (5) come last, so a request arriving exactly when a turn finishes already sees that
  turn cached;
* ``seq`` — the order :meth:`EventLoop.schedule` was called, so equal ``(time, priority)`` events
  run first-scheduled first. Nothing else (no object ids, no hashes) can affect the order, which
  is what makes a seeded run repeat exactly.

Events are frozen dataclasses (:mod:`kvreuse.sim.events`); handlers never touch the heap except
through ``schedule``.

Arrivals may also come as a stream: :meth:`EventLoop.run` takes the workload's sorted arrival
times and hands arrival ``i`` to its handler exactly where an :class:`Arrival` event scheduled
when arrival ``i - 1`` ran would pop (priority 5, which no other event class has). The order is
the same; the stream only saves an event object and a heap push and pop per request.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

from kvreuse.sim.events import (
    Arrival,
    Event,
    Finish,
    FirstByte,
    KvDelivery,
    LastByte,
    LoadSnapshot,
    PrefillDone,
    SpeedChange,
)

__all__ = [
    "Arrival", "Event", "EventLoop", "Finish", "FirstByte", "KvDelivery", "LastByte",
    "LoadSnapshot", "PrefillDone", "SpeedChange",
]


class EventLoop:
    """Clock plus heap. ``run`` pops events in order and hands each to its handler."""

    __slots__ = ("_arrivals", "_heap", "_next_arrival", "_seq", "now", "processed")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = 0
        self._arrivals: Sequence[float] = ()
        self._next_arrival = 0
        self.now = 0.0
        self.processed = 0

    def schedule(self, time: float, event: Event) -> None:
        """Queue ``event`` at ``time`` (never in the past). O(log h)."""
        assert time >= self.now, f"event {event!r} scheduled at {time} before now {self.now}"
        self._seq += 1
        heapq.heappush(self._heap, (time, event.PRIORITY, self._seq, event))

    def __len__(self) -> int:
        """Events still to run: the heap plus the arrivals not yet streamed."""
        return len(self._heap) + len(self._arrivals) - self._next_arrival

    def run(
        self,
        handlers: dict[type, Callable[[Any], None]],
        arrivals: Sequence[float] = (),
        on_arrival: Callable[[int], None] | None = None,
    ) -> None:
        """Pop and dispatch until the heap and the arrival stream are empty. A handler may
        schedule more events. ``arrivals`` (sorted) are streamed to ``on_arrival(i)`` as the
        module docstring says; an arrival runs before a heap event only if its ``(time, 4)`` is
        smaller than the event's ``(time, priority)``."""
        assert on_arrival is not None or not arrivals, "arrivals need an on_arrival handler"
        heap = self._heap
        pop = heapq.heappop
        self._arrivals, self._next_arrival = arrivals, 0
        count = len(arrivals)
        position = 0
        due = arrivals[0] if count else 0.0
        priority = Arrival.PRIORITY
        while True:
            if position < count and (
                not heap or due < heap[0][0] or (due == heap[0][0] and priority < heap[0][1])
            ):
                assert on_arrival is not None
                assert due >= self.now, f"arrival {position} at {due} before now {self.now}"
                self.now = due
                self.processed += 1
                position += 1
                self._next_arrival = position
                if position < count:
                    due = arrivals[position]
                on_arrival(position - 1)
                continue
            if not heap:
                break
            time, _, _, event = pop(heap)
            self.now = time
            self.processed += 1
            handlers[type(event)](event)
        self._arrivals, self._next_arrival = (), 0
