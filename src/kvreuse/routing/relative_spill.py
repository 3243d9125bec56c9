"""Relative spill: stay where the longest cached prefix is unless waiting there costs more than a
share of what this request costs the fleet now; send a miss where it evicts least: a nearby cache
with room, else the full cache whose oldest prefix is stalest.

For each eligible replica ``r`` (the candidates of :class:`FleetView`, whatever subset the
caller allows: tenant pins, a model's replicas)::

    hit(r)   = predicted cached prefix (the router's approximate trees, or KV events)
    ttft(r)  = queue_delay(r) + overhead + (prompt - hit(r)) / (rate × speed(r))   (CostModel)
    R        = mean queue_delay over the candidates + overhead + prompt / rate
    R_else   = the same over the candidates holding less than the longest match
    limit    = min ttft + min(slack × R, ALTERNATIVE_SLACK × R_else)
    limit    = min ttft, while the longest match's demand > COPY_UTILISATION × its holders

``R`` is the fleet's current prefill time for this request: what it would wait and compute on an
average candidate with nothing cached; ``R_else`` what it would cost away from its prefix. A
prefix's demand (:class:`PrefixDemand`) is the replicas' worth of prefill its requests ask for:
their rate times one request's prefill past the prefix; its holders are the candidates holding
that longest match. Then:

* **affinity**: the longest match (ties to the shorter ``ttft``, then fewer requests in flight,
  then view order) if its ``ttft <= limit``;
* **spill**: otherwise the longest match among replicas within ``limit`` (same ties);
* **miss**: when that choice's match is at most ``cache_threshold`` (10 %) of the prompt, among
  the replicas with ``ttft <= min ttft + MISS_WINDOW × R`` whose cache has room for the prompt,
  the one whose cache is smallest, then the one holding the fewest requests in flight (then
  the shorter ``ttft``): a new prefix goes where it evicts least, as SGLang's documented rule
  does. A cache the estimator bounds (``CacheEstimator.capacity_of``, a gateway's index
  budget) that this prompt would overflow counts as that bound: such caches tie on size, and
  among them the least busy takes the miss.
* **miss on full caches**: when none of those nearby caches has room, among the replicas with
  ``ttft <= min ttft + min(0.7 × R, 3 × prompt / rate)`` (``FULL_MISS_WINDOW``), the one whose
  least recently used prefix is oldest (to the nearest ``LRU_AGE_STEP_S``, 10 s), then the one
  that served the fewest cached tokens lately (decayed, ``HIT_VALUE_TAU_S`` 120 s), then the
  order above.

Room and age come from :class:`EvictionModel`: per replica, an LRU tree of its KV capacity
(``ReplicaLoad.kv_capacity_tokens``: the simulator's pool, the capacity a gateway scraped or was
given) holding the prompts the router sent there. A replica whose capacity is unknown always
has room, so without capacities the rule is the smallest-cache rule above.

Why the stalest prefix, then the least served. A miss on a full cache evicts that cache's
least recently used prefixes. The longer ago they were used, the less likely they are to come
back (the contract library: 80 s old, hot contracts return every 26 s; the long-context fleet:
4-16 s old, hot documents return every 6 s). Where those ages are alike, the replica serving
the fewest cached tokens is the one whose evictions cost the fewest future hits: there the miss
goes, and on a tight fleet one replica becomes the place new documents churn through while the
others keep their hot sets whole. The smallest cache had no such signal once every cache was
full: over thirty runs of every simulator workload it lost 0.81 ± 0.28 points of long-context's
hit rate and 0.19 ± 0.08 of Mooncake ×4's to smg's fewest-in-flight order. Measured against the
smallest-cache rule on thirty runs each (paired, ± 2 SE): long-context +0.75 ± 0.22 points,
Mooncake ×4 +0.14 ± 0.10, ×8 +0.22 ± 0.13 (p95 +0.2 s, still 0.2 s under the best peer's),
contract library +0.08 ± 0.07, Mooncake ×16 −0.01 ± 0.06; the chat workloads never fill a
cache and are unchanged. Each part was tried alone first (docs/performance.md): by served
tokens alone, long-context gains a point but the contract library loses 0.25 (misses pile on
one replica while its caches have plenty of stale room); by age alone, the contract library
and Mooncake ×8 gain and long-context does not. The wider window lets a miss wait a little to
reach that replica; bounded by 3 prefill times, because on an overloaded fleet 0.7 × ``R``
is tens of seconds (Mooncake ×4, served-tokens order, means of ten runs: p95 37.1 s with
0.7 × ``R`` alone, 32.6 s with the bound).

Why the smallest cache before the fewest in flight. Requests in flight follow where hot
prefixes are being served, a cache's size counts each prefix once whatever its traffic; which
of the two places a fleet's first prefixes better depends on the stream. On
``benchmarks/routers.py``'s contracts at 12,288-token engines and its default stream (seed 7)
in flight first measured 56.0-56.8 % through the gateway against 50.8 % for size first (best
peer 55.9 %), and this rule was in flight first for a while. But over twelve seeded streams of
the same workload, replayed in the simulator as the gateway runs them, the two orders tie
(52.8 % and 52.9 % mean hit rate, both 3.6 points over smg's rule at 70 % of its p95), seed 7
being among the streams where smg's rule does best and the only one where size first trails it
there; through the gateway, on
seeds 1-3, size first beat the best peer by 3.3-12.3 points (docs/performance.md). On the chat
workloads (six system prompts, a few requests in flight during warm-up) the fewest in flight
put three of belgavi's six prompts on one replica in one replay of ten (p95 0.4 s to 4.6 s),
where the smallest cache spreads them two by two: over ten replays of every simulator
workload, size first passes the peers on 5 of 9, in flight first on 1.

Why full caches tie. Behind ``kvreuse route`` every replica's tree is trimmed at its budget
(2 × its KV), so once traffic has filled them all their sizes differ by whatever the last
trims left, a few hundred tokens that say nothing about room. Measured on the same contracts
workload, misses by size first: the simulator, which makes all 502 of a gateway run's
decisions when its trees are bounded alike, predicted 51.5 % hit rate and a 210 ms p95 when
misses followed those sizes and 53.2 % and 173 ms when full caches tied. Unbounded trees (the
simulator's default) never reach a bound; there, as behind a gateway, :class:`EvictionModel`
says when a cache is full.

Why copies for a prefix's demand. A prefix whose own traffic is more than the replicas holding
it can serve (one tenant's system prompt at 40 requests a second, 1.4 replicas' worth) queues
there whatever the slack bounds allow: they weigh this request's wait against its recompute,
not the queue the next hundred requests will find. So while the prefix's demand exceeds
``COPY_UTILISATION`` (0.8) × its holders, a faster replica without it takes the request and so
gets a copy (the branch is that replica's ``miss`` when it holds at most ``cache_threshold`` of
the prompt, else ``spill``); from then on ties share the load. The demand is measured over the
requests whose longest match the prefix was (decayed over ``DEMAND_TAU_S``, 10 s; a count of at
least ``DEMAND_MIN_REQUESTS``, 4), and the ``n``-th copy needs it measured over ``n - 1`` ×
``COPY_EVIDENCE_S`` (1 s): requests that arrive together justify a first copy, not a third. On
``benchmarks/default_vs_peers.py``'s ``hot-prefix-2``, ``-4`` and ``-8`` (ten runs each) the
p95 TTFT fell from 4.71, 4.71 and 0.33 s to 0.113 s, two copies in every run as llm-d's scorers
make (its p95 0.124 s; Dynamo's cost 0.113 s at 2 replicas, and 4 to 8 copies on more). Without
the evidence window a replay whose jittered arrivals put twenty requests at 0 s made a third
and fourth copy (−0.04 to −0.08 points of hit rate on 4 and 8 replicas); with the demand
estimate required to exceed only the holders' count (utilisation 1.0), as many. No other
workload changed in any of ten runs (belgavi, mission-3 and -4, the contract library,
multi-model, long-context, Mooncake × 4, 8 and 16): their prefixes are either held everywhere
or asked for by requests whose own prefill is too small to load a replica. Rules tried and
dropped (six runs each, against this one): a tight bound (2 × ``R_else``) whenever the replica
without the prefix has room, which cost Mooncake × 8 0.76 points (room says nothing about
whether the copy will be used again); the same by how often the prefix was the longest match
alone (10 requests in 10 s), which cost belgavi and mission-3 0.2-0.6 points and multi-model
1.6 (chat system prompts are asked often, by requests that cost little).

Why a second bound, on the replicas without the prefix. ``R`` counts the hot replica's own
queue: with one replica loaded and the rest idle, ``slack × R`` grows as fast as that queue
whenever there are ``slack`` candidates or fewer. So on a fleet of 2 to 4 replicas, a prefix
every request shares (one tenant's system prompt) kept all traffic on one replica while the
others idled. ``benchmarks/default_vs_peers.py --workloads hot-prefix-2,hot-prefix-4``: 2,400
requests at 40 a second sharing a 2,000-token prefix, p95 TTFT 23.1 s and growing with the
run, where every peer spreads the load (SGLang's rule 2.3 s, llm-d's and Dynamo's 0.04-0.12 s,
at the same hit rate). Bounding the wait by ``ALTERNATIVE_SLACK`` (24) times ``R_else`` makes
one spill copy the prefix to an idle replica, after which the two share it (ties go to the
shorter ``ttft``): p95 4.7 s there, the worst of the rules on that stream until copies for a
prefix's demand (above) made it 0.113 s; the bound stays for a replica loaded by many prefixes
at once, none of which alone asks for more than it can serve. Smaller values
bound it tighter but cost hits where caches are small and each copy evicts (thirty runs each,
against the best peer): at 8, 0.12 s there, but mission-4 −0.06 ± 0.04 points against SGLang's
rule and Mooncake ×4 −0.21 ± 0.09 against smg's; at 16, 2.9 s, −0.03 ± 0.04 and −0.12 ± 0.07;
at 24, +0.01 ± 0.02 and −0.09 ± 0.06 (without the bound +0.03 ± 0.03 and −0.06 ± 0.06). On
mission-4 it fires in the replays where warm-up put two of the surging tenant's prompts on one
replica (mean p95 1.41 s against 1.45 s without it); on the overloaded Mooncake ×4 it changes
20 of 30 runs (16 at 32). Long-context and Mooncake ×16 are unchanged at every value tried.

Why relative. ``cache_aware``'s bound is a fixed 200 ms: on 12,000-token documents a miss costs
1.2 s of prefill, so a 200 ms queue difference spills the request, scatters the documents and the
fleet falls over (the ``long-context`` scenario: 30 % hit rate and a 50 s p95 where SGLang's rule
keeps 65 %). A bound proportional to ``R`` holds a long prompt on its cache as long as waiting
costs less than ``slack`` times recomputing, and releases short ones quickly; it scales with the
queues, so a fleet that is busy everywhere does not spill for nothing.

The knob, ``slack``, moves along one curve: 0 is pure least-TTFT placement (hit rate falls,
queues even out), infinity is pure affinity (SGLang's rule without its fleet-wide switch: highest
hit rate, longest queues on hot prefixes). ``kvreuse simulate --report`` plots that curve (hit
rate against p95 TTFT as ``slack`` varies) and ``benchmarks/default_vs_peers.py`` judges the
default against the peers' rules on every workload. The default is 8 (it was 2, then 4). Over
thirty replays of every simulator workload, 8 against 4 moves only the Mooncake trace at 8 and
16 replicas: +0.05 ± 0.08 and +0.06 ± 0.04 points of hit rate at p95s 0.04 and 0.02 s higher,
both still under the best peer's; Mooncake ×16 goes from 0.03 points under SGLang's rule to
0.03 over. Elsewhere the bound on the replicas without the prefix binds first. 12 ties 8 on
both; infinity (which drops that bound too) costs mission-4 0.03 s of p95. In
the simulator's model of the gateway (``benchmarks/gateway_streams.py``: routers.py's three
workloads, twelve streams, 12,288- and 32,768-token engines) 8 and 4 place every request alike.
Before: 4 kept 0.2-0.3 points more than 2 of the Mooncake trace and 0.4 more of
``long-context`` at p95s within 0.5 s, and through the gateway gave the same hit rates as 2 at
p95s 0-12 % higher, about the spread of one setup's p95 from run to run (docs/performance.md).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

from kvreuse.errors import ConfigError
from kvreuse.identity import CacheIdentity
from kvreuse.routing.approx_trees import ApproxTrees
from kvreuse.routing.base import (
    CacheEstimator,
    CostModel,
    EstimatorPolicy,
    FleetView,
    ReplicaId,
    ReplicaLoad,
    RequestView,
    RoutingDecision,
)
from kvreuse.tokens import TOKEN_BYTES

MISS_WINDOW = 0.2
"""Share of ``R`` within which a miss may trade speed for a less busy, emptier cache."""

FULL_MISS_WINDOW = (0.7, 3.0)
"""Once every nearby cache is full: a miss may go up to the smaller of 0.7 × ``R`` and 3 × its
own prefill time slower than the fastest replica, to land where it evicts least."""

LRU_AGE_STEP_S = 10.0
"""Ages of the caches' least recently used prefixes closer than this count as equal."""

HIT_VALUE_TAU_S = 120.0
"""Time constant of the decayed count of cached tokens each replica has served."""

ALTERNATIVE_SLACK = 24.0
"""A request waits on the longest prefix at most this many times what it would cost on an
average replica without that prefix (``R`` of those replicas alone): the bound ``slack × R``
includes the hot replica's own queue in ``R``, so it alone never fires on a fleet of ``slack``
replicas or fewer while only one is loaded."""

COPY_UTILISATION = 0.8
"""A prefix's requests may keep the replicas holding it busy this share of the time before a
faster replica without it gets a copy (:class:`PrefixDemand`)."""

DEMAND_TAU_S = 10.0
"""Time constant of each prefix's decayed request count."""

DEMAND_MIN_REQUESTS = 4.0
"""A prefix's decayed request count must reach this before its demand is estimated: four
requests at once, five when they are spread out (each has decayed a little by the next)."""

COPY_EVIDENCE_S = 1.0
"""The demand that justifies the ``n``-th copy (``n`` ≥ 2) must be measured over at least
``(n - 1)`` × this: requests that arrive together are a burst, not a rate."""

DEMAND_PREFIXES = 4096
"""At most this many prefixes are counted; past it the least recently asked half is dropped."""

SLACKS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, float("inf"))
"""The knob's values ``kvreuse simulate --report`` plots."""


def _decayed(value: float, elapsed_s: float, tau_s: float) -> float:
    """``value`` after ``elapsed_s`` of exponential decay with time constant ``tau_s``."""
    return value * math.exp(-elapsed_s / tau_s)


class EvictionModel:
    """What a miss would evict on each replica whose KV capacity is known
    (``ReplicaLoad.kv_capacity_tokens``): an LRU tree per replica, of that capacity, of the
    prompts the router sent there (the engine's own LRU as the router sees it), and a count of
    the cached tokens each replica served, decayed with time constant ``HIT_VALUE_TAU_S``.

    :meth:`observe` is called with each request's candidates before the choice, :meth:`record`
    once the request was sent. O(prompt) per record (one tree insert), O(log h) amortised per
    query. A replica's tree holds at most ``max_tokens``, whatever capacity it reports (a
    forged ``/metrics`` must not make a flood of unique prompts grow it without bound), as the
    router's own trees are trimmed to ``ApproxTrees.max_tree_tokens``."""

    def __init__(self, max_tokens: int = 2**26) -> None:
        self.max_tokens = max_tokens
        self.lru = ApproxTrees(capacity_tokens=0)
        self._capacity: dict[ReplicaId, int] = {}
        self._served: dict[ReplicaId, tuple[float, float]] = {}  # replica -> (value, at)

    def observe(self, loads: Sequence[ReplicaLoad]) -> None:
        """Learn each candidate's capacity (a gateway learns it late, an engine may change)."""
        for load in loads:
            capacity = load.kv_capacity_tokens
            if capacity is not None and self._capacity.get(load.replica_id) != capacity:
                self._capacity[load.replica_id] = capacity
                self.lru.set_capacity(load.replica_id, min(capacity, self.max_tokens))

    def has_room(self, replica: ReplicaId, tokens: int) -> bool:
        """Whether ``tokens`` more fit in ``replica``'s cache without evicting (True when its
        capacity is unknown: nothing says it is full)."""
        capacity = self._capacity.get(replica)
        if capacity is None:
            return True
        return self.lru.tree_tokens(replica) + tokens <= capacity

    def eviction_cost(self, replica: ReplicaId, now: float) -> tuple[int, float]:
        """Smaller is cheaper: minus the age of the least recently used prefix, in steps of
        ``LRU_AGE_STEP_S``, then the decayed cached tokens ``replica`` served."""
        stamp = self.lru.lru_stamp(replica)
        age_steps = int((now - stamp) // LRU_AGE_STEP_S) if stamp is not None else 0
        return -age_steps, self._served_value(replica, now)

    def record(self, request: RequestView, replica: ReplicaId, cached_tokens: int,
               now: float) -> None:
        """``request`` went to ``replica``, predicted to find ``cached_tokens`` there."""
        if replica in self._capacity:
            self.lru.record(request, replica, now)
        self._served[replica] = (self._served_value(replica, now) + cached_tokens, now)

    def _served_value(self, replica: ReplicaId, now: float) -> float:
        value, at = self._served.get(replica, (0.0, now))
        return _decayed(value, now - at, HIT_VALUE_TAU_S) if value else 0.0


class PrefixDemand:
    """How much of a replica's prefill time the requests sharing one prefix ask for.

    Keyed by the request's cache identity and its longest cached prefix (its length and
    Python's keyed hash of its tokens: 31 µs for 10,000 tokens here against BLAKE2b's 146 µs,
    and a client cannot forge collisions without the process's hash key), it keeps a count of
    the requests whose longest match that prefix was, decayed with time constant
    ``DEMAND_TAU_S``, and when the prefix was first counted. :meth:`count` is called once per
    request routed, before the choice. O(prefix) per call (the hash), O(1) amortised for the
    table, which holds at most ``DEMAND_PREFIXES`` entries whatever the traffic (a flood of
    unique prompts drops the stalest half)."""

    def __init__(self, max_prefixes: int = DEMAND_PREFIXES) -> None:
        self.max_prefixes = max_prefixes
        self._counts: dict[tuple[CacheIdentity, int, int], tuple[float, float, float]] = {}
        # key -> (decayed count, last counted at, first counted at)

    def __len__(self) -> int:
        return len(self._counts)

    def count(self, request: RequestView, prefix_tokens: int, now: float) -> tuple[float, float]:
        """Count ``request`` for its longest cached prefix of ``prefix_tokens`` tokens; the
        prefix's decayed count with it, and the seconds since the prefix was first counted."""
        key = (request.identity, prefix_tokens,
               hash(request.tokens[:prefix_tokens * TOKEN_BYTES]))
        value, at, first = self._counts.pop(key, (0.0, now, now))
        value = _decayed(value, now - at, DEMAND_TAU_S) + 1.0
        self._counts[key] = (value, now, first)  # re-inserted: the dict is in recency order
        if len(self._counts) > self.max_prefixes:
            for stale in list(itertools.islice(self._counts, len(self._counts) // 2)):
                del self._counts[stale]
        return value, now - first

    @staticmethod
    def replicas_needed(count: float, seconds: float, holders: int,
                        prefill_s: float) -> float:
        """The replicas' worth of prefill time the prefix's requests ask for: their rate
        (``count`` requests counted over ``seconds``, decayed; at least ``COPY_EVIDENCE_S`` ×
        (holders - 1) seconds) times ``prefill_s``, one request's own prefill past the prefix.
        0 below ``DEMAND_MIN_REQUESTS``."""
        if count < DEMAND_MIN_REQUESTS:
            return 0.0
        window = max(seconds, COPY_EVIDENCE_S * (holders - 1), 1e-3)
        per_s = count / (DEMAND_TAU_S * -math.expm1(-window / DEMAND_TAU_S))
        return per_s * prefill_s


def relative_spill_rule(
    matched: dict[ReplicaId, int],
    loads: Sequence[ReplicaLoad],
    prompt_tokens: int,
    cost: CostModel,
    cache_size: Callable[[ReplicaId], int],
    cache_threshold: float,
    slack: float,
    cache_capacity: Callable[[ReplicaId], int | None] = lambda replica: None,
    evictions: EvictionModel | None = None,
    now: float = 0.0,
    alternative_slack: float = ALTERNATIVE_SLACK,
    prefix_demand: float = 0.0,
    copy_utilisation: float = COPY_UTILISATION,
) -> RoutingDecision:
    """The rule of the module docstring. ``loads`` is not empty; ``cache_capacity`` is each
    replica's bound (None: unbounded); ``evictions`` (None: no capacity known) places misses
    on full caches at ``now``; ``alternative_slack`` bounds the wait by ``R_else``
    (infinity: no such bound); ``prefix_demand`` is :meth:`PrefixDemand.replicas_needed` for
    the longest match (0: not known), copied on to a faster replica without it while above
    ``copy_utilisation`` × its holders (infinity: never). O(replicas)."""
    rate, overhead = cost.prefill_tokens_per_s, cost.overhead_s
    rows: list[tuple[ReplicaId, int, float, int]] = []
    delays: list[float] = []
    for load in loads:
        rid = load.replica_id
        hit = matched[rid]
        delay = cost.queue_delay_s(load)
        delays.append(delay)
        rows.append((rid, hit, delay + cost.prefill_s(prompt_tokens - hit, load.prefill_speed),
                     load.in_flight))
    fastest = min(row[2] for row in rows)
    longest = max(row[1] for row in rows)
    reference = sum(delays) / len(rows) + overhead + prompt_tokens / rate
    limit = fastest + slack * reference if slack != float("inf") else float("inf")
    elsewhere = [delay for delay, row in zip(delays, rows, strict=True) if row[1] < longest]
    if elsewhere and slack != float("inf"):
        alternative = sum(elsewhere) / len(elsewhere) + overhead + prompt_tokens / rate
        limit = min(limit, fastest + alternative_slack * alternative)
        holders = len(rows) - len(elsewhere)
        if prefix_demand > copy_utilisation * holders:
            # The prefix's own traffic is more than its holders can serve: wait for none of
            # them when a replica without it is faster, so the spill copies it there.
            limit = fastest
    # The fastest replica is always within the limit, so ``within`` is never empty.
    within = [row for row in rows if row[2] <= limit]
    pick = min(within, key=lambda row: (-row[1], row[2], row[3]))
    if pick[1] / max(prompt_tokens, 1) <= cache_threshold:
        window = fastest + MISS_WINDOW * reference
        near = [row for row in rows if row[2] <= window]

        def room_order(row: tuple[ReplicaId, int, float, int]) -> int:
            size, bound = cache_size(row[0]), cache_capacity(row[0])
            return bound if bound is not None and size + prompt_tokens > bound else size

        if evictions is not None:
            full = {row[0] for row in rows if not evictions.has_room(row[0], prompt_tokens)}
            roomy = [row for row in near if row[0] not in full]
            if not roomy:
                share, prefills = FULL_MISS_WINDOW
                wide = fastest + min(share * reference,
                                     prefills * (overhead + prompt_tokens / rate))
                pick = min(
                    (row for row in rows if row[2] <= wide),
                    key=lambda row: (row[0] in full, evictions.eviction_cost(row[0], now),
                                     room_order(row), row[3]),
                )
                return RoutingDecision(pick[0], "miss", pick[1])
            near = roomy
        pick = min(near, key=lambda row: (room_order(row), row[3], row[2]))
        return RoutingDecision(pick[0], "miss", pick[1])
    return RoutingDecision(pick[0], "affinity" if pick[1] == longest else "spill", pick[1])


class RelativeSpill(EstimatorPolicy):
    """See the module docstring. Its estimator's options: ``estimator`` (``"approx"``, the
    router's own trees, no KV events needed; ``tree_capacity_tokens`` makes them forget at a
    replica's cache size; or ``"exact"``, KV events, ``block_size`` the engine's)."""

    name = "relative_spill"
    estimator_options = ("estimator", "tree_capacity_tokens", "block_size")

    def __init__(
        self,
        *,
        estimator: CacheEstimator,
        slack: float = 8.0,
        cache_threshold: float = 0.1,
        cost: CostModel | None = None,
        alternative_slack: float = ALTERNATIVE_SLACK,
        copy_utilisation: float = COPY_UTILISATION,
    ) -> None:
        if not slack >= 0:  # also refuses NaN
            raise ConfigError(f"slack must be >= 0 (inf for pure affinity), got {slack}")
        if not alternative_slack >= 0:
            raise ConfigError("alternative_slack must be >= 0 (inf: no bound from the replicas "
                              f"without the prefix), got {alternative_slack}")
        if not copy_utilisation > 0:
            raise ConfigError("copy_utilisation must be > 0 (inf: never copy a prefix for its "
                              f"demand), got {copy_utilisation}")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ConfigError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.slack = slack
        self.alternative_slack = alternative_slack
        self.copy_utilisation = copy_utilisation
        self.demand = PrefixDemand()
        self.cache_threshold = cache_threshold
        self.cost = cost or CostModel()
        self.evictions = EvictionModel()
        super().__init__(estimator)

    def route(self, request: RequestView, fleet: FleetView) -> RoutingDecision | None:
        if not fleet.replicas:
            return None
        self.evictions.observe(fleet.replicas)
        matched = self.predict(request, fleet)
        longest = max(matched.values())
        demand = 0.0
        if longest and self.copy_utilisation != float("inf"):
            count, seconds = self.demand.count(request, longest, fleet.now)
            holders = sum(1 for tokens in matched.values() if tokens == longest)
            demand = PrefixDemand.replicas_needed(
                count, seconds, holders, self.cost.prefill_s(request.prompt_tokens - longest))
        return relative_spill_rule(
            matched,
            fleet.replicas,
            request.prompt_tokens,
            self.cost,
            self.estimator.tree_tokens,
            self.cache_threshold,
            self.slack,
            self.estimator.capacity_of,
            self.evictions,
            fleet.now,
            self.alternative_slack,
            demand,
            self.copy_utilisation,
        )

    def on_routed(self, request: RequestView, decision: RoutingDecision, now: float) -> None:
        super().on_routed(request, decision, now)
        self.evictions.record(request, decision.replica, decision.predicted_cached_tokens, now)
