"""The two yardsticks every trace run reports.

Traces are parsed by :mod:`kvreuse.trace.format` and become requests in
:mod:`kvreuse.trace.workload`. ``infinite_hit_rate``: one cache that never forgets, seeing every
prompt in arrival order — a true ceiling: no routing and no eviction reuses a prefix that was
never computed before. ``pooled_lru_hit_rate``: one LRU radix cache of N × C tokens seeing all
traffic — a reference, not a ceiling: LRU is not the best eviction, and a router that keeps each
conversation on its own replica can beat the pooled figure (as :mod:`kvreuse.trace.stats` and
the README say); it also ignores the KV that running requests pin.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from kvreuse.index import RadixIndex
from kvreuse.sim.requests import SimRequest
from kvreuse.sim.units import TraceUnits


@dataclass(frozen=True, slots=True)
class Bounds:
    """Token hit rates to hold a routing over ``replicas`` × ``cache_tokens`` against: the
    infinite cache (a ceiling no routing exceeds) and the pooled LRU (a reference routers can
    beat); see the module docstring."""

    infinite_hit_rate: float
    pooled_lru_hit_rate: float
    replicas: int
    cache_tokens: int

    def as_dict(self) -> dict[str, float | int]:
        """The fields by name, in field order (``--json``'s ``bounds``)."""
        return asdict(self)


def _replay_hit_rate(requests: Sequence[SimRequest], cache: RadixIndex) -> float:
    cached = prompt = 0
    for request in requests:
        if not request.measured:
            cache.insert(request.tokens, request.identity, request.arrival_s)
            continue
        cached += cache.match(request.tokens, request.identity, request.arrival_s).length
        prompt += request.prompt_len
        full = request.tokens if request.output is None else request.tokens + request.output
        cache.insert(full, request.identity, request.arrival_s)
    return cached / prompt if prompt else 0.0


def compute_bounds(
    requests: Sequence[SimRequest],
    replicas: int,
    cache_tokens: int,
    units: TraceUnits | None = None,
) -> Bounds:
    """Both figures, replaying ``requests`` (counted in ``units``) in arrival order.
    ``cache_tokens`` is in tokens. O(total tokens, or units)."""
    return fleet_bounds(requests, [(replicas, cache_tokens)], units)[0]


def fleet_bounds(
    requests: Sequence[SimRequest],
    fleets: Sequence[tuple[int, int]],
    units: TraceUnits | None = None,
    on_replay: Callable[[int, int], None] | None = None,
) -> list[Bounds]:
    """:class:`Bounds` for each ``(replicas, cache_tokens)`` of ``fleets``, in order. The
    infinite cache is replayed once, and the pooled LRU once per distinct pooled size (4 × 100k
    and 2 × 200k are one cache): ``kvreuse trace stats``' twelve fleets take 7 replays, not
    24. ``on_replay(done, total)`` follows each replay. O(total tokens, or units, × replays)."""
    units = units or TraceUnits()
    pooled_units = [units.units(replicas * cache) for replicas, cache in fleets]
    distinct = sorted(set(pooled_units))
    total = 1 + len(distinct)
    infinite = _replay_hit_rate(requests, RadixIndex())
    if on_replay is not None:
        on_replay(1, total)
    pooled: dict[int, float] = {}
    for done, size in enumerate(distinct, start=2):
        pooled[size] = _replay_hit_rate(requests, RadixIndex(capacity_tokens=size))
        if on_replay is not None:
            on_replay(done, total)
    return [Bounds(infinite_hit_rate=infinite, pooled_lru_hit_rate=pooled[size],
                   replicas=replicas, cache_tokens=cache)
            for (replicas, cache), size in zip(fleets, pooled_units, strict=True)]
