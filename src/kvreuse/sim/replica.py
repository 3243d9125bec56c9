"""One simulated engine replica: a prefill queue, decode, and a KV memory (:mod:`.memory`).

Memory (seed 001, "cache memory is borrowed, not reserved"). The replica's KV pool holds both
the prefix cache and the running requests' KV (prompt and reserved output), so the space left
for idle cached prefixes shrinks exactly when traffic peaks. How the two share the pool depends
on ``cache_kind`` (``radix``: token-granular SGLang tree; ``block``: vLLM's block pool); see
:mod:`kvreuse.sim.memory`. If even an empty cache would not make room for the request picked to
prefill, because running requests pin the rest, it is not refused and nothing is preempted: it
waits at the head of the queue, and the replica admits nothing else until a finishing request
frees memory (head-of-line blocking, which is what shows up in TTFT). A request larger than the
whole pool could never run and is a configuration error.

Prefill batching rule. A replica prefills one request at a time, in scheduling order, each
costing ``overhead_s + uncached / prefill_tokens_per_s`` (seed 001: 15 ms, 10,000 tok/s). With
this additive cost, grouping k requests into one step would take exactly the sum of their costs
and only delay the first token of the earlier ones, so the serial form *is* the batching rule:
chunked prefill with a budget of one request per step. Decode runs beside prefill and costs no
prefill time: a request's last token comes ``output_len × time_per_output_token_s`` after its
first. A request whose decode takes no simulated time (``time_per_output_token_s = 0`` or no
output) finishes at its prefill's end, in the same step: prompt and output enter the cache once,
before the next request is picked.

Queue estimates. ``queued_prefill_tokens`` (the load routers see) counts each waiting request's
uncached prompt as the cache stood at its arrival, corrected when it is picked; a request that
arrives at an idle replica is picked at once, so its cache is looked up once, at admission.
With ``router_view`` it counts instead the prompt less the router's predicted cached prefix,
uncorrected, until prefill ends and, with ``first_byte_lag_s``, that much longer, until the
first token reaches the router (what a gateway knows; ``FleetConfig.load_view``); likewise
``in_flight`` counts a finished request ``last_byte_lag_s`` longer, until its response's end
reaches the router (:meth:`Replica.last_byte`).

Speeds. ``prefill_speed`` multiplies ``prefill_tokens_per_s`` (a replica of other hardware;
``FleetConfig.prefill_speeds``; :meth:`Replica.set_prefill_speed` changes it mid-run).
``router_speed`` is the speed the router believes it has (``FleetConfig.speed_view``): like a
gateway's upstream weight, the load it reports is divided by it, and
``ReplicaLoad.prefill_speed`` carries it; at 1 the load is as counted.
``on_first_token(job, index, now)``, if given, is called as each prefill ends (where a router
measuring speeds times the first token).

Scheduling. ``fcfs``; or ``lpm``, longest cached prefix first (SGLang), which falls back to fcfs
when more than ``lpm_max_waiting`` (128, SGLang's rule) requests wait.
"""

from __future__ import annotations

from collections.abc import Callable

from kvreuse.errors import PoolTooSmallError
from kvreuse.routing.base import ReplicaLoad
from kvreuse.sim.config import CACHE_KINDS, SCHEDULERS, ReplicaConfig
from kvreuse.sim.event_loop import EventLoop, Finish, FirstByte, LastByte, PrefillDone
from kvreuse.sim.memory import Job, KvSink, ReplicaMemory
from kvreuse.sim.requests import SimRequest

__all__ = ["CACHE_KINDS", "SCHEDULERS", "Job", "LoadBoard", "Replica", "ReplicaConfig"]


class LoadBoard:
    """The replicas' loads as routers see them, rebuilt only where a replica changed.

    A replica adds its index to :attr:`stale` whenever its queue moves; :meth:`current` then
    rebuilds that replica's :class:`ReplicaLoad` once, however many requests arrive in between.
    O(1) per change, O(changed replicas) per read."""

    __slots__ = ("_loads", "_replicas", "_view", "stale")

    def __init__(self) -> None:
        self._replicas: list[Replica] = []
        self._loads: list[ReplicaLoad] = []
        self._view: tuple[ReplicaLoad, ...] = ()
        self.stale: set[int] = set()
        """Indexes of replicas whose load moved since the last :meth:`current`; a replica adds
        its own (``stale.add``, a C call: it happens several times per request)."""

    def attach(self, replica: Replica) -> None:
        assert replica.index == len(self._replicas), "replicas must attach in index order"
        self._replicas.append(replica)
        self._loads.append(replica.load())
        self.stale.add(replica.index)

    def current(self) -> tuple[ReplicaLoad, ...]:
        stale = self.stale
        if stale:
            loads, replicas = self._loads, self._replicas
            for i in stale:
                loads[i] = replicas[i].load()
            stale.clear()
            self._view = tuple(loads)
        return self._view


class Replica:
    """See the module docstring."""

    def __init__(
        self,
        index: int,
        config: ReplicaConfig,
        loop: EventLoop,
        on_finish: Callable[[Job, int, float], None],
        kv_sink: KvSink | None = None,
        board: LoadBoard | None = None,
        router_view: bool = False,
        first_byte_lag_s: float = 0.0,
        last_byte_lag_s: float = 0.0,
        prefill_speed: float = 1.0,
        on_first_token: Callable[[Job, int, float], None] | None = None,
    ) -> None:
        self.index = index
        self.replica_id = f"r{index}"
        self.config = config
        self.loop = loop
        self._on_finish = on_finish
        self.memory: ReplicaMemory = CACHE_KINDS[config.cache_kind](
            self.replica_id, config, kv_sink
        )
        self.cache = self.memory.cache
        self.waiting: list[Job] = []
        self.busy: Job | None = None
        self.queued_prefill_tokens = 0
        self.in_flight = 0
        self.blocked_admissions = 0
        self.prefill_busy_s = 0.0
        self.requests_served = 0
        self._rate = config.prefill_tokens_per_s * prefill_speed
        self.router_speed = 1.0
        """The speed the router believes this replica has (see the module docstring); set it
        with :meth:`set_router_speed`."""
        self._on_first_token = on_first_token
        self._tpot = config.time_per_output_token_s
        self._overhead = config.overhead_s
        self._lpm = config.scheduling == "lpm" and config.prefix_caching
        self._router_view = router_view
        self._first_byte_lag = first_byte_lag_s
        self._last_byte_lag = last_byte_lag_s
        self._capacity = self.memory.capacity_tokens
        self._board = board if board is not None else LoadBoard()
        self._board.attach(self)
        self._stale = self._board.stale

    # ------------------------------------------------------------------ views

    @property
    def evicted_tokens(self) -> int:
        return self.memory.evicted_tokens

    @property
    def private_tokens(self) -> int:
        return self.memory.private_tokens

    def load(self) -> ReplicaLoad:
        speed = self.router_speed
        queued = len(self.waiting) + (self.busy is not None)
        load = ReplicaLoad(self.replica_id, self.queued_prefill_tokens, queued, self.in_flight,
                           self._capacity)
        return load if speed == 1.0 else load.at_speed(speed)

    def set_prefill_speed(self, speed: float) -> None:
        """From now on this replica prefills at ``speed`` times the configured rate; the
        prefill in progress keeps its own (``FleetConfig.speed_changes``). O(1)."""
        self._rate = self.config.prefill_tokens_per_s * speed

    def set_router_speed(self, speed: float) -> None:
        """The router now believes this replica's prefill speed is ``speed``. O(1)."""
        if speed != self.router_speed:
            self.router_speed = speed
            self._stale.add(self.index)

    # ------------------------------------------------------------------ request life

    def check_fits(self, request: SimRequest) -> None:
        """Raise :class:`PoolTooSmallError` if ``request`` could never run here, even alone: its
        KV (prompt + output) exceeds the pool. The fleet checks its largest request once, before
        simulating, so :meth:`enqueue` does not pay for the check per request."""
        need = self.memory.footprint(request)
        if need > self._capacity:
            raise PoolTooSmallError(request.request_id, need, self._capacity)

    def enqueue(self, job: Job, now: float) -> None:
        """A routed request arrives; it is picked at once if the replica is idle. The caller
        has checked (:meth:`check_fits`) that it fits the pool."""
        request = job.request
        memory = self.memory
        if self._router_view:
            job.estimate = max(request.prompt_len - job.predicted, 0)
        else:
            idle = self.busy is None and not self.waiting
            # An idle replica admits the request right now, which looks the cache up anyway.
            cached = 0 if idle else memory.peek(request, now)
            job.estimate = request.prompt_len - cached
        self.queued_prefill_tokens += job.estimate
        self.in_flight += 1
        self.waiting.append(job)
        self._stale.add(self.index)
        if self.busy is None:
            self._start_next(now)

    def _pick(self, now: float) -> int:
        """Index in ``waiting`` of the next request to prefill."""
        waiting = self.waiting
        if not self._lpm or len(waiting) <= 1 or len(waiting) > self.config.lpm_max_waiting:
            return 0
        peek = self.memory.peek
        best, best_len = 0, -1
        for pos, job in enumerate(waiting):
            length = peek(job.request, now)
            if length > best_len:
                best, best_len = pos, length
        return best

    def _start_next(self, now: float) -> None:
        if not self.waiting:
            return
        pos = self._pick(now) if self._lpm else 0
        job = self.waiting[pos]
        request = job.request
        admitted = self.memory.admit(job, now)
        uncached = request.prompt_len - job.cached
        if not self._router_view:
            self.queued_prefill_tokens += uncached - job.estimate
            job.estimate = uncached
        self._stale.add(self.index)
        if not admitted:
            self.blocked_admissions += 1
            return  # waits until a finish frees memory
        del self.waiting[pos]
        duration = self._overhead + uncached / self._rate
        job.prefill_s = duration
        self.prefill_busy_s += duration
        self.busy = job
        self.loop.schedule(now + duration, PrefillDone(self.index, job))

    def prefill_done(self, job: Job, now: float) -> None:
        request = job.request
        if self._first_byte_lag > 0 and job.estimate:
            self.loop.schedule(now + self._first_byte_lag, FirstByte(self.index, job.estimate))
        else:
            self.queued_prefill_tokens -= job.estimate
        job.estimate = 0
        job.prefill_end = now
        if self._on_first_token is not None:
            self._on_first_token(job, self.index, now)
        self.busy = None
        decode_s = request.output_len * self._tpot
        if decode_s > 0:
            self.memory.prefilled(job, now)
            self._stale.add(self.index)
            self.loop.schedule(now + decode_s, Finish(self.index, job))
        else:
            self._complete(job, now)
        self._start_next(now)

    def first_byte(self, estimate: int) -> None:
        """The router heard of a first token: it stops counting that request's ``estimate``."""
        self.queued_prefill_tokens -= estimate
        self._stale.add(self.index)

    def finish(self, job: Job, now: float) -> None:
        self._complete(job, now)
        if self.busy is None:
            self._start_next(now)

    def _complete(self, job: Job, now: float) -> None:
        self.memory.release(job, now)
        if self._last_byte_lag > 0:
            self.loop.schedule(now + self._last_byte_lag, LastByte(self.index, job))
        else:
            self.in_flight -= 1
        self.requests_served += 1
        self._stale.add(self.index)
        self._on_finish(job, self.index, now)

    def last_byte(self) -> None:
        """The router heard a response end: one request fewer in flight."""
        self.in_flight -= 1
        self._stale.add(self.index)

    def check_invariants(self) -> None:
        """Pool accounting and the cache's own invariants. O(cache nodes)."""
        self.memory.check_invariants()
        assert self.queued_prefill_tokens >= 0, "negative queued prefill tokens"
        assert self.in_flight >= len(self.waiting), "more waiting than in flight"
