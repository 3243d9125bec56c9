"""The event loop's ordering rule and a replica's memory, scheduling and cache behaviour."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from kvreuse.errors import ConfigError
from kvreuse.index import RadixIndex
from kvreuse.routing import CacheMirror, KvEvent, KvRemoved, RequestView, build_policy
from kvreuse.sim import (
    Arrival,
    EventLoop,
    Finish,
    FleetConfig,
    FleetSimulator,
    LoadSnapshot,
    PrefillDone,
    ReplicaConfig,
    SimRequest,
)
from kvreuse.sim.memory import RadixMemory
from kvreuse.sim.runner import run_scenario
from kvreuse.sim.scenarios import get_scenario
from kvreuse.tokens import TOKEN_BYTES, TokenBuffer, pack


def make_request(i: int, t: float, tokens: list[int], out: int = 10) -> SimRequest:
    return SimRequest(i, t, pack(tokens), len(tokens), out)


def test_event_loop_orders_by_time_then_priority_then_seq() -> None:
    """Simultaneous events run finish < prefill < snapshot < arrival, then in schedule order."""
    loop = EventLoop()
    seen: list[Any] = []
    loop.schedule(1.0, Arrival(1))
    loop.schedule(1.0, Arrival(2))
    loop.schedule(1.0, LoadSnapshot())
    loop.schedule(1.0, PrefillDone(0, "p"))
    loop.schedule(1.0, Finish(0, "f"))
    loop.schedule(0.5, Arrival(0))
    handlers = {t: seen.append for t in (Arrival, LoadSnapshot, PrefillDone, Finish)}
    loop.run(handlers)
    assert seen == [
        Arrival(0), Finish(0, "f"), PrefillDone(0, "p"), LoadSnapshot(), Arrival(1), Arrival(2)
    ]


def test_streamed_arrivals_pop_where_scheduled_arrivals_would() -> None:
    """Streamed arrivals interleave with heap events exactly as Arrival events would."""

    def replay(streamed: bool) -> list[Any]:
        loop = EventLoop()
        seen: list[Any] = []
        times = [0.5, 1.0, 1.0, 2.0]

        def arrive(index: int) -> None:
            seen.append(("arrival", index, loop.now, len(loop)))
            if index == 0:
                loop.schedule(1.0, PrefillDone(0, "p"))
                loop.schedule(2.0, Finish(0, "f"))
            if not streamed and index + 1 < len(times):
                loop.schedule(times[index + 1], Arrival(index + 1))

        handlers: dict[type, Any] = {
            PrefillDone: lambda e: seen.append(("prefill", loop.now)),
            Finish: lambda e: seen.append(("finish", loop.now)),
            Arrival: lambda e: arrive(e.index),
        }
        if streamed:
            loop.run(handlers, times, arrive)
        else:
            loop.schedule(times[0], Arrival(0))
            loop.run(handlers)
        return seen

    streamed = replay(True)
    assert [e[:3] for e in streamed] == [e[:3] for e in replay(False)]
    assert [e[0] for e in streamed] == [
        "arrival", "prefill", "arrival", "arrival", "finish", "arrival"
    ]
    assert streamed[0][3] == 3  # pending work counts the arrivals not yet streamed


def test_event_loop_refuses_the_past() -> None:
    """Scheduling before the current time is a broken invariant."""
    loop = EventLoop()
    loop.now = 2.0
    with pytest.raises(AssertionError):
        loop.schedule(1.0, Arrival(0))


def test_six_turn_table_totals() -> None:
    """Seed 001's table: 15,900 prefill tokens without cache, 2,400 with answers inserted."""
    scenario = get_scenario("six-turn")
    runs = run_scenario(scenario, specs=[s for s in scenario.runs if s.variant != "block"])
    prefilled = [r.summary.prompt_tokens - r.summary.cached_tokens for r in runs]
    assert prefilled == [15_900, 2_400]


def test_requests_wait_rather_than_fail_when_pins_fill_the_pool() -> None:
    """With long decodes pinning the pool, later requests queue (blocked) and all finish."""
    config = FleetConfig(1, ReplicaConfig(pool_tokens=1000, time_per_output_token_s=0.1))
    requests = [make_request(i, 0.01 * i, list(range(i * 1000, i * 1000 + 400)), 50)
                for i in range(6)]
    run = FleetSimulator(config, build_policy("round_robin")).run(requests)
    assert len(run.records) == 6 and run.blocked_admissions[0] > 0
    # Only two 450-token requests fit at once, so the last one waits for two decode rounds.
    assert max(r.ttft_s for r in run.records) > 2 * 50 * 0.1


def test_request_larger_than_the_pool_is_a_config_error() -> None:
    """A request that could never fit names the fix."""
    config = FleetConfig(1, ReplicaConfig(pool_tokens=100))
    with pytest.raises(ConfigError, match="raise the cache size"):
        FleetSimulator(config, build_policy("round_robin")).run(
            [make_request(0, 0.0, list(range(200)))]
        )


def test_eviction_makes_room_before_waiting() -> None:
    """A full cache of idle prefixes is evicted for a new request, which then runs at once."""
    config = FleetConfig(1, ReplicaConfig(pool_tokens=1000, time_per_output_token_s=0.0))
    requests = [make_request(i, float(i), list(range(i * 1000, i * 1000 + 600)), 0)
                for i in range(3)]
    run = FleetSimulator(config, build_policy("round_robin")).run(requests)
    assert run.evicted_tokens[0] >= 600 and run.blocked_admissions[0] == 0


def test_concurrent_requests_hit_a_prefix_inserted_at_prefill_end() -> None:
    """A second question on a document hits it while the first is still decoding."""
    config = FleetConfig(1, ReplicaConfig(pool_tokens=10_000, time_per_output_token_s=1.0))
    doc = list(range(3000))
    requests = [make_request(0, 0.0, [*doc, 1], 100), make_request(1, 1.0, [*doc, 2], 100)]
    run = FleetSimulator(config, build_policy("round_robin")).run(requests)
    assert run.records[1].cached_tokens == 3000


def test_lpm_serves_the_longest_cached_prefix_first() -> None:
    """Under lpm a waiting request with a cached prefix overtakes an earlier cold one."""
    warm = list(range(2000))
    requests = [
        make_request(0, 0.0, warm, 0),
        make_request(1, 0.5, list(range(50_000, 52_000)), 0),  # busy prefill queue
        make_request(2, 0.51, list(range(60_000, 62_000)), 0),  # cold, arrives first
        make_request(3, 0.52, [*warm, 7], 0),  # warm, arrives later
    ]
    order = {}
    for scheduling in ("fcfs", "lpm"):
        config = FleetConfig(1, ReplicaConfig(pool_tokens=100_000, scheduling=scheduling))
        run = FleetSimulator(config, build_policy("round_robin")).run(requests)
        order[scheduling] = run.records[3].ttft_s < run.records[2].ttft_s
    assert order == {"fcfs": False, "lpm": True}


def test_pool_accounting_holds_under_a_seeded_random_workload() -> None:
    """Seeded stress: pinned + cached never exceeds the pool and the radix invariants hold."""
    rng = random.Random(3)
    prefixes = [list(range(k * 10_000, k * 10_000 + rng.randint(50, 800))) for k in range(8)]
    requests = []
    t = 0.0
    for i in range(300):
        t += rng.expovariate(20.0)
        tokens = rng.choice(prefixes) + [rng.randrange(10**6) for _ in range(rng.randint(1, 300))]
        requests.append(make_request(i, t, tokens, rng.randint(0, 200)))
    config = FleetConfig(3, ReplicaConfig(pool_tokens=4000, time_per_output_token_s=0.005))
    sim = FleetSimulator(config, build_policy("cache_aware"), check_each_event=True)
    run = sim.run(requests)
    assert len(run.records) == 300
    for replica in sim.replicas:
        assert replica.private_tokens == 0 and replica.in_flight == 0


def test_checking_each_event_stops_a_run_at_broken_accounting() -> None:
    """With ``check_each_event`` a replica whose pool accounting is broken fails the run."""
    requests = [make_request(i, i * 0.01, list(range(100)), 5) for i in range(4)]
    config = FleetConfig(2, ReplicaConfig(pool_tokens=4000))
    sim = FleetSimulator(config, build_policy("round_robin"), check_each_event=True)
    sim.replicas[1].memory.private = -1  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="negative private KV"):
        sim.run(requests)


def radix_publisher(sink: Callable[[KvEvent], None]) -> RadixIndex:
    """The replica's own radix cache, publishing into ``sink`` as a replica does."""
    return RadixMemory("r0", ReplicaConfig(pool_tokens=1 << 20), sink).cache


def test_evicting_radix_reports_every_removal() -> None:
    """Each evicted leaf becomes a KvRemoved event whose path ends where the cut is."""
    events: list[KvEvent] = []
    index = radix_publisher(events.append)
    index.insert(pack(list(range(100))))
    index.insert(pack([*range(60), *range(1000, 1040)]))
    freed = index.evict(1000)
    assert freed == 140
    removed = [e for e in events if isinstance(e, KvRemoved)]
    assert sum(len(e.tokens) // TOKEN_BYTES - e.keep_tokens for e in removed) == 140
    assert {e.keep_tokens for e in removed} >= {60, 0}
    paths = {bytes(e.tokens) for e in removed}
    assert paths >= {pack(list(range(100))), pack([*range(60), *range(1000, 1040)])}


def test_mirror_tracks_the_true_cache_through_events() -> None:
    """Differential: the event-fed mirror predicts the radix match rounded down to blocks."""
    rng = random.Random(11)
    mirror = CacheMirror(block_size=8)
    index = radix_publisher(mirror.apply)
    stems = [list(range(k * 1000, k * 1000 + 64)) for k in range(5)]
    for step in range(400):
        tokens = rng.choice(stems) + [rng.randrange(10**6) for _ in range(rng.randint(0, 90))]
        buf = pack(tokens)
        if rng.random() < 0.5:
            index.insert(buf)
            mirror.apply(_stored(buf))
        else:
            index.evict(rng.randint(1, 200))
        probe = pack(rng.choice(stems) + [rng.randrange(10**6) for _ in range(5)])
        true = index.match(probe).length
        predicted = mirror.predict(RequestView("p", probe, len(probe) // 4), ["r0"], 0.0)["r0"]
        assert predicted == true - true % 8, f"step {step}"
    mirror.check_invariants()


def _stored(buf: TokenBuffer) -> KvEvent:
    from kvreuse.routing import KvStored

    return KvStored("r0", buf)


class QueueWatcher:
    """cache_aware that notes the single replica's queued prefill tokens at each arrival."""

    name = "queue_watcher"

    def __init__(self) -> None:
        self.inner = build_policy("cache_aware")
        self.uses_kv_events = False
        self.queued: list[int] = []

    def route(self, request: RequestView, fleet: Any) -> Any:
        self.queued.append(fleet.replicas[0].queued_prefill_tokens)
        return self.inner.route(request, fleet)

    def __getattr__(self, name: str) -> Any:  # on_routed, on_finished, on_kv_event
        return getattr(self.inner, name)


@pytest.mark.parametrize(("load_view", "seen"), [("replica", 2001), ("router", 1001)])
def test_the_load_view_counts_what_the_replica_or_the_router_knows(load_view: str,
                                                                   seen: int) -> None:
    """A follow-up queued behind its document's first prefill counts in full on the replica
    (not cached yet) but as the router's predicted remainder (1 token) in the router view."""
    replica = ReplicaConfig(pool_tokens=100_000, prefill_tokens_per_s=1000.0, overhead_s=0.0)
    config = FleetConfig(1, replica, load_view=load_view)
    doc = list(range(1000))
    requests = [make_request(0, 0.0, doc, 1), make_request(1, 0.5, [*doc, 1], 1),
                make_request(2, 0.6, list(range(5000, 5010)), 1)]
    watcher = QueueWatcher()
    run = FleetSimulator(config, watcher).run(requests)  # type: ignore[arg-type]
    assert watcher.queued == [0, 1000, seen]
    assert run.records[1].cached_tokens == 1000  # the replica's truth is the same either way


@pytest.mark.parametrize(("lag", "seen"), [(0.0, [0, 0, 0]), (0.005, [0, 1000, 0])])
def test_the_router_hears_of_a_first_token_after_the_first_byte_lag(
    lag: float, seen: list[int]
) -> None:
    """A request arriving 2 ms after its predecessor's prefill ended still sees that prefill
    queued when first bytes take 5 ms to come back, and nothing once they have."""
    replica = ReplicaConfig(pool_tokens=100_000, prefill_tokens_per_s=1000.0, overhead_s=0.0)
    config = FleetConfig(1, replica, load_view="router", first_byte_lag_s=lag)
    requests = [make_request(0, 0.0, list(range(1000)), 1),
                make_request(1, 1.002, list(range(5000, 5010)), 1),
                make_request(2, 1.5, list(range(6000, 6010)), 1)]
    watcher = QueueWatcher()
    run = FleetSimulator(config, watcher).run(requests)  # type: ignore[arg-type]
    assert watcher.queued == seen
    assert [r.ttft_s for r in run.records] == pytest.approx([1.0, 0.01, 0.01])


class InFlightWatcher(QueueWatcher):
    """QueueWatcher noting requests in flight at each arrival and when on_finished comes."""

    def __init__(self) -> None:
        super().__init__()
        self.finished_at: list[float] = []

    def route(self, request: RequestView, fleet: Any) -> Any:
        self.queued.append(fleet.replicas[0].in_flight)
        return self.inner.route(request, fleet)

    def on_finished(self, request: RequestView, replica: str, now: float) -> None:
        self.finished_at.append(now)
        self.inner.on_finished(request, replica, now)


@pytest.mark.parametrize(("lag", "seen"), [(0.0, [0, 0, 0]), (0.008, [0, 1, 0])])
def test_the_router_counts_a_request_in_flight_until_its_last_byte_lag(
    lag: float, seen: list[int]
) -> None:
    """A request arriving 3 ms after its predecessor's last token still sees it in flight when
    response ends take 8 ms to come back, and the policy hears of the finish then; the
    replica's own timing is the same either way."""
    replica = ReplicaConfig(pool_tokens=100_000, prefill_tokens_per_s=1000.0, overhead_s=0.0,
                            time_per_output_token_s=0.01)
    config = FleetConfig(1, replica, load_view="router", last_byte_lag_s=lag)
    # Request 0: 100 ms prefill, 2 output tokens (20 ms): finishes at 0.12 s.
    requests = [make_request(0, 0.0, list(range(100)), 2),
                make_request(1, 0.123, list(range(5000, 5010)), 2),
                make_request(2, 0.5, list(range(6000, 6010)), 2)]
    watcher = InFlightWatcher()
    run = FleetSimulator(config, watcher).run(requests)  # type: ignore[arg-type]
    assert watcher.queued == seen
    assert watcher.finished_at[0] == pytest.approx(0.12 + lag)
    assert [r.e2e_s for r in run.records] == pytest.approx([0.12, 0.03, 0.03])


def test_a_first_byte_lag_needs_the_router_view() -> None:
    """The engine-side view has no first bytes to wait for; a negative, NaN or infinite lag
    (which would corrupt the event heap's order) is refused too."""
    with pytest.raises(ConfigError, match="load_view='router'"):
        FleetConfig(1, first_byte_lag_s=0.002)
    with pytest.raises(ConfigError, match="last_byte_lag_s delays what a router counts"):
        FleetConfig(1, last_byte_lag_s=0.008)
    for lag in (-0.001, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="first_byte_lag_s must be a finite number"):
            FleetConfig(1, load_view="router", first_byte_lag_s=lag)
        with pytest.raises(ConfigError, match="load_lag_s must be a finite number"):
            FleetConfig(1, load_lag_s=lag)
        with pytest.raises(ConfigError, match="last_byte_lag_s must be a finite number"):
            FleetConfig(1, load_view="router", last_byte_lag_s=lag)


def test_an_unknown_load_view_is_a_config_error() -> None:
    """The error names the choices."""
    with pytest.raises(ConfigError, match="load_view must be one of"):
        FleetConfig(1, load_view="gateway")


class CapacityWatcher:
    """Records the KV capacity each routed request's candidates reported."""

    def __init__(self) -> None:
        self.inner = build_policy("round_robin")
        self.capacities: list[int | None] = []

    def route(self, request: RequestView, fleet: Any) -> Any:
        self.capacities.extend(load.kv_capacity_tokens for load in fleet.replicas)
        return self.inner.route(request, fleet)

    def __getattr__(self, name: str) -> Any:  # on_routed, on_finished, on_kv_event
        return getattr(self.inner, name)


def test_replicas_report_their_pool_as_kv_capacity() -> None:
    """Every replica's load view carries its pool size, as a gateway's carries the engine's."""
    replica = ReplicaConfig(pool_tokens=12_345, prefill_tokens_per_s=1000.0, overhead_s=0.0)
    watcher = CapacityWatcher()
    FleetSimulator(FleetConfig(2, replica), watcher).run(  # type: ignore[arg-type]
        [make_request(0, 0.0, list(range(10)), 1)])
    assert watcher.capacities == [12_345, 12_345]
