"""Upstream state: health (ejection and re-admission), load, and what their /metrics say.

Health, active and passive. Failed probes of ``GET /health`` (a probe that times out while the
upstream is sending answers does not count: ``SATURATED_GRACE_S``) and failed proxied requests
(no first byte within the upstream timeout, 5xx, connection refused or broken; those a request
may have caused wait for a second opinion, :mod:`kvreuse.gateway.quarantine`) are counted in two
streaks: a passing probe ends the probe streak, only a served request ends the request streak.
When the two add up to ``eject_after`` the upstream is ejected (no new requests); after
``readmit_after`` consecutive passing probes it is re-admitted. When requests failed, the
ejection holds *even while probes pass* (a replica that answers ``/health`` but never a
generation, a frozen process): for ``ejection_s``, doubled for each such ejection in a row (at
most ``MAX_EJECTION_S``); then passing probes re-admit it on probation, where its next failed
request ejects it again. Failed requests alone never take more than a share of a model's
upstreams out of rotation (:func:`ejection_leaves_short`, Envoy's ``max_ejection_percent``):
whatever clients send, and however a fleet is overloaded, the upstreams that still pass their
probes keep serving. An upstream kept admitted that way gets a request only when no other
upstream of its model is admitted (and is retried last), and is ejected at its next probe once
the share allows. Failed probes eject whatever the share: a dead engine is dead.

Load, as :class:`~kvreuse.routing.ReplicaLoad` for the policies: ``in_flight`` is every request
the gateway has open there; ``queued_requests`` and ``queued_prefill_tokens`` count requests sent
that have not produced a first byte yet (their predicted uncached prompt tokens). A scrape of
the upstream's ``/metrics`` refines this: when ``vllm:num_requests_waiting`` says more requests
wait than this gateway had queued there at that scrape (other clients, other gateways), the
difference is added with this gateway's mean uncached prompt size until the next scrape. The
comparison is with the gateway's own count *at the scrape*, not now: a replica that was busy
when scraped and has drained since would otherwise carry its own finished queue as phantom load
for a whole scrape interval (5 s by default) and be avoided while idle. Loads are divided by the
upstream's weight times its measured speed relative to the fleet of the request's model
(``model_speeds``; :class:`~kvreuse.routing.RelativeSpeeds`): 1 until the router has timed
first tokens of that model, and with ``--fixed-prefill``; once some upstreams of the model are
timed, one not yet timed is weighed at the fastest timed one's speed (``assumed_speeds``, one
mapping the router owns and every upstream reads), so that it gets the traffic that times it.
``speed`` summarises the measured ones for people (metrics, the admin listing): the geometric
mean over the models it was measured for.

Served models: declared (``models=a|b``), or learned from the upstream's ``GET /v1/models``
when the gateway starts and after each successful health probe (so a model that appears or
disappears is noticed within one health interval). ``models`` is ``None`` while nothing is
known (no declaration, and no ``/v1/models`` answer could be read yet); a failed or garbled
answer later keeps the last known set. What routing makes of that: :mod:`kvreuse.gateway.router`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvreuse.errors import InputFormatError
from kvreuse.gateway.config import MAX_MODEL_NAME_CHARS, UpstreamConfig
from kvreuse.hitrate.prometheus import parse_exposition
from kvreuse.routing import ReplicaLoad

MAX_MODEL_LIST_BYTES = 4 << 20
"""A /v1/models answer larger than this is refused (vLLM's, with many LoRA adapters, is KBs)."""
MAX_MODELS = 4096
MAX_OTHERS_WAITING = 1_000_000
"""A scraped queue beyond this many requests is a broken exporter, not load: clamped."""

ENGINE_METRICS = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)
MAX_EJECTION_S = 300.0
SATURATED_GRACE_S = 10.0
"""A health probe that times out does not count against an upstream that sent bytes of an
answer this recently: a saturated vLLM answers ``/health`` late (its event loop is busy) while
it serves, and counting those timeouts ejected whole fleets under load (docs/performance.md).
A frozen engine sends nothing, and its probes count again this long after its last byte."""
_CACHE_CONFIG = ("vllm:cache_config_info",)


DEFAULT_MAX_EJECTED_SHARE = 0.5


def ejection_leaves_short(upstream: UpstreamState, fleet: Iterable[UpstreamState],
                          max_share: float) -> str | None:
    """Whether ejecting ``upstream`` for failed requests would leave one of its models with
    more than ``max_share`` of its upstreams out of rotation: that model's name (``"*"`` for an
    upstream whose models are not known yet, judged against the whole fleet), else None. One
    ejection per model is always allowed, as in Envoy, so a lone upstream can still be ejected.
    Upstreams whose models are unknown count as serving every model, as routing takes them.
    Called only when a failed request would eject it: O(fleet × its models)."""
    members = [u for u in fleet if not u.removed]
    models: tuple[str, ...] = ("*",) if upstream.models is None else tuple(
        sorted(upstream.models))
    for model in models:
        group = members if model == "*" else [u for u in members if u.serves(model) is not False]
        out = sum(1 for u in group if not u.healthy and u is not upstream)
        if out + 1 > max(1, math.floor(max_share * len(group) + 1e-9)):
            return model
    return None


def parse_prometheus(text: str, names: tuple[str, ...] = ENGINE_METRICS) -> dict[str, float]:
    """Each wanted metric summed over its label sets; a malformed line is skipped, so one odd
    line never costs the scrape. O(lines)."""
    out: dict[str, float] = {}
    for sample in parse_exposition(text, "/metrics", only=names, strict=False):
        out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def parse_kv_capacity(text: str) -> int | None:
    """The engine's KV capacity in tokens from vLLM's ``vllm:cache_config_info`` info metric
    (``num_gpu_blocks`` × ``block_size`` labels), or None when absent or not yet known (vLLM
    reports ``num_gpu_blocks="None"`` before profiling). O(lines)."""
    for sample in parse_exposition(text, "/metrics", only=_CACHE_CONFIG, strict=False):
        blocks, size = sample.label("num_gpu_blocks") or "", sample.label("block_size") or ""
        if blocks.isdigit() and size.isdigit() and int(blocks) > 0 and int(size) > 0:
            return int(blocks) * int(size)
    return None


def parse_model_list(raw: bytes) -> tuple[dict[str, Any], ...]:
    """The model cards of an OpenAI ``/v1/models`` answer (``{"data": [{"id": ...}, ...]}``),
    in order, one per id. Raises :class:`InputFormatError` saying what is wrong. O(bytes)."""
    if len(raw) > MAX_MODEL_LIST_BYTES:
        raise InputFormatError(f"answer of {len(raw):,} bytes is over the "
                               f"{MAX_MODEL_LIST_BYTES:,}-byte limit", "/v1/models")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InputFormatError(f"not JSON ({exc})", "/v1/models") from None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise InputFormatError("not an object with a 'data' array", "/v1/models")
    if len(data) > MAX_MODELS:
        raise InputFormatError(f"{len(data)} models, over the limit of {MAX_MODELS}",
                               "/v1/models")
    cards: dict[str, dict[str, Any]] = {}
    for index, card in enumerate(data):
        name = card.get("id") if isinstance(card, dict) else None
        if not isinstance(name, str) or not name or len(name) > MAX_MODEL_NAME_CHARS:
            raise InputFormatError(f"data[{index}] has no model id (a non-empty string of at "
                                   f"most {MAX_MODEL_NAME_CHARS} characters)", "/v1/models")
        assert isinstance(card, dict)
        cards.setdefault(name, card)
    return tuple(cards.values())


def declared_card(name: str) -> dict[str, Any]:
    """The /v1/models entry the gateway lists for a declared model."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvreuse"}


@dataclass(slots=True)
class EngineSnapshot:
    """The last scrape of an upstream's /metrics (absent metrics stay None)."""

    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    queries_total: float | None = None
    hits_total: float | None = None


class UpstreamState:
    """Mutable state of one upstream; owned by the gateway's event loop."""

    def __init__(self, config: UpstreamConfig, *, eject_after: int, readmit_after: int,
                 ejection_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic,
                 admitted: bool = True) -> None:
        """``admitted=False`` (an upstream added at runtime): no request goes to it until
        its first health probe passes, which admits it at once."""
        self.config = config
        self.name = config.name
        self.header_name = config.name.encode("ascii")  # x-kvreuse-upstream (names are ASCII)
        self.eject_after = eject_after
        self.readmit_after = readmit_after
        self.ejection_s = ejection_s
        self.clock = clock
        self.healthy = admitted
        self.awaiting_first_probe = not admitted
        self.removed = False  # taken out of the gateway at runtime: never routed to again
        self.probe_failures = 0  # consecutive
        self.request_failures = 0  # consecutive
        self.successes = 0  # consecutive probe successes while ejected
        self.ejections = 0
        self.passive_ejections = 0  # in a row, since the last served request
        self.ejected_until = 0.0  # clock time before which probes cannot re-admit
        self.probed_ok = False  # a probe has passed at least once
        self.answered_at: float | None = None  # clock time of its last byte of an answer
        self.in_flight = 0
        # Prefill speed over each model's fleet (keys: Router.fit_key), measured by the router
        # (RelativeSpeeds), and their geometric mean, for people.
        self.model_speeds: dict[str, float] = {}
        self.speed = 1.0
        # Per model, the speed an upstream not yet timed there is weighed at: the router's
        # mapping (Router.assumed_speeds), shared by every upstream; empty until it measures.
        self.assumed_speeds: Mapping[str, float] = {}
        self.queued_requests = 0
        self.queued_prefill_tokens = 0
        self.sent_uncached_tokens = 0
        self.sent_requests = 0
        self.engine = EngineSnapshot()
        # Requests the last scrape saw waiting beyond this gateway's own queue then.
        self.others_waiting = 0
        self.engine_baseline: EngineSnapshot | None = None
        self.kv_capacity_tokens: int | None = None  # scraped from vllm:cache_config_info
        self.declared = bool(config.models)
        self.models: frozenset[str] | None = frozenset(config.models) if config.models else None
        self.model_cards: tuple[dict[str, Any], ...] = tuple(
            declared_card(name) for name in config.models)
        self.models_problem: str | None = None  # why the last /v1/models could not be read
        self.adapters: frozenset[str] = frozenset()  # served names that are LoRA adapters

    # ------------------------------------------------------------------ models

    def serves(self, model: str) -> bool | None:
        """Whether this upstream serves ``model``; None while its models are unknown."""
        return None if self.models is None else model in self.models

    def learned(self, cards: tuple[dict[str, Any], ...]) -> bool:
        """A /v1/models answer was read; returns True when the served set changed."""
        self.models_problem = None
        names = frozenset(card["id"] for card in cards)
        # vLLM lists a LoRA adapter with its base model as "parent" (null for base models).
        adapters = frozenset(card["id"] for card in cards if isinstance(card.get("parent"), str)
                             and card["parent"] != card["id"])
        changed = names != self.models or adapters != self.adapters
        self.models, self.model_cards, self.adapters = names, cards, adapters
        return changed

    # ------------------------------------------------------------------ health

    def answered(self) -> None:
        """It sent bytes of an answer below 500 (a first byte, a stream's chunk) just now."""
        self.answered_at = self.clock()

    def serving(self) -> bool:
        """Whether it sent bytes of an answer within ``SATURATED_GRACE_S``: a probe that
        times out then is a busy upstream's, not a dead one's."""
        return (self.answered_at is not None
                and self.clock() - self.answered_at < SATURATED_GRACE_S)

    @property
    def failures(self) -> int:
        """The two failure streaks together (the upstream is ejected when they reach
        ``eject_after``)."""
        return self.probe_failures + self.request_failures

    def ejects_on_failure(self) -> bool:
        """Whether one more failure would eject it."""
        return self.healthy and self.failures + 1 >= self.eject_after

    @property
    def ejection_withheld(self) -> bool:
        """Past its streak of failed requests, but kept admitted because failed requests
        already keep the most they may of its models' upstreams out (the cap): routing sends
        it a request only when no other upstream of the model is admitted, and retries try it
        last."""
        return self.healthy and self.request_failures > 0 and self.failures >= self.eject_after

    def record_failure(self, *, probe: bool, may_eject: bool = True) -> bool:
        """A probe or a proxied request failed; returns True when this ejects the upstream.
        ``may_eject=False``: the streak counts and the upstream stays admitted (the cap), as
        :attr:`ejection_withheld`; its next failed probe ejects it."""
        self.successes = 0
        if probe:
            self.probe_failures += 1
        else:
            self.request_failures += 1
        if not self.healthy or self.probe_failures + self.request_failures < self.eject_after:
            return False
        if not may_eject:
            return False
        self._eject()
        return True

    def eject_withheld(self) -> None:
        """The cap allows it now (another upstream came back): eject it, as its last failed
        request would have."""
        assert self.ejection_withheld, f"{self.name}: no ejection was withheld"
        self._eject()

    def _eject(self) -> None:
        if self.request_failures:  # requests failed: passing probes alone do not clear it
            self.passive_ejections += 1
            self.ejected_until = self.clock() + min(
                self.ejection_s * 2 ** (self.passive_ejections - 1), MAX_EJECTION_S)
        self.healthy = False
        self.ejections += 1

    def record_success(self, *, probe: bool) -> bool:
        """A probe or a request succeeded; returns True when this re-admits the upstream."""
        if not probe:
            self.request_failures = 0
            self.passive_ejections = 0
            return False
        self.probed_ok = True
        self.probe_failures = 0
        if self.awaiting_first_probe:
            self.awaiting_first_probe = False
            self.healthy = True
            return True
        if self.healthy:
            return False
        self.successes += 1
        if self.successes < self.readmit_after or self.clock() < self.ejected_until:
            return False
        self.healthy = True
        self.successes = 0
        if self.request_failures:  # on probation: one more failed request ejects again
            self.request_failures = self.eject_after - 1
        return True

    # ------------------------------------------------------------------ load

    def request_sent(self, uncached_tokens: int) -> None:
        self.in_flight += 1
        self.queued_requests += 1
        self.queued_prefill_tokens += uncached_tokens
        self.sent_uncached_tokens += uncached_tokens
        self.sent_requests += 1

    def first_byte(self, uncached_tokens: int) -> None:
        self.queued_requests -= 1
        self.queued_prefill_tokens -= uncached_tokens

    def request_done(self) -> None:
        self.in_flight -= 1
        assert self.in_flight >= 0, f"{self.name}: in_flight went negative"

    def set_speed(self, model: str, speed: float | None) -> None:
        """The router measured this upstream's prefill speed over ``model``'s fleet (``None``:
        forget it). O(models it serves)."""
        if speed is None:
            self.model_speeds.pop(model, None)
        else:
            self.model_speeds[model] = speed
        speeds = self.model_speeds
        self.speed = (math.exp(math.fsum(map(math.log, speeds.values())) / len(speeds))
                      if speeds else 1.0)

    def weight(self, model: str | None = None) -> float:
        """How many times the policies' prefill rate this upstream prefills at for requests of
        ``model`` (a :meth:`Router.fit_key`): the configured weight times the speed measured
        over that model's fleet (``None``: the summary ``speed``), or, not yet timed there,
        the speed assumed for that model's untimed upstreams (1 before any). O(1)."""
        if model is None:
            return self.config.weight * self.speed
        speed = self.model_speeds.get(model)
        if speed is None:
            speed = self.assumed_speeds.get(model, 1.0)
        return self.config.weight * speed

    def load(self, model: str | None = None) -> ReplicaLoad:
        """The load policies see for a request of ``model`` (see the module docstring and
        :meth:`weight`). O(1)."""
        queued = self.queued_requests
        tokens = self.queued_prefill_tokens
        others = self.others_waiting
        if others > 0:
            mean = self.sent_uncached_tokens / self.sent_requests if self.sent_requests else 0
            tokens += int(others * mean)
            queued += others
        return ReplicaLoad(self.name, tokens, queued, self.in_flight,
                           self.kv_capacity_tokens or self.config.capacity_tokens
                           ).at_speed(self.weight(model))

    def update_engine(self, scraped: dict[str, float]) -> None:
        """Store a scrape; the first one becomes the baseline for counter deltas. Called as
        the scrape's answer arrives, so ``queued_requests`` is this gateway's queue then."""
        waiting = scraped.get("vllm:num_requests_waiting")
        if waiting is None or not math.isfinite(waiting):  # Prometheus allows NaN and +Inf
            self.others_waiting = 0
        else:
            self.others_waiting = min(max(int(waiting) - self.queued_requests, 0),
                                      MAX_OTHERS_WAITING)
        self.engine = EngineSnapshot(
            waiting=waiting,
            running=scraped.get("vllm:num_requests_running"),
            kv_usage=scraped.get("vllm:kv_cache_usage_perc"),
            queries_total=scraped.get("vllm:prefix_cache_queries_total"),
            hits_total=scraped.get("vllm:prefix_cache_hits_total"),
        )
        if self.engine_baseline is None:
            self.engine_baseline = self.engine

    def engine_deltas(self) -> tuple[float, float] | None:
        """``(queried, cached)`` prompt tokens by the engine's counters since the first scrape:
        the realized side when responses carry no usage."""
        base, now = self.engine_baseline, self.engine
        if base is None or None in (now.queries_total, base.queries_total, now.hits_total,
                                    base.hits_total):
            return None
        assert now.queries_total is not None and base.queries_total is not None
        assert now.hits_total is not None and base.hits_total is not None
        return now.queries_total - base.queries_total, now.hits_total - base.hits_total

    def engine_hit_rate(self) -> float | None:
        """Token hit rate from the engine's own counters since the first scrape."""
        deltas = self.engine_deltas()
        if deltas is None or deltas[0] <= 0:
            return None
        return deltas[1] / deltas[0]
