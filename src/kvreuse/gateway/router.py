"""The routing core of the gateway: tokens, policy, candidates, and what the policy learns.

A :class:`Router` turns a parsed request into a :class:`Plan`: the request's token ids (as the
engine will see them) and the policy's choice; :meth:`Router.candidates` yields that choice and,
only if it fails before its first byte, the other eligible upstreams as retry candidates
(ordered then, on the loads of that moment, so the common case pays for no ordering). It
tells the policy what was committed (``on_routed``), what finished (``on_finished``) and what
the upstreams' KV events say (``on_kv_event``, translated by each upstream's
:class:`~kvreuse.gateway.event_index.EventIndex`). The policy objects are those of
:mod:`kvreuse.routing`, exactly as the simulator builds them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvreuse.errors import ConfigError
from kvreuse.gateway.event_index import EventIndex
from kvreuse.gateway.kv_events import EventBatch
from kvreuse.gateway.metrics import IndexSize
from kvreuse.gateway.prompts import PromptTokenizer, request_tokens
from kvreuse.gateway.subscriber import StreamStats
from kvreuse.gateway.upstreams import UpstreamState
from kvreuse.gateway.validation import ParsedRequest
from kvreuse.identity import CacheIdentity
from kvreuse.routing import (
    CostModel,
    FleetView,
    KvCleared,
    RequestView,
    RoutingDecision,
    RoutingPolicy,
)
from kvreuse.routing.cache_aware import CacheAware
from kvreuse.routing.estimators import ApproxTrees
from kvreuse.routing.index_health import SUSPECT, HealthSettings, IndexHealth
from kvreuse.tokens import TokenBuffer, num_tokens

log = logging.getLogger("kvreuse.gateway.router")

MIN_NEW_BLOCKS_FOR_EVENTS = 2
"""A request whose prefill filled this many new blocks must have made the engine publish
(one block of slack: a recomputed last block may reuse a cached hash)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """An upstream to try, why, and how many prompt tokens it is predicted to hold."""

    upstream: UpstreamState
    branch: str
    predicted_cached_tokens: int
    index_predicted: int | None = None  # the KV-event index's own match, checked on answer


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
    ) -> None:
        self.policy = policy
        self.upstreams = {u.name: u for u in upstreams}
        self.tokenizer = tokenizer
        self.cost = cost or CostModel()
        self.clock = clock
        self.indexes = {u.name: EventIndex(u.name) for u in upstreams if u.config.events}
        self.streams = {name: StreamStats() for name in self.indexes}
        self.health = {name: IndexHealth(health) for name in self.indexes}
        # Upstream name -> when a request that must have made it publish was answered while
        # its events were silent (cleared by the next batch). /ready reports these.
        self.silent_since: dict[str, float] = {}
        self.budgets: dict[str, int] = {}
        self.events_silence_s = 30.0
        self.started_at = clock()
        # Called with an upstream's name when its index turns suspect (the gateway asks that
        # upstream's subscriber to rebuild it from the replay socket).
        self.on_suspect: Callable[[str], None] = lambda name: None
        if isinstance(policy, CacheAware) and policy.mirror is not None:
            # What a suspect upstream is routed on: the prompts sent to it (bounded per
            # upstream by set_budget, like every index here).
            policy.fallback = ApproxTrees()
        if policy.name == "exact" and not self.indexes:
            raise ConfigError(
                "--policy exact routes on KV events: give at least one upstream an events "
                "endpoint (events=tcp://HOST:PORT)"
            )

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
    ) -> Plan | None:
        """Tokenize and route; None when no upstream is eligible (all ejected, or none of the
        tenant's). Raises :class:`InputFormatError` when the prompt cannot be rendered."""
        started = time.perf_counter()
        tokens = self.tokens_for(parsed)
        request = RequestView(
            request_id, tokens, num_tokens(tokens), identity, tenant,
            session_id or parsed.session_id,
        )
        eligible = tuple(
            u for u in self.upstreams.values()
            if u.healthy and (allowed is None or u.name in allowed)
        )
        if not eligible:
            return None
        fleet = FleetView(tuple(u.load() for u in eligible), self.clock())
        decision = self.policy.route(request, fleet)
        if decision is None:
            return None
        chosen = self.upstreams[decision.replica]
        first = self._candidate(chosen, request, decision)
        return Plan(request, first, eligible, time.perf_counter() - started)

    def candidates(self, plan: Plan, limit: int) -> Iterator[Candidate]:
        """At most ``limit`` upstreams to try, in order: the policy's choice, then (computed
        only when asked for, i.e. after the choice failed) the other eligible ones, most
        cached prompt tokens first, then least predicted queueing. O(n log n) for n
        eligible, plus one index match each in exact mode."""
        if limit < 1:
            return
        yield plan.first
        if limit == 1:
            return
        chosen = plan.first.upstream
        ranked = []
        for upstream in plan.eligible:
            if upstream is not chosen and upstream.healthy:
                cached = self._index_match(plan.request, upstream.name)
                ranked.append((-cached, self.cost.queue_delay_s(upstream.load()),
                               upstream.name, upstream))
        ranked.sort(key=lambda entry: entry[:3])
        for negated, _, name, upstream in ranked[: limit - 1]:
            yield Candidate(upstream, "retry", -negated,
                            -negated if name in self.indexes else None)

    def _index_match(self, request: RequestView, name: str) -> int:
        index = self.indexes.get(name)
        return 0 if index is None else index.match(request.tokens, request.identity)

    def _candidate(self, upstream: UpstreamState, request: RequestView,
                   decision: RoutingDecision) -> Candidate:
        """The prediction is exact when the upstream publishes events (vLLM's own hit rule on
        its real contents) and its index is trusted, else the policy's own guess; the index's
        match is kept apart so the answer can check it either way."""
        index = self.indexes.get(decision.replica)
        if index is None:
            return Candidate(upstream, decision.branch, decision.predicted_cached_tokens)
        exact = index.match(request.tokens, request.identity)
        if self.health[decision.replica].suspect:
            return Candidate(upstream, decision.branch, decision.predicted_cached_tokens, exact)
        return Candidate(upstream, decision.branch, exact, exact)

    def realized(self, candidate: Candidate, prompt_tokens: int, cached_tokens: int) -> None:
        """Called when an answer reports its cached tokens: checks the index's prediction
        (suspect / exact transitions, rebuild requests) and whether its events still flow."""
        name = candidate.upstream.name
        health = self.health.get(name)
        if health is None or candidate.index_predicted is None:
            return
        now = self.clock()
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
        if isinstance(self.policy, CacheAware):
            self.policy.suspects = frozenset(self.suspects())

    def committed(self, plan: Plan, candidate: Candidate) -> None:
        """Called when the request is sent to ``candidate``."""
        decision = RoutingDecision(
            candidate.upstream.name, candidate.branch, candidate.predicted_cached_tokens
        )
        self.policy.on_routed(plan.request, decision, self.clock())
        uncached = plan.request.prompt_tokens - candidate.predicted_cached_tokens
        candidate.upstream.request_sent(max(uncached, 0))

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
        for event in batch.events:
            applied = index.apply(event, now)
            stats.orphan_blocks += applied.orphan_blocks
            stats.unknown_removals += applied.unknown_removals
            stats.ignored_events += applied.ignored
            for routing_event in applied.routing_events:
                self.policy.on_kv_event(routing_event)
        stats.trimmed_blocks = index.trimmed_blocks

    def mark_cold(self, upstream: str, reason: str) -> None:
        """Forget what ``upstream`` holds: its events can no longer be trusted to be complete."""
        self.indexes[upstream].reset()
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
                self.policy.on_kv_event(routing_event)
            self.streams[upstream].trimmed_blocks = index.trimmed_blocks
        for trees in self._trees():
            trees.set_capacity(upstream, tokens)

    def _trees(self) -> list[Any]:
        policy: Any = getattr(self.policy, "inner", self.policy)  # TenantPinned wraps one
        found = [getattr(policy, "trees", None), getattr(policy, "fallback", None)]
        return [t for t in found if t is not None and hasattr(t, "set_capacity")]

    def index_size(self, upstream: str) -> IndexSize:
        index = self.indexes.get(upstream)
        if index is not None:
            return IndexSize(index.num_blocks, index.cached_tokens)
        policy: Any = getattr(self.policy, "inner", self.policy)
        trees = getattr(policy, "trees", None)
        if trees is None:
            return IndexSize()
        # The approximate trees count tokens; blocks in the policy's block size, rounded up.
        tokens = int(trees.tree_tokens(upstream))
        block = int(getattr(policy, "block_size", 16)) or 16
        return IndexSize(-(-tokens // block), tokens)
