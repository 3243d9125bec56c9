"""The trace yardsticks for many fleets at once: one infinite replay, one per pooled size."""

from __future__ import annotations

from kvreuse.index import RadixIndex
from kvreuse.sim.requests import SimRequest
from kvreuse.sim.trace import Bounds, _replay_hit_rate, fleet_bounds
from kvreuse.sim.units import TraceUnits
from kvreuse.testing.mooncake import synthetic_mooncake
from kvreuse.trace import parse_trace_lines, trace_requests

FLEETS = [(1, 100_000), (2, 50_000), (4, 200_000), (1, 800_000), (3, 7_000)]


def requests_and_units() -> tuple[list[SimRequest], TraceUnits]:
    records = parse_trace_lines(synthetic_mooncake(requests=400, documents=30, skew=0.8))
    return trace_requests(records, 512, "block")


def test_shared_replays_give_each_fleet_its_own_replays_figures() -> None:
    """Every fleet's bounds equal those of replaying the trace through its own two caches."""
    requests, units = requests_and_units()
    expected = [
        Bounds(_replay_hit_rate(requests, RadixIndex()),
               _replay_hit_rate(requests, RadixIndex(capacity_tokens=units.units(n * cache))),
               n, cache)
        for n, cache in FLEETS
    ]
    got = fleet_bounds(requests, FLEETS, units)
    assert got == expected
    assert len({b.pooled_lru_hit_rate for b in got}) >= 3  # the sizes do differ in effect


def test_fleets_with_one_pooled_size_share_its_replay() -> None:
    """2 x 50k and 1 x 100k are one 100k cache, as 4 x 200k and 1 x 800k are one 800k cache:
    the infinite cache and three pooled sizes make four replays, each reported once."""
    requests, units = requests_and_units()
    replays: list[tuple[int, int]] = []
    fleet_bounds(requests, FLEETS, units, lambda done, total: replays.append((done, total)))
    assert replays == [(1, 4), (2, 4), (3, 4), (4, 4)]
