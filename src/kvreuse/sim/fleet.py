"""A fleet: a router (any :mod:`kvreuse.routing` policy) in front of N :class:`Replica` s.

Requests arrive at their workload times (open loop: arrivals do not depend on the policy, so
every policy sees the very same traffic). On arrival the router is given a
:class:`~kvreuse.routing.base.FleetView`; with ``load_lag_s > 0`` that view is a snapshot
refreshed every ``load_lag_s`` seconds (a scrape interval), otherwise it is current. With
``kv_event_lag_s`` set and a policy that ``uses_kv_events``, replicas publish
:class:`~kvreuse.routing.events.KvStored` / :class:`~kvreuse.routing.events.KvRemoved`
events that reach ``policy.on_kv_event`` that many seconds later (the ``exact`` policy's only
source of truth). With a lag of 0 they are handed over as they happen, without a trip through the
event heap: a router reads its state only when routing an arrival, and arrivals run after every
other event due at the same instant, so the delivery order cannot be told apart.

Models: with ``FleetConfig.models`` each replica serves some models, and a request's view holds
only the replicas serving its model (as the gateway's does), so every policy routes on that
candidate subset; a policy choosing outside it breaks an invariant (an assertion).

Speeds: with ``FleetConfig.prefill_speeds`` replicas prefill at different rates (and with
``FleetConfig.speed_changes`` change them mid-run), and the router sees them as
``FleetConfig.speed_view`` says. Measured, the fleet keeps what a gateway
keeps (gateway/router.py): per model (one for the whole fleet without ``models``), a
:class:`~kvreuse.routing.PrefillFit` starting from the policy's cost model (the replicas'
configured rate and overhead for a policy that predicts no time) and a
:class:`~kvreuse.routing.RelativeSpeeds`, both fed one sample per first token
(:func:`~kvreuse.routing.cost_fit.observe_first_token`): the load the replica showed as the
request was routed, against the time from its arrival until the router heard the token
(``first_byte_lag_s`` after the prefill ended). A policy that predicts time
(:class:`~kvreuse.routing.PredictsTime`) routes on its model's fit, as behind a gateway. With
models, a request sees each candidate at the speed measured over its model's fleet (a replica
serving two models has two). The sample is taken as the prefill ends, with the lag added: its
speed applies that lag early, one sample's step (at most 1/33 of a log step once a replica has
32 answers) a few milliseconds sooner.

Seeded and deterministic: the workload carries all randomness, policies get a seeded rng, and
the event loop's tie rule (see :mod:`kvreuse.sim.event_loop`) fixes the order of simultaneous
events.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

from kvreuse.bulk import collector_paused
from kvreuse.errors import ConfigError
from kvreuse.routing.base import CostModel, FleetView, PredictsTime, RoutingPolicy
from kvreuse.routing.cost_fit import (
    PrefillFit,
    PrefillSample,
    RelativeSpeeds,
    observe_first_token,
)
from kvreuse.routing.events import KvEvent
from kvreuse.sim.config import FleetConfig
from kvreuse.sim.event_loop import (
    EventLoop,
    Finish,
    FirstByte,
    KvDelivery,
    LastByte,
    LoadSnapshot,
    PrefillDone,
    SpeedChange,
)
from kvreuse.sim.memory import Job
from kvreuse.sim.replica import LoadBoard, Replica
from kvreuse.sim.requests import FleetRun, RequestRecord, SimRequest

PROMPT_LEN = operator.attrgetter("prompt_len")
OUTPUT_LEN = operator.attrgetter("output_len")


class FleetSimulator:
    """Runs one workload through one policy. Use a fresh policy instance per run.

    ``check_each_event`` runs every replica's O(cache) ``check_invariants`` after each event
    (for tests and debugging: it makes a run many times slower)."""

    def __init__(
        self, config: FleetConfig, policy: RoutingPolicy, *, check_each_event: bool = False
    ) -> None:
        self.config = config
        self.policy = policy
        self.check_each_event = check_each_event
        self.loop = EventLoop()
        lag = config.kv_event_lag_s
        wanted = getattr(policy, "uses_kv_events", True)
        sink: Callable[[KvEvent], None] | None = None
        if lag is not None and wanted:
            sink = policy.on_kv_event if lag == 0 else self._publish
        self._board = LoadBoard()
        speeds = config.initial_speeds()
        self._measuring = speeds is not None and config.speed_view == "measured"
        # With models, each model's requests see the replicas at that model's measured speeds
        # (as a gateway's do); without, one set of speeds lives in the replicas' loads.
        self._per_model = self._measuring and config.models is not None
        timed = self._first_token if self._measuring else None
        self.replicas = [
            Replica(i, config.replica, self.loop, self._finished, sink, self._board,
                    config.load_view == "router", config.first_byte_lag_s,
                    config.last_byte_lag_s, 1.0 if speeds is None else speeds[i], timed)
            for i in range(config.replicas)
        ]
        if speeds is not None and config.speed_view == "known":
            for replica, speed in zip(self.replicas, speeds, strict=True):
                replica.set_router_speed(speed)
        # Measuring: per model key, the fleet's fit and its replicas' speeds over it; the fit
        # starts where the policy's cost model does, as a gateway's starts from its flags.
        self._meters: dict[str, tuple[PrefillFit, RelativeSpeeds]] = {}
        self._timed = policy if isinstance(policy, PredictsTime) else None
        self._prior = (self._timed.cost if self._timed is not None else
                       CostModel(config.replica.prefill_tokens_per_s, config.replica.overhead_s))
        self._by_id = {r.replica_id: r for r in self.replicas}
        # With a last-byte lag the policy hears of a finish at LastByte, not at the engine's.
        self._finish_heard_late = config.last_byte_lag_s > 0
        # Model -> the replicas serving it (None: all serve everything, the common case).
        self._serving: dict[str, frozenset[str]] | None = None
        if config.models is not None:
            serving: dict[str, set[str]] = {}
            for replica, names in zip(self.replicas, config.models, strict=True):
                for name in names:
                    serving.setdefault(name, set()).add(replica.replica_id)
            self._serving = {name: frozenset(ids) for name, ids in serving.items()}
        self._records: list[RequestRecord] = []
        # Each request's prefill time, kept only when speeds change mid-run (FleetRun).
        self._prefill_s: dict[int, float] | None = {} if config.speed_changes else None
        self._snapshot: FleetView | None = None
        self._load_lag = config.load_lag_s

    # ------------------------------------------------------------------ running

    def check_fits(self, requests: Sequence[SimRequest]) -> None:
        """Raise :class:`~kvreuse.errors.PoolTooSmallError` when one of ``requests`` could
        never run on a replica, even alone. :meth:`run` calls it first. O(requests)."""
        if requests:
            # Footprints grow with prompt + output (rounded up to the memory's granularity), and
            # every replica has the same pool: checking the largest request checks them all.
            sizes = list(map(operator.add, map(PROMPT_LEN, requests), map(OUTPUT_LEN, requests)))
            self.replicas[0].check_fits(requests[sizes.index(max(sizes))])

    def run(
        self,
        requests: Sequence[SimRequest],
        progress: Callable[[int], None] | None = None,
        progress_every: int = 1000,
    ) -> FleetRun:
        """Simulate ``requests`` (sorted by arrival) to completion. ``progress(n)`` is called
        every ``progress_every`` finished requests."""
        arrivals = [r.arrival_s for r in requests]
        if not all(map(operator.le, arrivals, arrivals[1:])):
            raise ConfigError("requests must be sorted by arrival_s")
        self.check_fits(requests)
        self._requests = requests
        self._progress = progress
        self._progress_every = max(progress_every, 1)
        loop = self.loop
        handlers: dict[type, Callable[[Any], None]] = {
            PrefillDone: self._on_prefill_done,
            Finish: self._on_finish,
            KvDelivery: self._on_kv_delivery,
            FirstByte: self._on_first_byte,
            LastByte: self._on_last_byte,
            LoadSnapshot: self._on_snapshot,
            SpeedChange: self._on_speed_change,
        }
        # Not after the last arrival: the traffic is over (its backlog drains at the speeds
        # then), and a change at any later time would run the clock on to it.
        last_arrival = arrivals[-1] if arrivals else -1.0
        for at_s, index, speed in self.config.speed_changes:
            if at_s <= last_arrival:
                loop.schedule(at_s, SpeedChange(index, speed))
        on_arrival: Callable[[int], None] = self._arrive
        if self.check_each_event:
            handlers = {kind: self._checked(run) for kind, run in handlers.items()}
            on_arrival = self._checked(on_arrival)
        with collector_paused():  # millions of objects, no cycles (kvreuse.bulk)
            loop.run(handlers, arrivals, on_arrival)
        assert len(self._records) == len(requests), "a request never finished"
        self._records.sort(key=operator.attrgetter("request_id"))
        return FleetRun(
            policy=self.policy.name,
            config=self.config,
            records=tuple(self._records),
            evicted_tokens=tuple(r.evicted_tokens for r in self.replicas),
            prefill_busy_s=tuple(r.prefill_busy_s for r in self.replicas),
            requests_per_replica=tuple(r.requests_served for r in self.replicas),
            blocked_admissions=tuple(r.blocked_admissions for r in self.replicas),
            events_processed=loop.processed,
            end_time_s=loop.now,
            prefill_s_by_request=self._prefill_s,
        )

    def _checked(self, handler: Callable[[Any], None]) -> Callable[[Any], None]:
        """``handler``, then every replica's invariants (``check_each_event``)."""

        def run_and_check(event: Any) -> None:
            handler(event)
            for replica in self.replicas:
                replica.check_invariants()

        return run_and_check

    def fleet_view(self, now: float) -> FleetView:
        if self._load_lag > 0:
            lag = self._load_lag
            if self._snapshot is None:
                self._snapshot = FleetView(self._board.current(), now)
                self.loop.schedule(now + lag, LoadSnapshot())
            return FleetView(self._snapshot.replicas, now)
        return FleetView(self._board.current(), now)

    # ------------------------------------------------------------------ handlers

    def _arrive(self, index: int) -> None:
        """Request ``index`` reaches the router (streamed by the event loop, in arrival order)."""
        now = self.loop.now
        request = self._requests[index]
        view = request.view
        fleet = self.fleet_view(now)
        serving = self._serving
        allowed: frozenset[str] | None = None
        if serving is not None:
            allowed = serving.get(view.identity.model)
            if allowed is None:
                raise ConfigError(f"no replica serves the model {view.identity.model!r} of "
                                  f"request {request.request_id}; serving: {sorted(serving)}")
            fleet = fleet.restrict(allowed)
        if self._measuring:
            meter = self._meters.get(self._speed_key(request))
            if meter is not None:  # routes on its model's measured speeds, as behind a gateway
                if self._timed is not None:
                    self._timed.cost = meter[0].model()
                if self._per_model:
                    speed = meter[1].speed
                    fleet = FleetView(tuple(load.at_speed(speed(load.replica_id))
                                            for load in fleet.replicas), fleet.now)
        decision = self.policy.route(view, fleet)
        if decision is None:
            raise ConfigError("the policy found no eligible replica; check tenant pins")
        replica = self._by_id.get(decision.replica)
        assert replica is not None, f"policy chose unknown replica {decision.replica!r}"
        assert allowed is None or decision.replica in allowed, (
            f"{self.policy.name} sent a {view.identity.model!r} request to "
            f"{decision.replica}, which does not serve it")
        self.policy.on_routed(view, decision, now)
        job = Job(request, decision.branch, decision.predicted_cached_tokens)
        if self._measuring:
            job.sent = self._what_was_sent(request, replica, decision.predicted_cached_tokens)
        replica.enqueue(job, now)

    def _on_speed_change(self, event: SpeedChange) -> None:
        replica = self.replicas[event.replica]
        replica.set_prefill_speed(event.speed)
        if self.config.speed_view == "known":  # told at once, as by a new weight=
            replica.set_router_speed(event.speed)

    def _on_prefill_done(self, event: PrefillDone) -> None:
        self.replicas[event.replica].prefill_done(event.job, self.loop.now)

    def _on_finish(self, event: Finish) -> None:
        self.replicas[event.replica].finish(event.job, self.loop.now)

    def _on_first_byte(self, event: FirstByte) -> None:
        self.replicas[event.replica].first_byte(event.estimate)

    def _on_last_byte(self, event: LastByte) -> None:
        replica = self.replicas[event.replica]
        replica.last_byte()
        self.policy.on_finished(event.job.request.view, replica.replica_id, self.loop.now)

    def _on_kv_delivery(self, event: KvDelivery) -> None:
        self.policy.on_kv_event(event.event)

    def _on_snapshot(self, event: LoadSnapshot) -> None:
        now = self.loop.now
        self._snapshot = FleetView(self._board.current(), now)
        if self.loop_has_work():
            self.loop.schedule(now + self.config.load_lag_s, LoadSnapshot())
        else:
            self._snapshot = None

    def loop_has_work(self) -> bool:
        return len(self.loop) > 0

    # ------------------------------------------------------------------ measured speeds

    def _what_was_sent(self, request: SimRequest, replica: Replica,
                       predicted: int) -> tuple[int, int, int, str]:
        """What the router knew as it sent ``request`` to ``replica`` (the gateway's
        ``Router.committed``): the load before it joins (requests, tokens), its own uncached
        tokens, whose speeds it measures. O(1)."""
        key = self._speed_key(request)
        load = replica.load()
        speed = replica.router_speed
        if self._per_model:
            meter = self._meters.get(key)
            speed = 1.0 if meter is None else meter[1].speed(replica.replica_id)
            load = load.at_speed(speed)
        own = int(max(request.prompt_len - predicted, 0) / speed)
        return load.queued_requests, load.queued_prefill_tokens, own, key

    def _speed_key(self, request: SimRequest) -> str:
        """Whose speeds ``request`` is timed with: its model's (one for all without models)."""
        return request.view.identity.model if self.config.models is not None else ""

    def _first_token(self, job: Job, index: int, now: float) -> None:
        """Replica ``index`` ended ``job``'s prefill at ``now``: one sample of its speed
        (the gateway's ``Router.first_token``). O(replicas of the request's model)."""
        request = job.request
        assert job.sent is not None, f"request {request.request_id} was not timed as sent"
        ahead, tokens_ahead, own, key = job.sent
        seconds = now + self.config.first_byte_lag_s - request.arrival_s
        meter = self._meters.get(key)
        if meter is None:
            meter = self._meters[key] = (PrefillFit(self._prior), RelativeSpeeds())
        fit, speeds = meter
        observe_first_token(fit, speeds, self.replicas[index].replica_id,
                            PrefillSample(ahead, tokens_ahead, own, seconds))
        if not self._per_model:  # every replica: one not yet timed is assumed the fastest
            speed = speeds.speed
            for replica in self.replicas:
                replica.set_router_speed(speed(replica.replica_id))

    def measured_speeds(self, model: str = "") -> dict[str, float]:
        """Each replica's speed as the router believes it now for requests of ``model``
        (ignored without ``FleetConfig.models``; 1.0 before any first token, and the fastest
        timed replica's for one not yet timed: :class:`~kvreuse.routing.RelativeSpeeds`).
        O(replicas)."""
        if not self._per_model:
            return {replica.replica_id: replica.router_speed for replica in self.replicas}
        meter = self._meters.get(model)
        return {replica.replica_id: 1.0 if meter is None else meter[1].speed(replica.replica_id)
                for replica in self.replicas}

    # ------------------------------------------------------------------ callbacks

    def _publish(self, event: KvEvent) -> None:
        lag = self.config.kv_event_lag_s
        assert lag is not None
        self.loop.schedule(self.loop.now + lag, KvDelivery(event))

    def _finished(self, job: Job, replica: int, now: float) -> None:
        request = job.request
        if not self._finish_heard_late:
            self.policy.on_finished(request.view, self.replicas[replica].replica_id, now)
        self._records.append(
            RequestRecord(
                request.request_id,
                replica,
                request.arrival_s,
                request.prompt_len,
                job.cached,
                job.prefill_end - request.arrival_s,
                now - request.arrival_s,
                job.branch,
                job.predicted,
                request.tenant,
                request.measured,
            )
        )
        if self._prefill_s is not None:
            self._prefill_s[request.request_id] = job.prefill_s
        if self._progress is not None and len(self._records) % self._progress_every == 0:
            self._progress(len(self._records))
