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

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

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
from kvreuse.tokens import TokenBuffer, num_tokens


@dataclass(frozen=True, slots=True)
class Candidate:
    """An upstream to try, why, and how many prompt tokens it is predicted to hold."""

    upstream: UpstreamState
    branch: str
    predicted_cached_tokens: int


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
    ) -> None:
        self.policy = policy
        self.upstreams = {u.name: u for u in upstreams}
        self.tokenizer = tokenizer
        self.cost = cost or CostModel()
        self.clock = clock
        self.indexes = {u.name: EventIndex(u.name) for u in upstreams if u.config.events}
        self.streams = {name: StreamStats() for name in self.indexes}
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
        first = Candidate(chosen, decision.branch, self._predicted(request, decision))
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
        for negated, _, _, upstream in ranked[: limit - 1]:
            yield Candidate(upstream, "retry", -negated)

    def _index_match(self, request: RequestView, name: str) -> int:
        index = self.indexes.get(name)
        return 0 if index is None else index.match(request.tokens, request.identity)

    def _predicted(self, request: RequestView, decision: RoutingDecision) -> int:
        """Exact when the upstream publishes events (vLLM's own hit rule on its real
        contents), else the policy's own guess."""
        index = self.indexes.get(decision.replica)
        if index is None:
            return decision.predicted_cached_tokens
        return index.match(request.tokens, request.identity)

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
        for event in batch.events:
            applied = index.apply(event, now)
            stats.orphan_blocks += applied.orphan_blocks
            stats.unknown_removals += applied.unknown_removals
            stats.ignored_events += applied.ignored
            for routing_event in applied.routing_events:
                self.policy.on_kv_event(routing_event)

    def mark_cold(self, upstream: str, reason: str) -> None:
        """Forget what ``upstream`` holds: its events can no longer be trusted to be complete."""
        self.indexes[upstream].reset()
        self.policy.on_kv_event(KvCleared(upstream, self.clock()))

    def index_size(self, upstream: str) -> IndexSize:
        index = self.indexes.get(upstream)
        if index is None:
            return IndexSize()
        return IndexSize(index.num_blocks, index.cached_tokens)
