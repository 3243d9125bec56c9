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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvreuse.gateway.subscriber import StreamStats
from kvreuse.gateway.upstreams import UpstreamState

DECISION_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 0.1)


@dataclass(slots=True)
class TokenTally:
    """Per-upstream token accounting from responses."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted_tokens: int = 0
    requests_with_usage: int = 0

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


class _StateCollector:
    def __init__(self, state: GatewayState) -> None:
        self._state = state

    def collect(self) -> Iterable[Metric]:
        state = self._state
        up = ["upstream"]

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=up)

        healthy = gauge("kvreuse_gateway_upstream_healthy", "1 when admitted, 0 when ejected")
        in_flight = gauge("kvreuse_gateway_upstream_in_flight", "requests open upstream")
        queued = gauge("kvreuse_gateway_upstream_queued_prefill_tokens",
                       "predicted uncached prompt tokens not yet answered")
        blocks = gauge("kvreuse_gateway_index_blocks", "blocks in the gateway's index")
        tokens = gauge("kvreuse_gateway_index_tokens", "tokens in the gateway's index")
        rate = gauge("kvreuse_gateway_token_hit_rate", "cached / prompt tokens from usage")
        engine_rate = gauge("kvreuse_gateway_engine_token_hit_rate",
                            "hits / queries from the engine's /metrics deltas")
        engine_cached = gauge("kvreuse_gateway_engine_cached_tokens",
                              "vllm:prefix_cache_hits_total since the gateway's first scrape")
        engine_prompt = gauge("kvreuse_gateway_engine_prompt_tokens",
                              "vllm:prefix_cache_queries_total since the gateway's first scrape")
        kv_usage = gauge("kvreuse_gateway_upstream_kv_usage",
                         "the engine's vllm:kv_cache_usage_perc at the last scrape")
        predicted = CounterMetricFamily("kvreuse_gateway_predicted_cached_tokens",
                                        "cached tokens the gateway predicted", labels=up)
        realized = CounterMetricFamily("kvreuse_gateway_realized_cached_tokens",
                                       "cached tokens the engine reported", labels=up)
        prompt = CounterMetricFamily("kvreuse_gateway_prompt_tokens",
                                     "prompt tokens the engine reported", labels=up)
        for upstream in state.upstreams:
            name = [upstream.name]
            healthy.add_metric(name, 1.0 if upstream.healthy else 0.0)
            in_flight.add_metric(name, upstream.in_flight)
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
        yield from (healthy, in_flight, queued, blocks, tokens, rate, engine_rate, predicted,
                    realized, prompt, engine_cached, engine_prompt, kv_usage)
        yield from self._events(state)

    @staticmethod
    def _events(state: GatewayState) -> Iterable[Metric]:
        received = CounterMetricFamily("kvreuse_gateway_kv_events_received",
                                       "KV events decoded", labels=["upstream"])
        dropped = CounterMetricFamily("kvreuse_gateway_kv_events_dropped",
                                      "KV events or batches not applied", labels=["upstream",
                                                                                   "reason"])
        gaps = CounterMetricFamily("kvreuse_gateway_kv_event_gaps", "sequence gaps seen",
                                   labels=["upstream", "outcome"])
        for name, stats in state.streams.items():
            received.add_metric([name], stats.events)
            for reason, value in (
                ("malformed_event", stats.malformed_events),
                ("malformed_batch", stats.malformed_batches),
                ("lost_batch", stats.lost_batches),
                ("duplicate_batch", stats.duplicates),
                ("orphan_block", stats.orphan_blocks),
                ("unknown_removal", stats.unknown_removals),
                ("other_medium", stats.ignored_events),
            ):
                dropped.add_metric([name, reason], value)
            gaps.add_metric([name, "replayed"], stats.repaired_gaps)
            gaps.add_metric([name, "cold"], stats.gaps - stats.repaired_gaps)
        yield from (received, dropped, gaps)


class GatewayMetrics:
    """The registry and the metric objects request handling updates."""

    def __init__(self, state: GatewayState) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "kvreuse_gateway_requests", "requests by upstream, policy, decision branch, status",
            ["upstream", "policy", "branch", "status"], registry=self.registry,
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
        self.upstream_errors = Counter(
            "kvreuse_gateway_upstream_errors", "upstream failures by kind",
            ["upstream", "kind"], registry=self.registry,
        )
        self.rejected = Counter(
            "kvreuse_gateway_rejected", "requests refused before routing, by HTTP status",
            ["status"], registry=self.registry,
        )
        self.registry.register(_StateCollector(state))
        # labels() hashes and locks on every call; the hot path keeps the children it made.
        self._request_children: dict[tuple[str, str, str, str], Any] = {}
        self._rejected_children: dict[int, Any] = {}

    def count_request(self, upstream: str, policy: str, branch: str, status: str) -> None:
        """One finished (or failed) request. O(1)."""
        key = (upstream, policy, branch, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(*key)
        child.inc()

    def reject(self, status: int) -> None:
        """A request refused before routing, by HTTP status. O(1)."""
        child = self._rejected_children.get(status)
        if child is None:
            child = self._rejected_children[status] = self.rejected.labels(str(status))
        child.inc()
