"""The one place the lab calls the simulator (:mod:`kvreuse.sim`, :mod:`kvreuse.routing`).

A run of the lab is a run of one of the simulator's named chat scenarios with the page's
controls applied on top:

* traffic: the scenario's :class:`~kvreuse.sim.workloads.ChatWorkload`, its tenants' rates scaled
  so they add up to ``arrival_rate``, ``duration_s`` measured seconds after the scenario's
  warm-up, and the timestamp of mission two at ``timestamp_at`` when set;
* replicas: the scenario's replica config with ``cache_tokens`` as the KV pool, prefix caching
  on or off, and the scheduling policy;
* router: the named policy from :data:`kvreuse.routing.POLICIES` with the scenario's options for
  it, plus ``spill_threshold_s`` for the policies that take one.

What the page animates is read while the simulator runs, through :class:`_Watcher`, a routing
policy that wraps the real one: every arrival passes through ``route``, which is where replica
1's tree is copied at mid-run and where evictions are sampled each simulated second. It observes
only; every decision is the wrapped policy's. The page's clock is the measured window: t = 0 is
the end of the warm-up.

``route`` is also where a run is cancelled: the server sets the run's cancel event when its
client disconnects, and the next arrival raises :class:`~kvreuse.web.controls.RunCancelled`, so
an abandoned run stops within one simulated arrival (or once its traffic is generated, if it
is still doing that) instead of holding its slot and a core to the end (before: ten largest runs
posted and hung up on at once cost the server 25 CPU s and every other client a 503 for ~30 s).
"""

from __future__ import annotations

import bisect
import math
import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.index import RadixIndex
from kvreuse.routing import DESCRIPTIONS, POLICIES, build_policy
from kvreuse.routing.base import FleetView, RequestView, RoutingDecision, RoutingPolicy
from kvreuse.routing.events import KvEvent
from kvreuse.sim import SCHEDULERS, ChatWorkload, FleetSimulator, SimRequest, summarize
from kvreuse.sim.replica import Replica
from kvreuse.sim.requests import FleetRun
from kvreuse.sim.scenarios import BELGAVI, SCENARIOS, SURGE, Scenario
from kvreuse.sim.summary import percentile, prefill_cost_s
from kvreuse.tokens import TOKEN_BYTES
from kvreuse.web.controls import LIMITS, ControlChoices, LabControls, RunCancelled
from kvreuse.web.missions import MISSIONS, Mission, check_goal
from kvreuse.web.result import (
    LabResult,
    RequestColumns,
    Tiles,
    TimelinePoint,
    TreeSnapshot,
)
from kvreuse.web.tree import Segment, SegmentMap, snapshot_tree

LAB_TRAFFIC: dict[str, ChatWorkload] = {
    "belgavi": BELGAVI,
    "mission-1": BELGAVI,
    "mission-2": BELGAVI,
    "mission-3": BELGAVI,
    "mission-4": SURGE,
}
"""The simulator's chat scenarios the lab can run, with their traffic. (Mission two's timestamp
is the lab's ``timestamp_at`` control, so the player can move it.)"""

SCHEDULING_DESCRIPTIONS = {
    "fcfs": "first come, first served",
    "lpm": "longest cached prefix first; fcfs when more than 128 requests wait (SGLang)",
}

TREE_REPLICA = 0
"""The page draws "replica 1", the simulator's ``r0``."""


@dataclass(frozen=True, slots=True)
class LabRun:
    """A lab run's inputs, resolved: what :meth:`SimLab.run` simulates."""

    scenario: Scenario
    workload: ChatWorkload
    requests: tuple[SimRequest, ...]
    policy_options: Mapping[str, Any]


class _Watcher:
    """A routing policy that forwards everything to ``inner`` and, on each arrival, takes the
    samples the page needs (see the module docstring). O(1) per arrival except at the tree
    snapshot and at whole seconds."""

    def __init__(
        self,
        inner: RoutingPolicy,
        segments: SegmentMap,
        warmup_s: float,
        snapshot_at_s: float | None,
        cancel: threading.Event | None = None,
    ) -> None:
        self.inner = inner
        self.cancel = cancel
        self.name = inner.name
        self.uses_kv_events = inner.uses_kv_events
        self.segments = segments
        self.warmup_s = warmup_s
        self.snapshot_at_s = snapshot_at_s
        self.replicas: Sequence[Replica] = ()
        self.tree: TreeSnapshot | None = None
        self.evicted_at: list[tuple[float, int]] = []  # (simulated time, fleet total)
        self._next_sample = warmup_s

    def route(self, request: RequestView, fleet: FleetView) -> RoutingDecision | None:
        RunCancelled.raise_if_set(self.cancel)
        now = fleet.now
        if now >= self._next_sample and self.replicas:
            evicted = sum(r.evicted_tokens for r in self.replicas)
            while now >= self._next_sample:
                self.evicted_at.append((self._next_sample, evicted))
                self._next_sample += 1.0
        if self.snapshot_at_s is not None and now >= self.snapshot_at_s and self.replicas:
            replica = self.replicas[TREE_REPLICA]
            # Only a radix cache is a tree; the lab's replicas are radix (the sim default).
            if isinstance(replica.cache, RadixIndex):
                self.tree = snapshot_tree(
                    replica.cache, self.segments, replica.replica_id, now - self.warmup_s
                )
            self.snapshot_at_s = None
        return self.inner.route(request, fleet)

    def on_routed(self, request: RequestView, decision: RoutingDecision, now: float) -> None:
        self.inner.on_routed(request, decision, now)

    def on_finished(self, request: RequestView, replica: str, now: float) -> None:
        self.inner.on_finished(request, replica, now)

    def on_kv_event(self, event: KvEvent) -> None:
        self.inner.on_kv_event(event)


def chat_segments(requests: Sequence[SimRequest], system_tokens: int) -> SegmentMap:
    """Token-id intervals of each segment kind in a chat workload's requests.

    Every id block comes from the workload's counter, so a segment is one run of consecutive
    ids: the system prompt is ``system_tokens`` ids starting at the prompt's first id (a
    timestamp overwrites a few of them with ids outside every interval), each answer is
    ``request.output``, and the user message is the prompt's tail after the system prompt and
    the conversation's history (earlier user messages and answers). O(requests).
    """
    segments: list[Segment] = []
    history: dict[str | None, int] = {}
    for request in requests:
        tokens = request.tokens
        # Position 0 may be a timestamp; a system prompt is consecutive ids either way.
        probe = next(
            p
            for p in (0, system_tokens - 1)
            if p < request.prompt_len and _token_at(tokens, p) < 2**31
        )
        segments.append(Segment(_token_at(tokens, probe) - probe, system_tokens, "system"))
        before = history.get(request.session_id, 0)
        user_len = request.prompt_len - system_tokens - before
        if user_len > 0:
            first_user = _token_at(tokens, request.prompt_len - user_len)
            segments.append(Segment(first_user, user_len, "user"))
        if request.output is not None and request.output_len > 0:
            segments.append(Segment(_token_at(request.output, 0), request.output_len, "answer"))
        history[request.session_id] = before + max(user_len, 0) + request.output_len
    return SegmentMap(segments)


def _token_at(tokens: bytes, position: int) -> int:
    at = position * TOKEN_BYTES
    return int.from_bytes(tokens[at : at + TOKEN_BYTES], "little")


class SimLab:
    """The real simulator behind the lab's API (:class:`kvreuse.web.app.LabRunner`)."""

    def choices(self) -> ControlChoices:
        return ControlChoices(
            scenarios=tuple(name for name in LAB_TRAFFIC if name in SCENARIOS),
            routing=tuple(POLICIES),
            scheduling=tuple(SCHEDULERS),
            missions=tuple(MISSIONS),
        )

    def descriptions(self) -> Mapping[str, Mapping[str, str]]:
        return {
            "scenario": {name: SCENARIOS[name].summary for name in self.choices().scenarios},
            "routing": dict(DESCRIPTIONS),
            "scheduling": dict(SCHEDULING_DESCRIPTIONS),
        }

    def defaults(self) -> LabControls:
        return LabControls()

    def missions(self) -> Mapping[str, Mission]:
        return MISSIONS

    # ------------------------------------------------------------------ running

    def prepare(self, controls: LabControls) -> LabRun:
        """Resolve ``controls`` into the simulator's objects and generate the traffic.

        Raises :class:`InputFormatError` naming the control when the combination cannot run
        (a timestamp outside the system prompt, a pool smaller than one request)."""
        scenario = SCENARIOS[controls.scenario]
        base = LAB_TRAFFIC[controls.scenario]
        total_rate = sum(t.rate_rps for t in base.tenants)
        factor = controls.arrival_rate / total_rate
        workload = replace(
            base,
            tenants=tuple(replace(t, rate_rps=t.rate_rps * factor) for t in base.tenants),
            duration_s=controls.duration_s,
            volatile_at=controls.timestamp_at,
            volatile_from_s=0.0,
        )
        if controls.timestamp_at is not None and not (
            controls.timestamp_at <= workload.system_tokens - workload.volatile_tokens
        ):
            raise InputFormatError(
                f"the timestamp must sit inside the {workload.system_tokens}-token system "
                f"prompt: at most {workload.system_tokens - workload.volatile_tokens}, got "
                f"{controls.timestamp_at}",
                where="timestamp_at",
            )
        planned = controls.arrival_rate * (workload.warmup_s + controls.duration_s)
        if planned > LIMITS.max_requests:
            raise InputFormatError(
                f"this run would simulate about {planned:,.0f} requests ({controls.arrival_rate:g} "
                f"req/s for {workload.warmup_s:g} s of warm-up and {controls.duration_s:g} s "
                f"measured); the lab's limit is {LIMITS.max_requests:,}: lower arrival_rate or "
                "duration_s (kvreuse simulate runs bigger fleets)",
                where="duration_s",
            )
        requests = tuple(workload.generate(controls.seed))
        need = max((r.prompt_len + r.output_len for r in requests), default=0)
        if need > controls.cache_tokens:
            raise InputFormatError(
                f"the largest request needs {need} tokens of KV (prompt + answer) but a "
                f"replica's pool is {controls.cache_tokens}; raise it to at least {need}",
                where="cache_tokens",
            )
        options = dict(scenario.policy_options.get(controls.routing, {}))
        return LabRun(scenario, workload, requests, options)

    def _policy(self, controls: LabControls, options: Mapping[str, Any]) -> RoutingPolicy:
        rng = random.Random(controls.seed)
        try:
            return build_policy(
                controls.routing, rng=rng, spill_threshold_s=controls.spill_threshold_s, **options
            )
        except ConfigError:
            # The policy has no spill rule (round robin, prefix hash, ...): the control is moot.
            return build_policy(controls.routing, rng=random.Random(controls.seed), **options)

    def run(self, controls: LabControls, cancel: threading.Event | None = None) -> LabResult:
        """Simulate ``controls`` and collect what the page draws. Deterministic per controls.
        Raises :class:`RunCancelled` soon after ``cancel`` is set."""
        started = time.perf_counter()
        prepared = self.prepare(controls)
        # Traffic generation is one call (~1 s of a largest run's ~2.2 CPU s): check between.
        RunCancelled.raise_if_set(cancel)
        scenario, workload = prepared.scenario, prepared.workload
        fleet = scenario.fleet(controls.replicas, "")
        fleet = replace(
            fleet,
            replicas=controls.replicas,
            replica=replace(
                fleet.replica,
                pool_tokens=controls.cache_tokens,
                prefix_caching=controls.cache_enabled,
                scheduling=controls.scheduling,
            ),
        )
        warmup = workload.warmup_s
        watcher = _Watcher(
            self._policy(controls, prepared.policy_options),
            chat_segments(prepared.requests, workload.system_tokens),
            warmup,
            warmup + controls.duration_s / 2 if controls.cache_enabled else None,
            cancel,
        )
        simulator = FleetSimulator(fleet, watcher)
        watcher.replicas = simulator.replicas
        run = simulator.run(prepared.requests)
        summary = summarize(run)
        tiles = Tiles(
            token_hit_rate=summary.token_hit_rate,
            request_hit_rate=summary.request_hit_rate,
            prefill_gpu_s_per_1k=summary.prefill_gpu_s_per_1k,
            ttft_p95_s=summary.ttft_p95_s,
            evicted_tokens=summary.evicted_tokens,
            replicas=controls.replicas,
        )
        mission = MISSIONS.get(controls.mission) if controls.mission else None
        return LabResult(
            controls=controls,
            replica_ids=tuple(r.replica_id for r in simulator.replicas),
            requests=_columns(run, warmup),
            timeline=_timeline(run, warmup, controls.duration_s, watcher.evicted_at),
            tiles=tiles,
            tree=watcher.tree,
            goal=None if mission is None else check_goal(mission, controls, tiles.as_dict()),
            sim_wall_s=time.perf_counter() - started,
        )


def _columns(run: FleetRun, warmup_s: float) -> RequestColumns:
    """Measured requests in arrival order, times on the page's clock."""
    records = sorted((r for r in run.records if r.measured), key=lambda r: r.arrival_s)
    return RequestColumns(
        arrival_s=tuple(r.arrival_s - warmup_s for r in records),
        replica=tuple(r.replica for r in records),
        prompt_tokens=tuple(r.prompt_tokens for r in records),
        cached_tokens=tuple(r.cached_tokens for r in records),
        ttft_s=tuple(r.ttft_s for r in records),
    )


def _timeline(
    run: FleetRun,
    warmup_s: float,
    duration_s: float,
    evicted_at: Sequence[tuple[float, int]],
) -> tuple[TimelinePoint, ...]:
    """The tiles after each whole simulated second: over measured requests that arrived by
    then (the same definitions as :func:`kvreuse.sim.summarize`), evictions since the start of
    the run. O(n log n + seconds)."""
    records = sorted((r for r in run.records if r.measured), key=lambda r: r.arrival_s)
    replicas = run.config.replicas
    sample_times = [t for t, _ in evicted_at]
    final_evicted = sum(run.evicted_tokens)
    points = []
    ttfts: list[float] = []
    prompt = cached = hits = 0
    gpu_s = 0.0
    pos = 0
    for second in range(1, math.ceil(duration_s) + 1):
        until = warmup_s + second
        while pos < len(records) and records[pos].arrival_s < until:
            record = records[pos]
            prompt += record.prompt_tokens
            cached += record.cached_tokens
            hits += record.cached_tokens > 0
            gpu_s += prefill_cost_s(run, record)
            bisect.insort(ttfts, record.ttft_s)
            pos += 1
        at = bisect.bisect_right(sample_times, until) - 1
        evicted = evicted_at[at][1] if at >= 0 and sample_times[at] == until else final_evicted
        count = len(ttfts)
        points.append(
            TimelinePoint(
                float(second),
                Tiles(
                    token_hit_rate=cached / prompt if prompt else 0.0,
                    request_hit_rate=hits / count if count else 0.0,
                    prefill_gpu_s_per_1k=1000.0 * gpu_s / count if count else 0.0,
                    ttft_p95_s=percentile(ttfts, 0.95),
                    evicted_tokens=evicted,
                    replicas=replicas,
                ),
            )
        )
    return tuple(points)
