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

from collections.abc import Sequence
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
    pooled = (units or TraceUnits()).units(replicas * cache_tokens)
    return Bounds(
        infinite_hit_rate=_replay_hit_rate(requests, RadixIndex()),
        pooled_lru_hit_rate=_replay_hit_rate(requests, RadixIndex(capacity_tokens=pooled)),
        replicas=replicas,
        cache_tokens=cache_tokens,
    )
