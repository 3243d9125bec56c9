"""The gateway's Prometheus metrics (one registry per gateway, so tests can run several).

Counters and the decision-latency histogram are updated as requests pass; per-upstream gauges
(health, load, index sizes, event-stream counters, hit rates) are read at scrape time from the
gateway's state by :class:`_StateCollector`.

Predicted vs realized cached tokens: ``predicted_cached_tokens`` and
``realized_cached_tokens`` count the same requests (those whose response carried usage); without
usage, the realized side is ``engine_cached_tokens`` (deltas of the engine's counters).

Token hit rate per upstream, two ways: ``kvreuse_gateway_token_hit_rate`` from the engines'
``usage.prompt_tokens_details.cached_tokens`` over ``usage.prompt_tokens`` of the requests this
gateway saw; ``kvreuse_gateway_engine_token_hit_rate`` from deltas of the engine's own
``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` since the gateway's first
scrape. They agree when the gateway is the engine's only client and every response carries
usage (streams only carry it with ``stream_options.include_usage``).

Request duration and TTFT (``kvreuse_gateway_request_duration_seconds``,
``kvreuse_gateway_time_to_first_byte_seconds``) are histograms by upstream, model and status,
timed from the request's arrival at the gateway; for a non-streamed response the first byte is
the whole answer. Label values are bounded whatever callers send: ``model`` is a model some
upstream has answered with 2xx (at most :data:`MAX_MODEL_LABELS` of them), else ``other``;
``status`` is a common HTTP status or its class (``4xx``).

DNS discovery (``--discover``): ``kvreuse_gateway_discovery_lookups_total{source, outcome}``
and ``kvreuse_gateway_discovered_upstreams{source}``. ``kvreuse_gateway_draining`` is 1 from
SIGTERM on (gateway/serve.py). ``kvreuse_gateway_requests_of_death_total{outcome}`` counts
requests answered 5xx twice and served nowhere (``detected``; ``unavailable`` when the answers
were 502-504, which are not held; ``brought_down`` when two upstreams went down serving it)
and their repeats the gateway answered itself (``held``; gateway/quarantine.py).
``kvreuse_gateway_failures_not_charged_total{reason}`` counts failed attempts no upstream was
charged for: ``timed_out_everywhere`` (an overloaded fleet), ``unavailable`` (every upstream
tried answered 502-504), ``request_of_death`` and ``brought_down``.
``kvreuse_gateway_ejections_withheld_total{upstream}`` counts failed requests that would have
ejected an upstream but for ``--max-ejected-share``. The series of an upstream removed at
runtime are dropped (:meth:`GatewayMetrics.forget_upstream`).

The prefill speed the policies route on, measured per model from streamed answers' first
tokens (:mod:`kvreuse.routing.cost_fit`): ``kvreuse_gateway_prefill_tokens_per_second{model}``,
``kvreuse_gateway_prefill_overhead_seconds{model}`` and ``kvreuse_gateway_prefill_samples``
(``model`` is a name an upstream lists, or ``*`` for the others; absent before the first sample).
``kvreuse_gateway_upstream_prefill_speed{upstream}`` is each upstream's speed measured over
the fleet's as routed on (:class:`~kvreuse.routing.RelativeSpeeds`; 1 until measured; speeds
within a factor 1.5 of one another read as one): a replica at 0.25 is four times slower than
the others and is sent a quarter of the queued tokens.

Also exported: ejections per upstream, the Redis sync counters of a shared index and of a
shared quarantine (:class:`~kvreuse.gateway.shared_index.SyncStats`, as
``kvreuse_gateway_shared_index_*`` and ``kvreuse_gateway_shared_quarantine_*``) when attached, and
prometheus_client's process, platform and GC collectors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    GC_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvreuse.gateway.subscriber import StreamStats
from kvreuse.gateway.upstreams import UpstreamState
from kvreuse.routing.cost_fit import PrefillFit
from kvreuse.routing.index_health import IndexHealth

SUBSCRIBER_STATES = ("idle", "running", "resyncing", "stopped", "failed")

if TYPE_CHECKING:
    from kvreuse.gateway.shared_index import SyncStats

DECISION_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 0.1)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0)
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0, 600.0)
MAX_MODEL_LABELS = 64
OTHER_MODEL = "other"
# Statuses labelled by their code; any other is labelled by its class ("4xx"), so an upstream
# answering odd codes cannot multiply the histograms' series.
LABELLED_STATUSES = frozenset((200, 400, 401, 403, 404, 408, 413, 422, 429, 499, 500, 502, 503,
                               504))


def status_label(status: int) -> str:
    """The ``status`` label value of an HTTP status. O(1)."""
    return str(status) if status in LABELLED_STATUSES else f"{status // 100}xx"


class ModelLabels:
    """Bounds the ``model`` label: a model becomes a label value once an upstream has served
    it (a 2xx answer), up to ``limit`` models; anything else is ``other``. A caller sending
    random model names therefore cannot create series."""

    def __init__(self, limit: int = MAX_MODEL_LABELS) -> None:
        self.limit = limit
        self.served: set[str] = set()

    def served_by_upstream(self, model: str) -> None:
        """An upstream answered a request for ``model`` with 2xx. O(1)."""
        if len(self.served) < self.limit:
            self.served.add(model)

    def label(self, model: str | None) -> str:
        return model if model is not None and model in self.served else OTHER_MODEL


@dataclass(slots=True)
class TokenTally:
    """Per-upstream token accounting from responses."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted_tokens: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


@dataclass(slots=True)
class IndexSize:
    """What the gateway's view of one upstream's cache holds."""

    blocks: int = 0
    tokens: int = 0


@dataclass(slots=True)
class GatewayState:
    """The live objects metrics read at scrape time (filled by the gateway)."""

    upstreams: list[UpstreamState] = field(default_factory=list)
    tallies: dict[str, TokenTally] = field(default_factory=dict)
    streams: dict[str, StreamStats] = field(default_factory=dict)
    index_size: Callable[[str], IndexSize] = lambda name: IndexSize()
    shared_sync: SyncStats | None = None  # set when a Redis-shared index is attached
    quarantine_sync: SyncStats | None = None  # set when --shared-quarantine is attached
    health: dict[str, IndexHealth] = field(default_factory=dict)
    index_budget: Callable[[str], int | None] = lambda name: None
    clock: Callable[[], float] = time.monotonic
    # The router's measured prefill speed per model ("" : models no upstream lists).
    prefill_fits: Callable[[], Mapping[str, PrefillFit]] = lambda: {}


def _gauge(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
    """A gauge family labelled by upstream, then ``labels``."""
    return GaugeMetricFamily(name, doc, labels=["upstream", *labels])


def _counter(name: str, doc: str, *labels: str) -> CounterMetricFamily:
    """A counter family labelled by upstream, then ``labels``."""
    return CounterMetricFamily(name, doc, labels=["upstream", *labels])


class _StateCollector:
    def __init__(self, state: GatewayState) -> None:
        self._state = state

    def collect(self) -> Iterable[Metric]:
        state = self._state
        healthy = _gauge("kvreuse_gateway_upstream_healthy", "1 when admitted, 0 when ejected")
        in_flight = _gauge("kvreuse_gateway_upstream_in_flight", "requests open upstream")
        queued = _gauge("kvreuse_gateway_upstream_queued_prefill_tokens",
                        "predicted uncached prompt tokens not yet answered")
        blocks = _gauge("kvreuse_gateway_index_blocks", "blocks in the gateway's index")
        tokens = _gauge("kvreuse_gateway_index_tokens", "tokens in the gateway's index")
        rate = _gauge("kvreuse_gateway_token_hit_rate", "cached / prompt tokens from usage")
        engine_rate = _gauge("kvreuse_gateway_engine_token_hit_rate",
                             "hits / queries from the engine's /metrics deltas")
        engine_cached = _gauge("kvreuse_gateway_engine_cached_tokens",
                               "vllm:prefix_cache_hits_total since the gateway's first scrape")
        engine_prompt = _gauge("kvreuse_gateway_engine_prompt_tokens",
                               "vllm:prefix_cache_queries_total since the gateway's first scrape")
        kv_usage = _gauge("kvreuse_gateway_upstream_kv_usage",
                          "the engine's vllm:kv_cache_usage_perc at the last scrape")
        speed = _gauge("kvreuse_gateway_upstream_prefill_speed",
                       "prefill speed measured over the fleet's (1: the fleet's; loads are "
                       "divided by it and the configured weight)")
        predicted = _counter("kvreuse_gateway_predicted_cached_tokens",
                             "cached tokens the gateway predicted")
        realized = _counter("kvreuse_gateway_realized_cached_tokens",
                            "cached tokens the engine reported")
        prompt = _counter("kvreuse_gateway_prompt_tokens", "prompt tokens the engine reported")
        for upstream in state.upstreams:
            name = [upstream.name]
            healthy.add_metric(name, 1.0 if upstream.healthy else 0.0)
            in_flight.add_metric(name, upstream.in_flight)
            speed.add_metric(name, upstream.speed)
            queued.add_metric(name, upstream.queued_prefill_tokens)
            size = state.index_size(upstream.name)
            blocks.add_metric(name, size.blocks)
            tokens.add_metric(name, size.tokens)
            tally = state.tallies.get(upstream.name, TokenTally())
            predicted.add_metric(name, tally.predicted_tokens)
            realized.add_metric(name, tally.cached_tokens)
            prompt.add_metric(name, tally.prompt_tokens)
            if tally.hit_rate is not None:
                rate.add_metric(name, tally.hit_rate)
            engine = upstream.engine_hit_rate()
            if engine is not None:
                engine_rate.add_metric(name, engine)
            deltas = upstream.engine_deltas()
            if deltas is not None:
                engine_prompt.add_metric(name, deltas[0])
                engine_cached.add_metric(name, deltas[1])
            if upstream.engine.kv_usage is not None:
                kv_usage.add_metric(name, upstream.engine.kv_usage)
        ejections = _counter("kvreuse_gateway_upstream_ejections", "times the upstream was ejected")
        for upstream in state.upstreams:
            ejections.add_metric([upstream.name], upstream.ejections)
        yield from (healthy, in_flight, queued, blocks, tokens, rate, engine_rate, predicted,
                    realized, prompt, engine_cached, engine_prompt, kv_usage, speed, ejections)
        yield from self._events(state)
        if state.shared_sync is not None:
            yield from self._shared_sync(state.shared_sync, "kvreuse_gateway_shared_index_",
                                         "routed records")
        if state.quarantine_sync is not None:
            yield from self._shared_sync(state.quarantine_sync,
                                         "kvreuse_gateway_shared_quarantine_",
                                         "verdicts on requests of death")
        yield from self._health(state)
        yield from self._prefill(state)

    @staticmethod
    def _prefill(state: GatewayState) -> Iterable[Metric]:
        rate = GaugeMetricFamily(
            "kvreuse_gateway_prefill_tokens_per_second",
            "prefill speed the policies route on, measured from streamed first tokens "
            "(model *: models no upstream lists)", labels=["model"])
        overhead = GaugeMetricFamily(
            "kvreuse_gateway_prefill_overhead_seconds",
            "fixed prefill seconds per request the policies route on", labels=["model"])
        samples = CounterMetricFamily(
            "kvreuse_gateway_prefill_samples", "first tokens timed", labels=["model"])
        for model, fit in sorted(state.prefill_fits().items()):
            label = [model or "*"]
            measured = fit.model()
            rate.add_metric(label, measured.prefill_tokens_per_s)
            overhead.add_metric(label, measured.overhead_s)
            samples.add_metric(label, fit.samples)
        yield from (rate, overhead, samples)

    @staticmethod
    def _shared_sync(stats: SyncStats, prefix: str, what: str) -> Iterable[Metric]:
        for name, value, doc in (
            ("published", stats.published, f"{what} written to Redis"),
            ("received", stats.received, f"other gateways' {what} applied"),
            ("dropped", stats.dropped, f"local {what} not shared (queue full or Redis down)"),
            ("malformed", stats.malformed, "Redis entries skipped as malformed"),
            ("redis_errors", stats.redis_errors, "Redis errors (each retried)"),
            ("streams_reset", stats.streams_reset,
             "streams deleted because an entry at Redis's largest id refused every new one"),
        ):
            yield CounterMetricFamily(prefix + name, doc, value=value)
        yield GaugeMetricFamily(prefix + "connected", "1 while Redis answers",
                                value=1.0 if stats.connected else 0.0)

    @staticmethod
    def _health(state: GatewayState) -> Iterable[Metric]:
        suspect = _gauge(
            "kvreuse_gateway_index_suspect",
            "1 while the KV-event index predicts more cached tokens than the engine reports "
            "(routed on the approximate estimate, rebuilt), else 0")
        error = _gauge("kvreuse_gateway_index_prediction_error",
                       "share of recently predicted cached tokens the engine did not have")
        shortfall = _counter(
            "kvreuse_gateway_index_shortfall_tokens",
            "cached tokens predicted by the KV-event index but not reported by the engine")
        excess = _counter(
            "kvreuse_gateway_index_excess_tokens",
            "cached tokens reported by the engine that the KV-event index did not predict")
        transitions = _counter("kvreuse_gateway_index_state_changes", "suspect/exact transitions")
        budget = _gauge("kvreuse_gateway_index_budget_tokens",
                        "tokens each index kept for the upstream may hold")
        for name, health in state.health.items():
            suspect.add_metric([name], 1.0 if health.suspect else 0.0)
            error.add_metric([name], health.window_error())
            shortfall.add_metric([name], health.shortfall_tokens)
            excess.add_metric([name], health.excess_tokens)
            transitions.add_metric([name], health.transitions)
        for upstream in state.upstreams:
            tokens = state.index_budget(upstream.name)
            if tokens is not None:
                budget.add_metric([upstream.name], tokens)
        yield from (suspect, error, shortfall, excess, transitions, budget)

    @staticmethod
    def _events(state: GatewayState) -> Iterable[Metric]:
        received = _counter("kvreuse_gateway_kv_events_received", "KV events decoded")
        dropped = _counter("kvreuse_gateway_kv_events_dropped",
                           "KV events or batches not applied", "reason")
        gaps = _counter("kvreuse_gateway_kv_event_gaps", "sequence gaps seen", "outcome")
        subscriber = _gauge(
            "kvreuse_gateway_kv_subscriber_state",
            "1 for the KV-event subscriber's current state (idle, running, resyncing, stopped, "
            "failed)", "state")
        age = _gauge("kvreuse_gateway_kv_events_last_age_seconds",
                     "seconds since the last KV-event batch was applied")
        restarts = _counter("kvreuse_gateway_kv_subscriber_restarts",
                            "subscriber loops restarted by the watchdog")
        resyncs = _counter("kvreuse_gateway_kv_index_resyncs",
                           "index rebuilds from the replay socket (suspect index)")
        trimmed = _counter("kvreuse_gateway_index_trimmed_blocks",
                           "blocks forgotten to keep the index within its budget")
        now = state.clock()
        for name, stats in state.streams.items():
            received.add_metric([name], stats.events)
            # Batches by reason (stats.dropped: malformed frames, forged or stale sequence
            # numbers, apply errors), then events inside applied batches.
            for reason, value in (
                *sorted(stats.dropped.items()),
                ("malformed_event", stats.malformed_events),
                ("lost_batch", stats.lost_batches),
                ("orphan_block", stats.orphan_blocks),
                ("unknown_removal", stats.unknown_removals),
                ("other_medium", stats.ignored_events),
            ):
                dropped.add_metric([name, reason], value)
            gaps.add_metric([name, "replayed"], stats.repaired_gaps)
            gaps.add_metric([name, "cold"], stats.gaps - stats.repaired_gaps)
            for known in SUBSCRIBER_STATES:
                subscriber.add_metric([name, known], 1.0 if stats.state == known else 0.0)
            if stats.last_batch_at is not None:
                age.add_metric([name], max(now - stats.last_batch_at, 0.0))
            restarts.add_metric([name], stats.restarts)
            resyncs.add_metric([name], stats.resyncs)
            trimmed.add_metric([name], stats.trimmed_blocks)
        yield from (received, dropped, gaps, subscriber, age, restarts, resyncs, trimmed)


class GatewayMetrics:
    """The registry and the metric objects request handling updates."""

    def __init__(self, state: GatewayState) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "kvreuse_gateway_requests",
            "requests by upstream, policy, decision branch, status and model",
            ["upstream", "policy", "branch", "status", "model"], registry=self.registry,
        )
        self.decision_seconds = Histogram(
            "kvreuse_gateway_routing_decision_seconds",
            "tokenization plus policy decision, per request",
            buckets=DECISION_BUCKETS, registry=self.registry,
        )
        self.retries = Counter(
            "kvreuse_gateway_retries", "requests retried on another upstream before first byte",
            ["upstream"], registry=self.registry,
        )
        self.migrations = Counter(
            "kvreuse_gateway_stream_migrations", "streams broken by an upstream mid-answer, by "
            "what became of them: continued on this upstream, refused by it, or not "
            "continuable (the reason is logged)",
            ["upstream", "outcome"], registry=self.registry,
        )
        self.draining = Gauge(
            "kvreuse_gateway_draining", "1 from SIGTERM until the process exits (/ready is "
            "503, answers close their connections, then the listeners close)",
            registry=self.registry,
        )
        self.discovery_lookups = Counter(
            "kvreuse_gateway_discovery_lookups", "DNS lookups of each --discover name, by "
            "outcome: answered (applied, even when it lists no replica) or failed (nothing "
            "changed)", ["source", "outcome"], registry=self.registry,
        )
        self.discovered = Gauge(
            "kvreuse_gateway_discovered_upstreams", "upstreams each --discover name keeps now",
            ["source"], registry=self.registry,
        )
        self.upstream_errors = Counter(
            "kvreuse_gateway_upstream_errors", "upstream failures by kind",
            ["upstream", "kind"], registry=self.registry,
        )
        self.requests_of_death = Counter(
            "kvreuse_gateway_requests_of_death", "requests answered 5xx twice and served by "
            "no upstream, charging none: detected (then held), unavailable (502-504: not "
            "held); brought_down: stopped after two upstreams went down serving it (then "
            "held); and the repeats the gateway answered itself (held)", ["outcome"],
            registry=self.registry,
        )
        for outcome in ("detected", "unavailable", "brought_down", "held"):
            self.requests_of_death.labels(outcome)
        self.failures_not_charged = Counter(
            "kvreuse_gateway_failures_not_charged", "failed attempts charged to no upstream's "
            "health: timed_out_everywhere (no upstream tried answered in time: an overloaded "
            "fleet), unavailable (all answered 502-504), request_of_death, brought_down (the "
            "request's doing)", ["reason"],
            registry=self.registry,
        )
        for reason in ("timed_out_everywhere", "unavailable", "request_of_death",
                       "brought_down"):
            self.failures_not_charged.labels(reason)
        self.ejections_withheld = Counter(
            "kvreuse_gateway_ejections_withheld", "failed requests that would have ejected the "
            "upstream, which stayed admitted because failed requests already keep "
            "--max-ejected-share of a model's upstreams out of rotation", ["upstream"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "kvreuse_gateway_rejected", "requests refused before routing, by HTTP status and model",
            ["status", "model"], registry=self.registry,
        )
        by = ["upstream", "model", "status"]
        self.duration_seconds = Histogram(
            "kvreuse_gateway_request_duration_seconds",
            "arrival at the gateway to the response's last byte", by,
            buckets=DURATION_BUCKETS, registry=self.registry,
        )
        self.ttft_seconds = Histogram(
            "kvreuse_gateway_time_to_first_byte_seconds",
            "arrival at the gateway to the response's first byte (TTFT for streams)", by,
            buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.models = ModelLabels()
        self.registry.register(_StateCollector(state))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.registry.register(GC_COLLECTOR)
        # labels() hashes and locks on every call; the hot path keeps the children it made.
        self._request_children: dict[tuple[str, str, str, str, str], Any] = {}
        self._rejected_children: dict[tuple[int, str], Any] = {}
        self._timing_children: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    def count_request(self, upstream: str, policy: str, branch: str, status: str,
                      model: str | None) -> None:
        """One finished (or failed) request for ``model`` (bounded: :class:`ModelLabels`).
        O(1)."""
        if status[0] == "2" and model is not None:
            self.models.served_by_upstream(model)
        key = (upstream, policy, branch, status, self.models.label(model))
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(*key)
        child.inc()

    def reject(self, status: int, model: str | None = None) -> None:
        """A request refused before routing, by HTTP status and model (bounded:
        :class:`ModelLabels`; None when the body named none). O(1)."""
        key = (status, self.models.label(model))
        child = self._rejected_children.get(key)
        if child is None:
            child = self._rejected_children[key] = self.rejected.labels(str(status), key[1])
        child.inc()

    def observe_request(self, upstream: str, model: str | None, status: int,
                        ttft_s: float | None, total_s: float) -> None:
        """One answered request's TTFT (when a byte reached the client) and duration. O(1)."""
        if 200 <= status < 300 and model is not None:
            self.models.served_by_upstream(model)
        key = (upstream, self.models.label(model), status_label(status))
        children = self._timing_children.get(key)
        if children is None:
            children = self._timing_children[key] = (self.ttft_seconds.labels(*key),
                                                     self.duration_seconds.labels(*key))
        if ttft_s is not None:
            children[0].observe(ttft_s)
        children[1].observe(total_s)

    def forget_upstream(self, name: str) -> None:
        """Drop every series labelled with upstream ``name`` (removed at runtime): a fleet
        whose replicas come and go under discovery would otherwise keep each departed
        address's series for the life of the process. O(series)."""
        for metric in (self.requests, self.retries, self.migrations, self.upstream_errors,
                       self.ejections_withheld,
                       self.duration_seconds, self.ttft_seconds):
            metric.remove_by_labels({"upstream": name})
        self._request_children = {key: child for key, child in self._request_children.items()
                                  if key[0] != name}
        self._timing_children = {key: children for key, children
                                 in self._timing_children.items() if key[0] != name}
