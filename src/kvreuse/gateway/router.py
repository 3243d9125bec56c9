"""The routing core of the gateway: tokens, policy, candidates, and what the policy learns.

A :class:`Router` turns a parsed request into a :class:`Plan`: the request's token ids (as the
engine will see them) and the policy's choice; :meth:`Router.candidates` yields that choice and,
only if it fails before its first byte, the other eligible upstreams as retry candidates
(ordered then, on the loads of that moment, so the common case pays for no ordering). It
tells the policy what was committed (``on_routed``), what finished (``on_finished``) and what
the upstreams' KV events say (``on_kv_event``, translated by each upstream's
:class:`~kvreuse.routing.event_index.EventIndex`). The policy objects are those of
:mod:`kvreuse.routing`, exactly as the simulator builds them.

Models. A request is routed only among the healthy upstreams that serve its ``model`` (the
policy's :class:`~kvreuse.routing.FleetView` holds just those). An upstream whose models are
not known yet (nothing declared, its ``/v1/models`` unreadable so far) is taken to serve what
no known upstream serves, as before model-aware routing. A model no upstream serves (in the
tenant's subset) is a 404 naming the served models; one whose upstreams are all ejected a 503.

Cache identity. The request's model (its served name) is part of its
:class:`~kvreuse.identity.CacheIdentity`, so the policy's trees, mirror and a shared index keep
one namespace per model. A KV event names no model: an engine that publishes events is one
model, whatever names it is served under (vLLM's ``--served-model-name a b`` share one cache),
so each upstream's :class:`EventIndex` stays model-free and its events reach the policy once per
model the upstream serves; when that set changes the policy forgets the upstream and is told
its current contents again under the new names. LoRA adapters (``/v1/models`` entries with a
``parent``) are models of their own: requests name the adapter, events carry it as
``lora_name``, and each is filed under the other's name.

Prefill speed. A policy that predicts time (:class:`~kvreuse.routing.PredictsTime`) is given,
before each request, the cost model the gateway has measured for the request's model
(:class:`~kvreuse.routing.cost_fit.PrefillFit`, fed by :meth:`Router.first_token` with every
streamed answer's first token), starting from ``cost`` (by default the policy's own);
``learn_prefill=False`` leaves the policy's alone. One fit per served model (models run at their
own speeds), one for requests no known upstream serves; they are bounded by the names upstreams
list. The same first tokens measure each upstream's speed relative to the other upstreams of
the model (:class:`~kvreuse.routing.RelativeSpeeds`, one per fit, so that a model's fit keeps
its own absolute speed): an upstream slower than its model's fit predicts (other hardware, or
one degraded) has its load divided by that speed, as a configured ``weight`` would, and is
sent fewer queued tokens. An upstream not yet timed for a model is weighed at the fastest timed
one's speed, so that it is sent the requests that time it (see RelativeSpeeds). An upstream
serving several models is seen by each model's requests at the speed measured over that model's
fleet (its load is the same queue, weighted per model: one speed would mix fleets normalised
apart; in the simulator, where an upstream serving two models took the speed its last timed
model measured, ``cache_aware`` on the multi-model workload with one replica at a quarter
speed lost 3.5 points of hit rate and reached a p95 of 1.8 s, against 0.86 s per model).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvreuse.errors import ConfigError
from kvreuse.gateway.metrics import IndexSize
from kvreuse.gateway.prompts import PromptTokenizer, request_tokens
from kvreuse.gateway.subscriber import StreamStats
from kvreuse.gateway.telemetry import ThrottledLog
from kvreuse.gateway.upstreams import UpstreamState
from kvreuse.gateway.validation import ParsedRequest, RequestError
from kvreuse.identity import CacheIdentity
from kvreuse.kv_event_codec import EventBatch
from kvreuse.routing import (
    CostModel,
    EstimatorPolicy,
    FleetView,
    KvCleared,
    KvEvent,
    PredictsTime,
    PrefillFit,
    PrefillSample,
    RelativeSpeeds,
    RequestView,
    RoutingDecision,
    RoutingPolicy,
)
from kvreuse.routing.approx_trees import ApproxTrees
from kvreuse.routing.cost_fit import observe_first_token
from kvreuse.routing.event_index import EventIndex
from kvreuse.routing.index_health import SUSPECT, HealthSettings, IndexHealth
from kvreuse.tokens import TokenBuffer, num_tokens

log = logging.getLogger("kvreuse.gateway.router")

MIN_NEW_BLOCKS_FOR_EVENTS = 2
"""A request whose prefill filled this many new blocks must have made the engine publish
(one block of slack: a recomputed last block may reuse a cached hash)."""
MODELS_LISTED = 50
"""Served models a 404 names before it says "and N more"."""
MAX_IDENTITIES = 4096


@dataclass(frozen=True, slots=True)
class Candidate:
    """An upstream to try, why, and how many prompt tokens it is predicted to hold."""

    upstream: UpstreamState
    branch: str
    predicted_cached_tokens: int
    index_predicted: int | None = None  # the KV-event index's own match, checked on answer
    index_epoch: int = 0  # which life of the index predicted it (mark_cold starts a new one)


@dataclass(frozen=True, slots=True)
class Sent:
    """A request as it left for an upstream: when, and the load the policy saw there (in the
    policy's units: weighted), to time its first token against (:meth:`Router.first_token`)."""

    at: float
    requests_ahead: int
    tokens_ahead: int
    uncached_tokens: int
    fit: str  # which PrefillFit: the request's model, or "" (Router.fit_key)
    upstream: str  # whose speed relative to its model's fleet it measures (Router.speeds)


@dataclass(frozen=True, slots=True)
class Plan:
    """A routed request: its view for the policy, the policy's choice, the upstreams it was
    allowed to go to (retry candidates come from these) and the decision's duration."""

    request: RequestView
    first: Candidate
    eligible: tuple[UpstreamState, ...]
    decision_s: float


class Router:
    """See the module docstring. Not thread-safe: one event loop owns it."""

    def __init__(
        self,
        policy: RoutingPolicy,
        upstreams: Sequence[UpstreamState],
        tokenizer: PromptTokenizer,
        *,
        cost: CostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        health: HealthSettings | None = None,
        learn_prefill: bool = True,
    ) -> None:
        self.policy = policy
        self.upstreams = {u.name: u for u in upstreams}
        self.tokenizer = tokenizer
        self.clock = clock
        self.indexes = {u.name: EventIndex(u.name) for u in upstreams if u.config.events}
        self.streams = {name: StreamStats() for name in self.indexes}
        self._health_settings = health
        self.health = {name: IndexHealth(health) for name in self.indexes}
        # Upstream name -> when a request that must have made it publish was answered while
        # its events were silent (cleared by the next batch). /ready reports these.
        self.silent_since: dict[str, float] = {}
        self.budgets: dict[str, int] = {}
        # Bumped by mark_cold: an answer predicted by an index since forgotten says nothing
        # about the index now (a restarted engine's requests in flight, for one).
        self.epochs = dict.fromkeys(self.indexes, 0)
        self.events_silence_s = 30.0
        self.started_at = clock()
        # Called with an upstream's name when its index turns suspect (the gateway asks that
        # upstream's subscriber to rebuild it from the replay socket).
        self.on_suspect: Callable[[str], None] = lambda name: None
        self._overflow_log = ThrottledLog(log, burst=2, interval_s=10.0)
        inner = getattr(policy, "inner", policy)  # TenantPinned wraps one
        # The policy whose cost model the measured prefill speed replaces, if any.
        self._timed = inner if isinstance(inner, PredictsTime) else None
        if cost is None:
            cost = self._timed.cost if self._timed is not None else CostModel()
        self.cost = cost
        self.learn_prefill = learn_prefill
        self.fits: dict[str, PrefillFit] = {}
        # Each model's upstreams' speeds over that model's (keys as self.fits).
        self.speeds: dict[str, RelativeSpeeds] = {}
        # Per key of self.speeds, the speed its untimed upstreams are weighed at; every
        # upstream holds this very mapping (UpstreamState.assumed_speeds).
        self.assumed_speeds: dict[str, float] = {}
        for upstream in upstreams:
            upstream.assumed_speeds = self.assumed_speeds
        # The policy holding a cache estimator (a shared index may replace it), if any.
        self.estimating = inner if isinstance(inner, EstimatorPolicy) else None
        self._healable = (self.estimating if self.estimating is not None
                          and self.estimating.uses_kv_events else None)
        if self._healable is not None:
            # What a suspect upstream is routed on: the prompts sent to it (bounded per
            # upstream by set_budget, like every index here).
            self._healable.fallback = ApproxTrees()
        if policy.uses_kv_events and not self.indexes:
            raise ConfigError(
                f"--policy {policy.name} routes on KV events: give at least one upstream an "
                "events endpoint (events=tcp://HOST:PORT)"
            )
        self._by_model: dict[str, tuple[UpstreamState, ...]] = {}
        self._unknown: tuple[UpstreamState, ...] = ()
        self._identities: dict[tuple[str, str | None], CacheIdentity] = {}
        self._modeled: dict[tuple[CacheIdentity, str], CacheIdentity] = {}
        self._model_free: dict[tuple[CacheIdentity, bool], CacheIdentity] = {}
        self._rebuild_models()

    # ------------------------------------------------------------------ membership

    def add_upstream(self, upstream: UpstreamState, budget: int) -> None:
        """Route to ``upstream`` (added at runtime) from now on, once it is healthy; its
        KV-event index starts empty and its indexes are bounded to ``budget`` tokens. The
        caller checked that the name is new. O(upstreams) to re-file the served models."""
        assert upstream.name not in self.upstreams, f"upstream {upstream.name} added twice"
        name = upstream.name
        self.upstreams[name] = upstream
        upstream.assumed_speeds = self.assumed_speeds  # untimed: weighed at the fastest timed
        if upstream.config.events:
            self.indexes[name] = EventIndex(name)
            self.streams[name] = StreamStats()
            self.health[name] = IndexHealth(self._health_settings)
            self.epochs[name] = self.epochs.get(name, 0) + 1
        self._rebuild_models()
        self.set_budget(name, budget)

    def remove_upstream(self, name: str) -> UpstreamState:
        """Never route to ``name`` again (requests already sent there finish, or fail over,
        as usual) and free what was kept for it: its KV-event index and the policy's trees of
        it (emptied through a budget of 0). What stays is a few counters per name in the
        policy. O(index + upstreams)."""
        upstream = self.upstreams.pop(name)
        upstream.removed = True
        upstream.healthy = False
        if self.estimating is not None:
            for trees in (self.estimating.estimator, getattr(self.estimating, "fallback", None)):
                if isinstance(trees, ApproxTrees):
                    trees.set_capacity(name, 0)
        if self.indexes.pop(name, None) is not None:
            self.policy.on_kv_event(KvCleared(name, self.clock()))
        for table in (self.streams, self.health, self.budgets, self.silent_since):
            table.pop(name, None)
        for key, speeds in self.speeds.items():
            speeds.forget(name)
            self._apply_speeds(key, speeds)
        self._rebuild_models()
        return upstream

    # ------------------------------------------------------------------ models

    def _rebuild_models(self) -> None:
        by_model: dict[str, list[UpstreamState]] = {}
        unknown = []
        for upstream in self.upstreams.values():
            if upstream.models is None:
                unknown.append(upstream)
            else:
                for model in upstream.models:
                    by_model.setdefault(model, []).append(upstream)
        self._by_model = {model: tuple(ups) for model, ups in by_model.items()}
        self._unknown = tuple(unknown)

    def models_changed(self, upstream: UpstreamState, before: frozenset[str] | None) -> None:
        """Called after ``upstream``'s served models changed from ``before``: routing uses
        the new set from now on, and the policy re-learns the upstream's KV-event contents
        under the new names (O(index) when the upstream publishes events)."""
        self._rebuild_models()
        index = self.indexes.get(upstream.name)
        if index is None:
            return
        now = self.clock()
        snapshot = index.routing_snapshot(now)
        if snapshot is None:
            self._overflowed(upstream.name, "its index is too fragmented to re-tell")
            return
        self.policy.on_kv_event(KvCleared(upstream.name, now))
        for event in snapshot:
            self._tell_policy(upstream, event)

    def served_models(self, allowed: Sequence[str] | None = None) -> list[str]:
        """Every model a known upstream (of ``allowed``) serves, sorted."""
        return sorted(model for model, ups in self._by_model.items()
                      if allowed is None or any(u.name in allowed for u in ups))

    def serving(self, model: str, allowed: Sequence[str] | None = None
                ) -> tuple[UpstreamState, ...]:
        """The upstreams (of ``allowed``) that serve ``model``, healthy or not; upstreams of
        unknown models when no known one does. Raises a 404 :class:`RequestError` listing
        the served models when there are none, a 503 when the gateway has no upstream at all
        (a fleet discovered in DNS that scaled to zero or is not found yet: a client should
        retry, not give up on the model). O(upstreams of the model)."""
        if not self.upstreams:
            raise RequestError("this gateway has no upstream now (none configured, and DNS "
                               "discovery has found none): try again later", None, 503)
        serving = self._by_model.get(model) or self._unknown
        if allowed is not None:
            serving = tuple(u for u in serving if u.name in allowed)
        if not serving:
            raise RequestError(self._not_served(model, allowed), "model", 404)
        return serving

    def _not_served(self, model: str, allowed: Sequence[str] | None) -> str:
        served = self.served_models(allowed)
        shown = ", ".join(served[:MODELS_LISTED]) or "none"
        if len(served) > MODELS_LISTED:
            shown += f" and {len(served) - MODELS_LISTED} more"
        asked = model if len(model) <= 200 else model[:200] + "..."
        return (f"the model {asked!r} is not served here; served models: {shown} "
                f"(GET /v1/models lists them)")

    def identity(self, model: str, salt: str | None) -> CacheIdentity:
        """The cache identity of a request for ``model`` with ``salt``; one object per pair,
        reused, so indexes can compare identities by ``is``. O(1)."""
        key = (model, salt)
        identity = self._identities.get(key)
        if identity is None:
            if len(self._identities) >= MAX_IDENTITIES:  # caller-chosen salts are unbounded
                self._identities.clear()
            identity = self._identities[key] = CacheIdentity(model=model, cache_salt=salt)
        return identity

    # ------------------------------------------------------------------ requests

    def tokens_for(self, parsed: ParsedRequest) -> TokenBuffer:
        """The prompt's token ids, as the engine will tokenize it."""
        return request_tokens(self.tokenizer, parsed)

    def plan(
        self,
        parsed: ParsedRequest,
        request_id: str,
        identity: CacheIdentity,
        *,
        tenant: str | None = None,
        allowed: Sequence[str] | None = None,
        session_id: str | None = None,
        tokens: TokenBuffer | None = None,
    ) -> Plan | None:
        """Tokenize (unless ``tokens`` are given: :meth:`tokens_for`'s, computed elsewhere) and
        route among the healthy upstreams serving the request's model (of ``allowed``); None
        when all of them are ejected. Raises a 404 :class:`RequestError` when no upstream
        serves the model, :class:`InputFormatError` when the prompt cannot be rendered."""
        started = time.perf_counter()
        eligible = tuple(u for u in self.serving(parsed.model, allowed) if u.healthy)
        if not eligible:
            return None
        # Backups only when no other upstream of the model is admitted; upstreams past their
        # streak of failed requests, kept admitted by the ejection cap (upstreams.py), only
        # when nothing else is. One pass when, as usual, there are neither.
        preferred = tuple(u for u in eligible
                          if not u.config.backup and not u.ejection_withheld)
        if not preferred:
            usable = tuple(u for u in eligible if not u.ejection_withheld) or eligible
            preferred = tuple(u for u in usable if not u.config.backup) or usable
        if tokens is None:
            tokens = self.tokens_for(parsed)
        request = RequestView(
            request_id, tokens, num_tokens(tokens), identity, tenant,
            session_id or parsed.session_id,
        )
        key = self.fit_key(identity.model)
        fleet = FleetView(tuple(u.load(key) for u in preferred), self.clock())
        if self._timed is not None and self.learn_prefill:
            self._timed.cost = self.cost_for(identity.model)
        decision = self.policy.route(request, fleet)
        if decision is None:
            return None
        chosen = self.upstreams[decision.replica]
        first = self._candidate(chosen, request, decision)
        return Plan(request, first, eligible, time.perf_counter() - started)

    def candidates(self, plan: Plan, limit: int) -> Iterator[Candidate]:
        """At most ``limit`` upstreams to try, in order: the policy's choice (unless removed
        since), then (computed only when asked for, i.e. after the choice failed) the other
        eligible ones, most cached prompt tokens first, then least predicted queueing (backups
        after the others, and those kept admitted past their streak of failed requests last).
        O(n log n) for n eligible, plus one index match each in exact mode."""
        if limit < 1:
            return
        if not plan.first.upstream.removed:  # taken out at runtime since the plan was made
            yield plan.first
        if limit == 1:
            return
        chosen = plan.first.upstream
        cost = self.cost_for(plan.request.identity.model)
        key = self.fit_key(plan.request.identity.model)
        ranked = []
        for upstream in plan.eligible:
            if upstream is not chosen and upstream.healthy and not upstream.removed:
                cached = self._index_match(plan.request, upstream.name)
                ranked.append(((upstream.ejection_withheld, upstream.config.backup), -cached,
                               cost.queue_delay_s(upstream.load(key)), upstream.name, upstream))
        ranked.sort(key=lambda entry: entry[:4])
        for _, negated, _, name, upstream in ranked[: limit - 1]:
            yield Candidate(upstream, "retry", -negated,
                            -negated if name in self.indexes else None, self.epochs.get(name, 0))

    def _index_match(self, request: RequestView, name: str) -> int:
        index = self.indexes.get(name)
        if index is None:
            return 0
        upstream = self.upstreams[name]
        return index.match(request.tokens, self._event_identity(request.identity, upstream))

    def _candidate(self, upstream: UpstreamState, request: RequestView,
                   decision: RoutingDecision) -> Candidate:
        """The prediction is exact when the upstream publishes events (vLLM's own hit rule on
        its real contents) and its index is trusted, else the policy's own guess; the index's
        match is kept apart so the answer can check it either way."""
        index = self.indexes.get(decision.replica)
        if index is None:
            return Candidate(upstream, decision.branch, decision.predicted_cached_tokens)
        exact = index.match(request.tokens, self._event_identity(request.identity, upstream))
        epoch = self.epochs[decision.replica]
        if self.health[decision.replica].suspect:
            return Candidate(upstream, decision.branch, decision.predicted_cached_tokens, exact,
                             epoch)
        return Candidate(upstream, decision.branch, exact, exact, epoch)

    def realized(self, candidate: Candidate, prompt_tokens: int, cached_tokens: int) -> None:
        """Called when an answer reports its cached tokens: checks the index's prediction
        (suspect / exact transitions, rebuild requests) and whether its events still flow."""
        name = candidate.upstream.name
        health = self.health.get(name)
        if health is None or candidate.index_predicted is None:
            return
        now = self.clock()
        change = None
        if candidate.index_epoch == self.epochs[name]:
            change = health.observe(candidate.index_predicted, max(cached_tokens, 0), now)
        if change is not None:
            self._suspects_changed()
            if change == SUSPECT:
                log.warning("upstream %s: KV-event index suspect (predicted more cached tokens "
                            "than the engine reported, %.0f%% of them missing); routing it on "
                            "the approximate estimate and rebuilding the index", name,
                            100 * health.window_error())
            else:
                log.warning("upstream %s: KV-event index trusted again (predictions held)",
                            name)
        if health.wants_resync(now):
            health.resync_requested(now)
            self.on_suspect(name)
        index = self.indexes[name]
        block = index.block_size or 16
        new_blocks = prompt_tokens // block - max(cached_tokens, 0) // block
        last = self.streams[name].last_batch_at
        if last is None:
            last = self.started_at
        if (new_blocks >= MIN_NEW_BLOCKS_FOR_EVENTS and name not in self.silent_since
                and now - last > self.events_silence_s):
            self.silent_since[name] = now

    def events_silent(self, name: str) -> bool:
        """True when ``name`` answered a request that must have made it publish, and no batch
        has come since for ``events_silence_s``."""
        since = self.silent_since.get(name)
        if since is None:
            return False
        last = self.streams[name].last_batch_at
        if last is not None and last >= since:
            del self.silent_since[name]
            return False
        return True

    def suspects(self) -> list[str]:
        return [name for name, health in self.health.items() if health.suspect]

    def _suspects_changed(self) -> None:
        if self._healable is not None:
            self._healable.suspects = frozenset(self.suspects())

    def _event_identity(self, identity: CacheIdentity, upstream: UpstreamState
                        ) -> CacheIdentity:
        """A request's namespace in ``upstream``'s event index, which names no model (see the
        module docstring): the model is dropped, and a LoRA adapter's name becomes the
        ``adapter`` its events carry. O(1)."""
        model = identity.model
        if not model:
            return identity
        key = (identity, model in upstream.adapters)
        bare = self._model_free.get(key)
        if bare is None:
            if len(self._model_free) >= MAX_IDENTITIES:
                self._model_free.clear()
            bare = self._model_free[key] = dataclasses.replace(
                identity, model="", adapter=model if key[1] else identity.adapter)
        return bare

    def _with_model(self, identity: CacheIdentity, model: str) -> CacheIdentity:
        """An event index's namespace as requests for ``model`` name it (the adapter, if
        any, is the model itself). O(1)."""
        key = (identity, model)
        modeled = self._modeled.get(key)
        if modeled is None:
            if len(self._modeled) >= MAX_IDENTITIES:
                self._modeled.clear()
            modeled = self._modeled[key] = dataclasses.replace(identity, model=model,
                                                               adapter=None)
        return modeled

    def committed(self, plan: Plan, candidate: Candidate) -> Sent:
        """Called when the request is sent to ``candidate``; what it returns times the first
        token (:meth:`first_token`)."""
        decision = RoutingDecision(
            candidate.upstream.name, candidate.branch, candidate.predicted_cached_tokens
        )
        now = self.clock()
        self.policy.on_routed(plan.request, decision, now)
        uncached = max(plan.request.prompt_tokens - candidate.predicted_cached_tokens, 0)
        upstream = candidate.upstream
        key = self.fit_key(plan.request.identity.model)
        load = upstream.load(key)  # before this request joins the queue
        sent = Sent(now, load.queued_requests, load.queued_prefill_tokens,
                    int(uncached / upstream.weight(key)), key, upstream.name)
        upstream.request_sent(uncached)
        return sent

    # ------------------------------------------------------------------ prefill speed

    def fit_key(self, model: str) -> str:
        """Whose prefill speed a request for ``model`` is timed with: the model's when an
        upstream lists it, else the one fit of requests for models no upstream lists (which
        clients name freely). O(1)."""
        return model if model in self._by_model else ""

    def cost_for(self, model: str) -> CostModel:
        """The cost model for requests for ``model``: the measured one, or the configured one
        before any measurement and with ``learn_prefill`` off. O(1)."""
        fit = self.fits.get(self.fit_key(model)) if self.learn_prefill else None
        return self.cost if fit is None else fit.model()

    def first_token(self, sent: Sent, seconds: float) -> None:
        """Called when an upstream's streamed answer (status 200) sent its first event,
        ``seconds`` after :meth:`committed`: one sample of its model's prefill speed. O(1)."""
        if not self.learn_prefill:
            return
        fit = self.fits.get(sent.fit)
        if fit is None:
            if len(self.fits) > len(self._by_model):  # names upstreams no longer list
                self.fits = {key: kept for key, kept in self.fits.items()
                             if key == "" or key in self._by_model}
                for key in [key for key in self.speeds if key not in self.fits]:
                    del self.speeds[key]
                    self.assumed_speeds.pop(key, None)
                    for upstream in self.upstreams.values():
                        upstream.set_speed(key, None)
            fit = self.fits[sent.fit] = PrefillFit(self.cost)
            self.speeds[sent.fit] = RelativeSpeeds()
        sample = PrefillSample(sent.requests_ahead, sent.tokens_ahead, sent.uncached_tokens,
                               seconds)
        # Not removed since (removal forgets its speed)?
        present = sent.upstream if sent.upstream in self.upstreams else None
        speeds = self.speeds[sent.fit]
        observe_first_token(fit, speeds, present, sample)
        if present is not None:
            self._apply_speeds(sent.fit, speeds)

    def _apply_speeds(self, key: str, speeds: RelativeSpeeds) -> None:
        """The upstreams ``speeds`` (model ``key``'s fleet) has measured have their loads
        divided by those speeds for that model's requests from now on, and the others by the
        fastest measured one's (:meth:`RelativeSpeeds.unmeasured_speed`). O(upstreams of that
        model)."""
        for name, speed in speeds.speeds().items():
            upstream = self.upstreams.get(name)
            if upstream is not None:
                upstream.set_speed(key, speed)
        self.assumed_speeds[key] = speeds.unmeasured_speed()

    def first_byte(self, plan: Plan, candidate: Candidate) -> None:
        uncached = plan.request.prompt_tokens - candidate.predicted_cached_tokens
        candidate.upstream.first_byte(max(uncached, 0))

    def finished(self, plan: Plan, candidate: Candidate) -> None:
        candidate.upstream.request_done()
        self.policy.on_finished(plan.request, candidate.upstream.name, self.clock())

    # ------------------------------------------------------------------ KV events

    def apply_batch(self, upstream: str, batch: EventBatch) -> None:
        """Fold one upstream's event batch into its index and tell the policy."""
        index = self.indexes[upstream]
        stats = self.streams[upstream]
        now = self.clock()
        self.silent_since.pop(upstream, None)
        # One call for the batch: vLLM evicts a prompt as one BlockRemoved per block, tail
        # first, and the index tells such a run as one removal (per event it was O(n^2)
        # tokens: 16,000 blocks held the event loop 16.6 s).
        applied = index.apply_batch(batch.events, now)
        if applied.overflowed:
            self._overflowed(upstream, "one batch of its events would tell more than "
                             f"{index.told_tokens_limit()} tokens of paths")
            return
        stats.orphan_blocks += applied.orphan_blocks
        stats.unknown_removals += applied.unknown_removals
        stats.ignored_events += applied.ignored_events
        for routing_event in applied.routing_events:
            self._tell_policy(self.upstreams[upstream], routing_event)
        stats.trimmed_blocks = index.trimmed_blocks

    def _tell_policy(self, upstream: UpstreamState, event: KvEvent) -> None:
        """One event of ``upstream``'s index, once per base model it serves (see the module
        docstring), or under its LoRA adapter's name; as is while its models are unknown."""
        models = upstream.models
        if isinstance(event, KvCleared) or not models:
            self.policy.on_kv_event(event)
            return
        adapter = event.identity.adapter
        if adapter is not None:
            identity = self._with_model(event.identity, adapter)
            self.policy.on_kv_event(dataclasses.replace(event, identity=identity))
            return
        for model in models:
            if model not in upstream.adapters:
                self.policy.on_kv_event(
                    dataclasses.replace(event, identity=self._with_model(event.identity, model)))

    def _overflowed(self, upstream: str, why: str) -> None:
        """``upstream``'s events cannot be told at a bounded cost (forged, or a stream no
        engine sends): forget what it holds and learn it again from the events that follow
        (no replay: it would bring the same batch back)."""
        self._overflow_log.warning("KV events of %s: %s; its index starts over", upstream, why)
        self.streams[upstream].drop("too_costly")
        self.mark_cold(upstream, why)

    def mark_cold(self, upstream: str, reason: str) -> None:
        """Forget what ``upstream`` holds: its events can no longer be trusted to be complete."""
        self.indexes[upstream].reset()
        self.epochs[upstream] += 1
        self.policy.on_kv_event(KvCleared(upstream, self.clock()))

    def budget_of(self, upstream: str) -> int | None:
        """The last budget :meth:`set_budget` gave ``upstream``."""
        return self.budgets.get(upstream)

    def set_budget(self, upstream: str, tokens: int) -> None:
        """Bound every index kept for ``upstream`` to ``tokens``: its KV-event index, and the
        approximate trees (the policy's, or its fallback) that remember what it was sent."""
        self.budgets[upstream] = tokens
        index = self.indexes.get(upstream)
        if index is not None:
            for routing_event in index.set_budget(tokens):
                self._tell_policy(self.upstreams[upstream], routing_event)
            self.streams[upstream].trimmed_blocks = index.trimmed_blocks
        policy = self.estimating
        if policy is not None:
            for trees in (policy.estimator, getattr(policy, "fallback", None)):
                if isinstance(trees, ApproxTrees):
                    trees.set_capacity(upstream, tokens)

    def index_size(self, upstream: str) -> IndexSize:
        index = self.indexes.get(upstream)
        if index is not None:
            return IndexSize(index.num_blocks, index.cached_tokens)
        policy = self.estimating
        if policy is None:
            return IndexSize()
        # Approximate trees count tokens; blocks in the policy's block size, rounded up.
        tokens = policy.estimator.tree_tokens(upstream)
        block = int(getattr(policy, "block_size", 16)) or 16
        return IndexSize(-(-tokens // block), tokens)
