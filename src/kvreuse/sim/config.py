"""What a simulated fleet is given: each replica's constants, the fleet's size and delays, and
the replica memory models by name.

Plain (interpreted) frozen dataclasses, apart from the compiled simulator modules
(:mod:`kvreuse.native`) that use them: configurations are what users build, copy, pickle and
``dataclasses.replace``, which mypyc's compiled frozen dataclasses do not all allow.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvreuse.errors import ConfigError, require_at_least
from kvreuse.sim.block_memory import BlockMemory
from kvreuse.sim.memory import KvSink, RadixMemory, ReplicaMemory

SCHEDULERS = ("fcfs", "lpm")
LOAD_VIEWS = ("replica", "router")
SPEED_VIEWS = ("measured", "known", "alike")
PREFILL_SPEED_BOUNDS = (1e-3, 1e3)
"""The speeds a replica may have relative to the configured rate. Hardware differs by tens, not
thousands; past these, a speed is a slip of the keyboard (``1e-320`` made every time infinite
and the summary NaN)."""

MAX_REPLICAS = 100_000
"""The largest fleet a simulation builds. Each replica holds its own queue and cache, and most
policies look at every replica per request: 100,000 round-robin replicas take 12 s and 220 MB
on belgavi, while 100 million (a slip of the keyboard) took 2.7 GB in 30 s without simulating
a request."""

MemoryFactory = Callable[[str, "ReplicaConfig", KvSink | None], ReplicaMemory]

CACHE_KINDS: dict[str, MemoryFactory] = {"radix": RadixMemory, "block": BlockMemory}
"""Replica memory models by name (``--cache-kind``); see :mod:`kvreuse.sim.memory`."""


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """A replica's constants. Defaults are seed 001's illustrative numbers.

    ``cache_kind`` names a memory model in :data:`CACHE_KINDS`; ``page_size``
    and ``eviction`` configure the radix tree, ``block_size`` the block pool (vLLM's 16)."""

    pool_tokens: int = 8192
    prefill_tokens_per_s: float = 10_000.0
    overhead_s: float = 0.015
    time_per_output_token_s: float = 0.02
    scheduling: str = "fcfs"
    lpm_max_waiting: int = 128
    page_size: int = 1
    eviction: str = "lru"
    prefix_caching: bool = True
    cache_kind: str = "radix"
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.pool_tokens <= 0:
            raise ConfigError(f"pool_tokens (cache tokens) must be > 0, got {self.pool_tokens}")
        if self.prefill_tokens_per_s <= 0:
            raise ConfigError(f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}")
        if self.overhead_s < 0 or self.time_per_output_token_s < 0:
            raise ConfigError("overhead_s and time_per_output_token_s must be >= 0")
        if self.scheduling not in SCHEDULERS:
            raise ConfigError(f"scheduling must be one of {SCHEDULERS}, got {self.scheduling!r}")
        if self.cache_kind not in CACHE_KINDS:
            raise ConfigError(
                f"cache_kind must be one of {tuple(CACHE_KINDS)}, got {self.cache_kind!r}"
            )
        require_at_least("block_size", self.block_size, 1)


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """How many replicas, each configured alike, and the router's information delays.

    ``models``: per replica, the model names it serves (a request, by its identity's
    ``model``, may only go to a replica serving it: the router sees just those); ``None``:
    every replica serves every model.

    ``load_view``: whose count of queued prefill tokens the router sees. ``"replica"``: each
    waiting request's uncached prompt as the replica's cache stood at its arrival, corrected
    when it is picked (what an engine-side scheduler knows). ``"router"``: the prompt less the
    policy's predicted cached prefix, from routing until the first token, never corrected;
    what ``kvreuse route`` counts, as it only sees what it sent and the first byte back (a
    cache-blind policy predicts nothing cached, so it counts whole prompts).

    ``first_byte_lag_s`` (``load_view="router"`` only): how long after a replica's first token
    the router hears of it, the response's way back (an HTTP hop and the router's event loop),
    so a request counts as queued that much longer. Zero is a router that learns at the very
    instant; a real one cannot, and on ties between equally loaded replicas the instant
    matters: ``benchmarks/sim_vs_gateway.py`` predicts ``cost`` on belgavi at 80.8 % hit rate
    with 0 and 83.1 % (the gateway measured 83.0–83.1 % in five runs) with lags of 1, 2, 3 or
    5 ms (docs/performance.md).

    ``last_byte_lag_s`` (``load_view="router"`` only): how long after a replica's last token
    the router hears the response end, so a request counts in flight that much longer and the
    policy's ``on_finished`` comes that much later (what a router balancing on requests in
    flight sees). Measured through ``kvreuse route`` on ``kvreuse engine`` replicas, one host:
    the gateway's own total time per request exceeds the simulator's on the same placements by
    a median of 8–12 ms (``benchmarks/sim_vs_gateway.py``, docs/performance.md).

    ``prefill_speeds``: per replica, its prefill rate as a multiple of
    ``replica.prefill_tokens_per_s`` (a fleet of mixed hardware, or one replica degraded);
    ``None``: every replica at 1. The per-request overhead is the same on all. ``speed_view``
    (with ``prefill_speeds`` only) is what the router knows of them, as a gateway's
    ``ReplicaLoad.prefill_speed``, its loads divided by it: ``"measured"`` learns them from
    each first token as ``kvreuse route`` does (:class:`~kvreuse.routing.RelativeSpeeds` and
    a fit of the fleet's speed, fed as the router hears each token; :mod:`kvreuse.sim.fleet`),
    ``"known"`` is handed the true ones (upstreams configured with ``weight=``), ``"alike"``
    sees every replica at 1 (``kvreuse route --fixed-prefill``).

    ``speed_changes``: ``(at_s, replica, speed)`` triples, a replica's prefill speed changing
    mid-run (a GPU throttled, a noisy neighbour arriving or leaving): from ``at_s`` on, every
    prefill that replica starts runs at ``speed`` (a multiple of the rate, as
    ``prefill_speeds``; the one in progress keeps its own). The fleet starts at
    ``prefill_speeds``, all 1 when not given, and ``speed_view`` applies as for them: a known
    view follows each change at once, a measured one from first tokens. Changes after the
    last arrival are not run: the traffic is over, and its backlog drains at the speeds then.
    Equal times run in the order given."""

    replicas: int = 3
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)
    load_lag_s: float = 0.0
    kv_event_lag_s: float | None = None
    models: tuple[tuple[str, ...], ...] | None = None
    load_view: str = "replica"
    first_byte_lag_s: float = 0.0
    last_byte_lag_s: float = 0.0
    prefill_speeds: tuple[float, ...] | None = None
    speed_view: str = "measured"
    speed_changes: tuple[tuple[float, int, float], ...] = ()

    def __post_init__(self) -> None:
        require_at_least("replicas", self.replicas, 1)
        if self.replicas > MAX_REPLICAS:
            raise ConfigError(f"replicas must be at most {MAX_REPLICAS:,}, got {self.replicas:,}")
        if self.models is not None:
            if len(self.models) != self.replicas:
                raise ConfigError(f"models lists {len(self.models)} replicas' models for "
                                  f"{self.replicas} replicas; give one tuple per replica")
            if not all(self.models):
                raise ConfigError("every replica must serve at least one model")
        for name in ("load_lag_s", "first_byte_lag_s", "last_byte_lag_s"):
            lag = getattr(self, name)
            if not (math.isfinite(lag) and lag >= 0):
                raise ConfigError(f"{name} must be a finite number of seconds >= 0, got {lag}")
        for name in ("first_byte_lag_s", "last_byte_lag_s"):
            if getattr(self, name) and self.load_view != "router":
                raise ConfigError(f"{name} delays what a router counts itself: it needs "
                                  "load_view='router' (--load-view router)")
        if self.load_view not in LOAD_VIEWS:
            raise ConfigError(f"load_view must be one of {LOAD_VIEWS}, got {self.load_view!r}")
        if self.speed_view not in SPEED_VIEWS:
            raise ConfigError(f"speed_view must be one of {SPEED_VIEWS}, got {self.speed_view!r}")
        if self.prefill_speeds is not None:
            if len(self.prefill_speeds) != self.replicas:
                raise ConfigError(f"prefill_speeds lists {len(self.prefill_speeds)} speeds for "
                                  f"{self.replicas} replicas; give one per replica")
            check_prefill_speeds(self.prefill_speeds)
        for change in self.speed_changes:
            if not (isinstance(change, tuple) and len(change) == 3):
                raise ConfigError(f"each speed change must be (at_s, replica, speed), got "
                                  f"{change!r}")
            at_s, replica, speed = change
            if not (isinstance(at_s, int | float) and math.isfinite(at_s) and at_s >= 0):
                raise ConfigError(f"a speed change's time must be a finite number of seconds "
                                  f">= 0, got {at_s!r}")
            if not (isinstance(replica, int) and 0 <= replica < self.replicas):
                raise ConfigError(f"a speed change names replica {replica!r}: give an index "
                                  f"from 0 to {self.replicas - 1}")
            check_prefill_speeds((speed,), "a speed change's speed")
        if self.kv_event_lag_s is not None and self.kv_event_lag_s < 0:
            raise ConfigError(f"kv_event_lag_s must be >= 0 or None, got {self.kv_event_lag_s}")


    def initial_speeds(self) -> tuple[float, ...] | None:
        """Each replica's speed at the start: ``prefill_speeds``, all 1 when only
        ``speed_changes`` are given, ``None`` (a fleet without speeds, as before they existed)
        when neither is. O(replicas)."""
        if self.prefill_speeds is not None:
            return self.prefill_speeds
        return (1.0,) * self.replicas if self.speed_changes else None


def speeds_for(given: tuple[float, ...] | None, replicas: int) -> tuple[float, ...] | None:
    """``FleetConfig.prefill_speeds`` for a fleet of ``replicas`` from speeds given for its
    first replicas (``--prefill-speeds``): the rest at 1, those beyond the fleet dropped;
    ``None`` (every replica at 1, as before speeds existed) when none are given. O(replicas)."""
    if not given:
        return None
    first = tuple(given[:replicas])
    return first + (1.0,) * (replicas - len(first))


def check_prefill_speeds(speeds: tuple[float, ...], what: str = "each of prefill_speeds"
                         ) -> None:
    """Raise :class:`ConfigError` (naming ``what``) unless every speed is a number within
    :data:`PREFILL_SPEED_BOUNDS`. O(speeds)."""
    low, high = PREFILL_SPEED_BOUNDS
    for speed in speeds:
        if not (isinstance(speed, int | float) and low <= speed <= high):
            raise ConfigError(f"{what} must be a number from {low:g} to "
                              f"{high:g} (a multiple of prefill_tokens_per_s), got {speed!r}")
