"""Keeping CPython's cyclic collector out of bulk work where it can free nothing.

The collector runs every few hundred allocations, and each collection of its oldest generation
re-scans every tracked object of the process. Parsing a million-request trace, turning it into
simulator requests, and simulating it build millions of tracked objects (records, tuples,
views, tree nodes, jobs) that form no reference cycles until the work is over: reference
counting frees everything they drop, and the scans free nothing. Yet they are triggered ever
more often and cost ever more as the work goes on: for ``benchmarks/trace_speed.py``'s
``cache_aware`` run the collector took a quarter of the simulation at 200,000 requests and the
larger part of the gap to the target at a million (docs/performance.md).

:func:`collector_paused` turns the collector off for such a block and back on after (if it was
on). What a paused block may leave is cyclic garbage it made along the way: measured, a trace
simulation makes none until the simulator itself is dropped (15 objects of set-up, whatever the
length, for ``cache_aware``, ``round_robin`` and ``exact``), and whatever a run makes is bounded
by its length, like the records the run keeps anyway. Nothing computed changes, only when the
collector runs; another thread's garbage waits for the block's end too.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off for the block; back on at its end (errors included) if it was
    on at its start, so pauses nest."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
