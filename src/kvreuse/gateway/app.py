"""The gateway's ASGI application: endpoints, authentication, background loops.

Endpoints: ``POST /v1/completions`` and ``/v1/chat/completions`` (bodies forwarded unchanged
except ``cache_salt``; routed among the upstreams serving the body's ``model``, a 404 naming the
served models when none does), ``GET /v1/models`` (union of the healthy upstreams' models, as
declared or last learned),
``/health`` (the process is up), ``/ready`` (at least one upstream admitted; 503 otherwise, with
the reason), ``/metrics`` (Prometheus), and with ``--admin-key-file`` the admin API:
``GET``/``POST /admin/upstreams`` (list; add one at runtime) and ``DELETE
/admin/upstreams/NAME`` (remove one, draining it). SIGHUP re-reads ``--config``'s upstreams
and DNS discoveries (:meth:`Gateway.apply_upstreams`, :meth:`Gateway.apply_discoveries`).
Every request sent upstream carries ``x-kvreuse-via`` (the gateways it passed), so a request
that comes back to a gateway is refused with a 508 instead of circling. The two generate
endpoints are the hot path and are served on bare ASGI by :meth:`Gateway.__call__` (see
:mod:`kvreuse.gateway.asgi`); the others go through Starlette. Upstreams are reached through
:mod:`kvreuse.gateway.upstream_client`: per upstream, one pool for proxied requests and a small
one for probes, scrapes and model lists, so a probe never queues behind requests.

Background: a health probe per upstream every ``health_interval_s`` (then, unless its models
are declared, a read of its ``/v1/models``; also once at start-up), a scrape of each
upstream's ``/metrics`` every ``metrics_interval_s`` (0 turns scraping off), and one KV-event
subscriber per upstream that has an events endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import math
import os
import random
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import zmq
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvreuse.errors import ConfigError, InputFormatError, KvreuseError
from kvreuse.gateway.asgi import (
    ASGIApp,
    ClientGone,
    Receive,
    Scope,
    Send,
    disconnect_hook,
    read_body,
    send_json,
)
from kvreuse.gateway.config import (
    DiscoveryConfig,
    GatewayConfig,
    UpstreamConfig,
    read_secret_file,
    upstream_from_table,
)
from kvreuse.gateway.discovery import Discovery
from kvreuse.gateway.exchange import ClientReply, request_id_of
from kvreuse.gateway.lanes import WorkerLanes, lane_full
from kvreuse.gateway.metrics import GatewayMetrics, GatewayState, TokenTally
from kvreuse.gateway.prompts import PromptTokenizer, load_prompt_tokenizer
from kvreuse.gateway.proxy import CLIENT_LEFT, Forwarder
from kvreuse.gateway.quarantine import Quarantine
from kvreuse.gateway.recorder import (
    SECRET_ENV,
    RecorderCollector,
    RecorderSettings,
    TraceRecorder,
    load_secret,
)
from kvreuse.gateway.router import Router
from kvreuse.gateway.serve import Drain
from kvreuse.gateway.subscriber import EventSubscriber
from kvreuse.gateway.tasks import cancel_and_wait
from kvreuse.gateway.telemetry import AccessLog, RequestRecord, ThrottledLog, trace_headers
from kvreuse.gateway.tenants import DISCOVERED_PREFIX, Tenant, Tenants, load_tenants
from kvreuse.gateway.upstream_client import UpstreamError, UpstreamPool, UpstreamTimeout
from kvreuse.gateway.upstreams import (
    UpstreamState,
    ejection_leaves_short,
    parse_kv_capacity,
    parse_model_list,
    parse_prometheus,
)
from kvreuse.gateway.validation import (
    BODY_PROBLEMS,
    ENDPOINT_KINDS,
    INLINE_BODY_BYTES,
    RequestError,
    as_request_error,
    decode_body,
    error_body,
    parse_request,
    unsupported_coding,
)
from kvreuse.json_input import parse_json
from kvreuse.routing import CostModel, RoutingPolicy, build_policy

log = logging.getLogger("kvreuse.gateway")


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (an unknown path, a wrong method) in OpenAI's error shape, as
    every other answer of the gateway."""
    assert isinstance(exc, HTTPException), "registered for HTTPException only"
    kind = {404: "NotFound", 405: "MethodNotAllowed"}.get(exc.status_code, "BadRequest")
    message = f"{request.url.path}: {exc.detail}"
    return JSONResponse(error_body(message, kind, exc.status_code), status_code=exc.status_code,
                        headers=dict(exc.headers or {}))


MAX_UPSTREAMS = 1024
"""Upstreams one gateway holds at most (each has two pools, probe and scrape loops)."""


class MembershipConflict(ConfigError):
    """An upstream that cannot be added as things stand (a name in use, the most upstreams,
    a membership fixed by a shared index): the admin API's 409."""


VIA_HEADER = b"x-kvreuse-via"
MAX_VIA_BYTES = 1024
"""More gateways than fit here (about 75) in one request's path is a loop in all but name."""
REMOVAL_DRAIN_S = 30.0
"""How long a removed upstream's requests in flight are waited for, unless the caller says
(the admin API's DELETE takes ``?drain=``): reloads and DNS discovery use this."""
MAX_ADMIN_BODY_BYTES = 64 * 1024
MAX_ADMIN_WAIT_S = 3600.0


def _seconds(text: str, name: str) -> float:
    """A query parameter of seconds, 0 to :data:`MAX_ADMIN_WAIT_S`."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_ADMIN_WAIT_S:
        raise ConfigError(f"{name} must be a number of seconds from 0 to "
                          f"{MAX_ADMIN_WAIT_S:g}, got {ascii(text)[:40]}")
    return value


async def _admin_body(request: Request) -> dict[str, Any]:
    """The admin call's JSON object, read up to :data:`MAX_ADMIN_BODY_BYTES`."""
    declared = request.headers.get("content-length")
    try:
        body = await read_body(request.receive, MAX_ADMIN_BODY_BYTES,
                               declared.encode("latin-1") if declared is not None else None)
    except RequestError:
        raise ConfigError(f"body over {MAX_ADMIN_BODY_BYTES} bytes: an upstream's settings "
                          "are a few hundred") from None
    except ClientGone:  # nobody reads the answer; nothing was added
        raise ConfigError("the client left before its body arrived") from None
    try:
        value = parse_json(body)
    except (InputFormatError, RecursionError, UnicodeError) as exc:
        raise ConfigError(f"body: not a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError("body: send a JSON object such as {\"url\": "
                          "\"http://10.0.0.3:8000\", \"name\": \"gpu3\"}")
    return value


def no_upstream(model: str) -> dict[str, Any]:
    """The 503 body when every upstream serving ``model`` (for this caller) is ejected."""
    shown = model if len(model) <= 200 else model[:200] + "..."
    return error_body(f"no upstream serving the model {shown!r} is admitted now (all "
                      "ejected); retry later", "ServiceUnavailable", 503, "model")


# Requests open at once per upstream; more wait for a connection. vLLM serves hundreds of
# concurrent streams per replica, so this only bounds a runaway, it does not shape load.
MAX_UPSTREAM_CONNECTIONS = 1024


class Gateway:
    """One gateway: config, state, the policy object and the ASGI :attr:`app`."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        tokenizer: PromptTokenizer | None = None,
        policy: RoutingPolicy | None = None,
        tenants: Tenants | None = None,
        announce: Callable[[str], None] | None = None,
        reload_upstreams: Callable[[], GatewayConfig] | None = None,
    ) -> None:
        """``announce`` hears the start-up summary (upstreams, policy, models, metrics,
        access log) once the upstreams' model lists have been asked for.
        ``reload_upstreams``, when given, is read again on SIGHUP (``kvreuse route --config``
        re-reads its file) and the gateway's upstreams and DNS discoveries are made to match
        its ``upstreams`` and ``discovery`` (:meth:`apply_upstreams`,
        :meth:`apply_discoveries`); its other settings need a restart."""
        self.config = config
        self.announce = announce
        self.reload_source = reload_upstreams
        self.tokenizer = tokenizer or load_prompt_tokenizer(config.tokenizer)
        self.tenants = tenants or (load_tenants(Path(config.tenants)) if config.tenants else None)
        if self.tenants is not None and config.caller_salt is not None:
            self.tenants = dataclasses.replace(self.tenants, caller_salt=config.caller_salt)
        cost = CostModel(config.prefill_tokens_per_s, config.prefill_overhead_s)
        self.policy = policy or build_policy(
            config.policy, rng=random.Random(config.seed), cost=cost, **config.policy_options
        )
        self.upstreams = [self._state_of(u) for u in config.upstreams]
        # Tenants pinned to discoveries (discover:NAME), with those names: read per request.
        self._pinned_sources: dict[str, frozenset[str]] = {}
        if self.tenants is not None:
            for tenant, pins in self.tenants.upstreams.items():
                sources = frozenset(pin[len(DISCOVERED_PREFIX):] for pin in pins
                                    if pin.startswith(DISCOVERED_PREFIX))
                if sources:
                    self._pinned_sources[tenant] = sources
            known = {u.name for u in self.upstreams} | {
                DISCOVERED_PREFIX + d.source for d in config.discovery}
            for tenant, allowed in self.tenants.upstreams.items():
                unknown = sorted(set(allowed) - known)
                if unknown:
                    raise ConfigError(
                        f"tenants.{tenant}.upstreams names {', '.join(unknown)}, which are "
                        f"not upstreams nor {DISCOVERED_PREFIX}NAME of a --discover; known: "
                        f"{', '.join(sorted(known))}"
                    )
        self.router = Router(self.policy, self.upstreams, self.tokenizer,
                             cost=None if policy is not None else cost,
                             learn_prefill=config.learn_prefill)
        self.router.events_silence_s = config.events_silence_s
        self.router.on_suspect = self._resync
        for upstream in self.upstreams:
            self.router.set_budget(upstream.name, self.index_budget(upstream))
        self.tallies: dict[str, TokenTally] = {}
        self._lanes = WorkerLanes()
        self.state = GatewayState(self.upstreams, self.tallies, self.router.streams,
                                  self.router.index_size, health=self.router.health,
                                  index_budget=self.router.budget_of,
                                  prefill_fits=lambda: self.router.fits)
        self.metrics = GatewayMetrics(self.state)
        self.access_log = AccessLog(config.access_log, self.policy.name)
        self.recorder: TraceRecorder | None = None
        if config.record_dir is not None:
            secret, shared = load_secret(config.record_secret_file, "--record-secret-file")
            self.recorder = TraceRecorder(RecorderSettings(
                Path(config.record_dir), secret, config.record_block_size,
                config.record_max_bytes, config.record_rotate_s, config.record_queue,
                config.record_reorder_s))
            self.metrics.registry.register(RecorderCollector(self.recorder))
            if not shared:
                log.warning("--record without --record-secret-file or $%s: a random secret, so "
                            "this trace's ids match no other gateway's or run's", SECRET_ENV)
        self._refusals = ThrottledLog(log)
        self._slow_probes = ThrottledLog(log, burst=1, interval_s=30.0)
        self._idle_hangups = ThrottledLog(log, burst=2, interval_s=60.0)  # SIGHUP floods
        # Names this gateway in x-kvreuse-via on every request it sends upstream (loops).
        self.gateway_id = os.urandom(6).hex()
        self._admin_key = (read_secret_file(config.admin_key_file, "--admin-key-file")
                           if config.admin_key_file else None)
        self.subscribers: list[EventSubscriber] = []
        self._subscriber_tasks: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        # SIGHUP reloads: the one running and at most one queued behind it (request_reload).
        self._reloads: set[asyncio.Task[None]] = set()
        self._reload_queued = False
        self._reload_lock: asyncio.Lock | None = None
        self._loops: dict[str, list[asyncio.Task[None]]] = {}  # upstream -> probe, scrape
        self._membership: asyncio.Lock | None = None
        # Per upstream, two pools: proxied requests, and probes/scrapes/model lists, so that a
        # probe never queues behind requests when the request pool is at its limit.
        self._pools: dict[str, UpstreamPool] = {}
        self._control: dict[str, UpstreamPool] = {}
        self.forwarder: Forwarder | None = None
        # Requests of death; here, not in the forwarder, so --shared-quarantine can attach.
        self.quarantine = Quarantine(config.quarantine_s)
        for upstream in self.upstreams:
            for name in upstream.models or ():
                self.metrics.models.served_by_upstream(name)
        self.discoveries = [Discovery(d, self) for d in config.discovery]
        self._discovery_tasks: dict[Discovery, asyncio.Task[None]] = {}
        self._serving_loop: asyncio.AbstractEventLoop | None = None
        self._discovery_lock: asyncio.Lock | None = None
        # Stopping: the server begins it on SIGTERM (gateway/serve.py); /ready, /metrics
        # and the forwarder read it.
        self.drain = Drain()
        self.metrics.draining.set_function(lambda: 1.0 if self.drain.draining else 0.0)
        # The generate endpoints are served by __call__ itself; Starlette serves the rest.
        self._starlette = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/ready", self.ready, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
                Route("/admin/upstreams", self.admin_upstreams, methods=["GET", "POST"]),
                Route("/admin/upstreams/{name:path}", self.admin_remove, methods=["DELETE"]),
            ],
            lifespan=self._lifespan,
            exception_handlers={HTTPException: _http_error},
        )
        # What the --metrics-port listener serves (the CLI routes that port's requests here).
        self.metrics_app = Starlette(
            routes=[Route("/metrics", self._metrics_page, methods=["GET"])])
        self.app: ASGIApp = self

    # ------------------------------------------------------------------ lifecycle

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        config = self.config
        for upstream in self.upstreams:
            self._open_pools(upstream)
        self.forwarder = Forwarder(
            self._pools, self.router, self.metrics, self.tallies, policy_name=self.policy.name,
            retries=config.retries, upstream_timeout_s=config.upstream_timeout_s,
            max_response_bytes=config.max_response_bytes, migrate=config.stream_migration,
            max_continuation_bytes=config.max_body_bytes, drain=self.drain,
            quarantine=self.quarantine, probe=self.probe,
            max_ejected_share=config.max_ejected_share,
        )
        if self.recorder is not None:
            self.recorder.start()
        # Learn what each upstream serves before taking requests (bounded by the control
        # pool's timeouts); the probe loops keep it current.
        await asyncio.gather(*(self.learn_models(u) for u in self.upstreams if not u.declared))
        loop = asyncio.get_running_loop()
        self.open_event_sockets()
        for subscriber in self.subscribers:
            self._subscriber_tasks[subscriber.replica] = loop.create_task(subscriber.run())
        for upstream in self.upstreams:
            self._start_loops(upstream)
        if self.announce is not None:
            self._tasks.append(loop.create_task(self._announce(self.announce)))
        if self.access_log.mode != "off":
            self._tasks.append(loop.create_task(self.access_log.run()))
        self._serving_loop = loop
        for discovery in self.discoveries:
            self._start_discovery(discovery)
        # Always: a subscriber may also come with an upstream added at runtime.
        self._tasks.append(loop.create_task(self._watchdog()))
        # Always: without a file to reload, a stray SIGHUP (a log rotation's kill -HUP to
        # every process) must not end the gateway and every request in flight.
        hangup = self._on_hangup(loop)
        try:
            yield
        finally:
            if hangup:
                loop.remove_signal_handler(signal.SIGHUP)
            for subscriber in self.subscribers:
                subscriber.close()
            await cancel_and_wait([
                *self._tasks, *self._reloads, *self._subscriber_tasks.values(),
                *self._discovery_tasks.values(),
                *(task for loops in self._loops.values() for task in loops)], "shutdown")
            for discovery in self.discoveries:
                await discovery.aclose()
            self.access_log.flush()
            for pool in (*self._pools.values(), *self._control.values()):
                await pool.aclose()
            if self.recorder is not None:
                await asyncio.to_thread(self.recorder.close)
            self._lanes.close()

    def _open_pools(self, upstream: UpstreamState) -> None:
        """The two pools of ``upstream``: proxied requests, and probes/scrapes/model lists."""
        config = self.config
        auth = ({"authorization": f"Bearer {config.upstream_api_key}"}
                if config.upstream_api_key else {})
        url = upstream.config.url
        self._pools[upstream.name] = UpstreamPool(
            url, max_connections=MAX_UPSTREAM_CONNECTIONS,
            connect_timeout_s=config.connect_timeout_s, read_timeout_s=config.read_timeout_s,
            headers={"content-type": "application/json", **auth})
        self._control[upstream.name] = UpstreamPool(
            url, max_connections=4, connect_timeout_s=config.connect_timeout_s,
            read_timeout_s=config.connect_timeout_s, headers=auth)

    def _start_loops(self, upstream: UpstreamState) -> None:
        """``upstream``'s health probes and, unless scraping is off, its /metrics scrapes."""
        loop = asyncio.get_running_loop()
        loops = [loop.create_task(self._probe_loop(upstream))]
        if self.config.metrics_interval_s > 0:
            loops.append(loop.create_task(self._scrape_loop(upstream)))
        self._loops[upstream.name] = loops

    # ------------------------------------------------------------------ membership at runtime

    async def add_upstream(self, config: UpstreamConfig) -> UpstreamState:
        """Serve through one more upstream from now on (the admin API's POST). It takes no
        request until its first health probe passes; its served models are read first
        unless declared, and its KV-event socket (if any) is opened here. Raises
        :class:`MembershipConflict` for a name in use, a full gateway or one whose membership
        is fixed (a Redis-shared index), :class:`ConfigError` for an events endpoint ZeroMQ
        refuses. O(upstreams)."""
        if self.state.shared_sync is not None:
            raise MembershipConflict("upstreams cannot be added to a gateway sharing its "
                                     "index through Redis (--shared-index): restart it with "
                                     "the new list")
        name = config.name
        if len(self._pools) >= MAX_UPSTREAMS:
            raise MembershipConflict(f"this gateway has {len(self._pools)} upstreams (draining "
                                     f"ones included), its most: remove some first")
        if name in self.router.upstreams or name in self._pools:
            raise MembershipConflict(f"an upstream named {name!r} is already here (or still "
                                     "draining): remove it first, or give this one another "
                                     "name")
        upstream = self._state_of(config, admitted=False)
        self.router.add_upstream(upstream, self.index_budget(upstream))
        subscriber = None
        if config.events:
            try:
                subscriber = self._open_subscriber(upstream)
            except ConfigError:
                self.router.remove_upstream(name)
                raise
        self._open_pools(upstream)
        self.upstreams.append(upstream)
        for model in upstream.models or ():
            self.metrics.models.served_by_upstream(model)
        if subscriber is not None:
            self.subscribers.append(subscriber)
            self._subscriber_tasks[name] = asyncio.get_running_loop().create_task(
                subscriber.run())
        if not upstream.declared:
            await self.learn_models(upstream)
        if upstream.removed:  # removed while its models were being read
            return upstream
        self._start_loops(upstream)
        log.warning("upstream %s (%s) added at runtime; admitted after its first health "
                    "probe", name, config.url)
        return upstream

    def _state_of(self, config: UpstreamConfig, *, admitted: bool = True) -> UpstreamState:
        """A new upstream's state, with this gateway's ejection settings (``admitted``
        False: no request until its first probe passes)."""
        settings = self.config
        return UpstreamState(config, eject_after=settings.eject_after,
                             readmit_after=settings.readmit_after,
                             ejection_s=settings.ejection_s, admitted=admitted)

    async def remove_upstream(self, name: str, drain_s: float = REMOVAL_DRAIN_S
                              ) -> dict[str, Any]:
        """Stop routing to ``name`` now and wait up to ``drain_s`` for its requests in flight
        to finish (the admin API's DELETE). Those still running after that run on: the
        engine's own shutdown ends them, and a broken stream is continued elsewhere (stream
        migration). Its probes, scrapes, KV-event subscriber and indexes go at once, its
        pools when their last response ends. Raises KeyError for an unknown name. Cancelled
        (its discovery table stopped, a shutdown), it cuts the drain short but still frees
        the name: else it would be "still draining" for ever."""
        upstream = self.router.remove_upstream(name)
        stopping = self._loops.pop(name, [])
        for subscriber in [s for s in self.subscribers if s.replica == name]:
            subscriber.close()
            self.subscribers.remove(subscriber)
            if name in self._subscriber_tasks:
                stopping.append(self._subscriber_tasks.pop(name))
        self.upstreams.remove(upstream)
        in_flight_at_removal = upstream.in_flight
        drained = False
        try:
            await cancel_and_wait(stopping, f"upstream {name}'s probes and subscriber")
            deadline = time.monotonic() + drain_s
            while upstream.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            drained = True
        finally:
            for pools in (self._pools, self._control):
                pool = pools.pop(name, None)
                if pool is not None:
                    await pool.aclose()  # awaits nothing: a cancel cannot cut it short
            self.metrics.forget_upstream(name)
            log.warning("upstream %s removed at runtime%s: %d requests were in flight, %d "
                        "still are", name, "" if drained else " (its drain cut short)",
                        in_flight_at_removal, upstream.in_flight)
        return {"removed": name, "in_flight_at_removal": in_flight_at_removal,
                "in_flight_left": upstream.in_flight}

    def _on_hangup(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Call :meth:`request_reload` on SIGHUP; False where signals cannot be caught (a
        loop outside the main thread, as in tests)."""
        try:
            loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        except (RuntimeError, ValueError, NotImplementedError):
            return False
        return True

    def request_reload(self) -> None:
        """What SIGHUP does, on the serving loop: :meth:`reload_upstreams` soon, after any
        reload running now. Requests that come while one waits to start make no more: it
        reads the file after them all, so a flood of SIGHUPs costs at most one reload
        running and one waiting, not a task each. A reload that fails is logged; without a
        :attr:`reload_source` (no ``--config``) the request is logged and ignored. O(1)."""
        if self.reload_source is None:
            self._idle_hangups.warning("SIGHUP: nothing to reload (this gateway was started "
                                       "without --config; its upstreams come from its "
                                       "flags): ignored")
            return
        if self._reload_queued:
            return
        self._reload_queued = True
        task = asyncio.get_running_loop().create_task(self._reload_in_turn())
        self._reloads.add(task)
        task.add_done_callback(self._reload_ended)

    async def _reload_in_turn(self) -> None:
        if self._reload_lock is None:  # made on first use: it belongs to the serving loop
            self._reload_lock = asyncio.Lock()
        async with self._reload_lock:
            self._reload_queued = False  # a SIGHUP from now on is after this file read
            await self.reload_upstreams()

    def _reload_ended(self, task: asyncio.Task[None]) -> None:
        self._reloads.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("SIGHUP: the reload failed; upstreams and discoveries may be partly "
                      "applied (send SIGHUP again)", exc_info=task.exception())

    async def reload_upstreams(self) -> None:
        """Read :attr:`reload_source` again and apply its upstreams and discoveries; a source
        that cannot be read (or names bad upstreams) is logged and changes nothing."""
        assert self.reload_source is not None, "reload without a source"
        try:
            wanted = self.reload_source()
        except (ConfigError, InputFormatError) as exc:
            log.error("SIGHUP: upstreams not reloaded, the configuration is unusable: %s", exc)
            return
        await self.apply_upstreams(wanted.upstreams)
        await self.apply_discoveries(wanted.discovery)

    async def apply_discoveries(self, wanted: tuple[DiscoveryConfig, ...],
                                drain_s: float = REMOVAL_DRAIN_S) -> dict[str, list[str]]:
        """Make the running DNS discoveries ``wanted``: a table no longer wanted stops, and
        the upstreams it added are removed (draining up to ``drain_s``); a new one starts. A
        table changed only in how it asks (``nameserver``, ``interval_s``, ``timeout_s``,
        ``remove_after``) hands its upstreams to its successor, which keeps them while DNS
        lists them; one whose upstreams would differ (name, port, models...) starts afresh.
        One reload at a time (two SIGHUPs in a row would otherwise start a table twice)."""
        if self._discovery_lock is None:  # made on first use: it belongs to the serving loop
            self._discovery_lock = asyncio.Lock()
        async with self._discovery_lock:
            return await self._apply_discoveries(wanted, drain_s)

    async def _apply_discoveries(self, wanted: tuple[DiscoveryConfig, ...],
                                 drain_s: float) -> dict[str, list[str]]:
        kept = [d for d in self.discoveries if d.config in wanted]
        stopped = [d for d in self.discoveries if d.config not in wanted]
        running = {d.config for d in kept}
        started: list[Discovery] = []
        for config in dict.fromkeys(wanted):
            if config in running:
                continue
            successor = Discovery(config, self)
            heir = next((d for d in stopped if d.owned and d.config.finds_the_same(config)),
                        None)
            if heir is not None:
                successor.inherit(heir)
            started.append(successor)
        for discovery in stopped:
            task = self._discovery_tasks.pop(discovery, None)
            if task is not None:
                await cancel_and_wait([task], f"discovery {discovery.config.source}")
            await discovery.aclose()
            if discovery.config.source not in {d.config.source for d in (*kept, *started)}:
                with contextlib.suppress(KeyError):  # never answered: no series yet
                    self.metrics.discovered.remove(discovery.config.source)
        orphans = await self._remove_all([name for d in stopped for name in d.owned],
                                         drain_s, "discovery reload")
        self.discoveries = [*kept, *started]
        if self._serving_loop is not None:
            for discovery in started:
                self._start_discovery(discovery)
        done = {"started": [d.config.source for d in started],
                "stopped": [d.config.source for d in stopped], "removed": orphans}
        if started or stopped:
            log.warning("discovery reloaded: %s", "; ".join(
                f"{what} {', '.join(names) or 'none'}" for what, names in done.items()))
        return done

    def _start_discovery(self, discovery: Discovery) -> None:
        assert self._serving_loop is not None, "a discovery started before the server"
        self._discovery_tasks[discovery] = self._serving_loop.create_task(discovery.run())

    async def apply_upstreams(self, wanted: tuple[UpstreamConfig, ...],
                              drain_s: float = REMOVAL_DRAIN_S) -> dict[str, list[str]]:
        """Make the upstreams ``wanted``, by name: new names are added, missing ones removed
        (draining up to ``drain_s``), changed ones removed then added with their new settings,
        concurrently. One reload at a time; what each step did is logged."""
        async with self._membership_lock():
            discovered = self.discovered_names()
            current = {u.name: u.config for u in self.upstreams if u.name not in discovered}
            names = [u.name for u in wanted]
            if len(set(names)) != len(names):
                log.error("upstreams not reloaded: names must be unique, got %s", names)
                return {}
            by_name = {u.name: u for u in wanted}
            gone = [name for name in current if name not in by_name]
            changed = [name for name in current if name in by_name
                       and by_name[name] != current[name]]
            new = [name for name in by_name if name not in current]
            removed = await self._remove_all(gone + changed, drain_s, "reload")
            gone = [name for name in gone if name in removed]
            failed = []
            for name in changed + new:
                try:
                    await self.add_upstream(by_name[name])
                except ConfigError as exc:
                    failed.append(name)
                    log.error("upstream %s not added on reload: %s", name, exc)
            done = {"added": [n for n in new if n not in failed], "removed": gone,
                    "replaced": [n for n in changed if n not in failed], "failed": failed}
            log.warning("upstreams reloaded: %s", "; ".join(
                f"{what} {', '.join(names) or 'none'}" for what, names in done.items()))
            return done

    async def _remove_all(self, names: list[str], drain_s: float, what: str) -> list[str]:
        """Remove ``names`` concurrently (a reload's removals); those removed are returned.
        A name already gone (an admin DELETE meanwhile) is skipped, and any other failure is
        logged: the rest of the reload must still happen."""
        outcomes = await asyncio.gather(*(self.remove_upstream(name, drain_s)
                                          for name in names), return_exceptions=True)
        removed = []
        for name, outcome in zip(names, outcomes, strict=True):
            if isinstance(outcome, KeyError):
                continue
            if isinstance(outcome, BaseException):
                log.error("%s: removing %s failed", what, name, exc_info=outcome)
            removed.append(name)
        return removed

    def _membership_lock(self) -> asyncio.Lock:
        if self._membership is None:  # made on first use: it belongs to the serving loop
            self._membership = asyncio.Lock()
        return self._membership

    def allowed(self, tenant: Tenant | None) -> tuple[str, ...] | None:
        """The upstream names ``tenant`` may be routed to (None: any), its pins of
        ``discover:NAME`` read as what that discovery keeps now. O(1), plus O(fleet) for a
        tenant pinned to a discovery."""
        if tenant is None or tenant.upstreams is None:
            return None
        sources = self._pinned_sources.get(tenant.name)
        if sources is None:
            return tenant.upstreams
        return tenant.upstreams + tuple(name for d in self.discoveries
                                        if d.config.source in sources
                                        for name in sorted(d.owned))

    def discovered_names(self) -> dict[str, str]:
        """The upstreams DNS discovery added, each with the name it was found under."""
        return {name: d.config.source for d in self.discoveries for name in d.owned}

    def describe_upstreams(self) -> list[dict[str, Any]]:
        """Each upstream as the admin API lists it."""
        discovered = self.discovered_names()
        return [{"name": u.name, "url": u.config.url, "healthy": u.healthy,
                 "probed": u.probed_ok, "in_flight": u.in_flight,
                 "models": sorted(u.models) if u.models is not None else None,
                 "events": u.config.events, "weight": u.config.weight, "prefill_speed": u.speed,
                 "prefill_speed_by_model": dict(u.model_speeds),
                 "backup": u.config.backup, "ejection_withheld": u.ejection_withheld,
                 "discovered_by": discovered.get(u.name)}
                for u in self.upstreams]

    def open_event_sockets(self) -> None:
        """Bind (or connect) each upstream's KV-event socket, once: the lifespan calls it, and
        ``kvreuse route`` before the server starts. An endpoint ZeroMQ refuses (in use, a host
        that is not this machine's) is a :class:`ConfigError` naming the upstream; the sockets
        opened before it are closed."""
        if self.subscribers:
            return
        opened: list[EventSubscriber] = []
        for upstream in self.upstreams:
            events = upstream.config.events
            if not events:
                continue
            try:
                opened.append(self._open_subscriber(upstream))
            except ConfigError:
                for done in opened:
                    done.close()
                raise
        self.subscribers.extend(opened)

    def _open_subscriber(self, upstream: UpstreamState) -> EventSubscriber:
        """``upstream``'s KV-event subscriber, its socket bound (or connected); an endpoint
        ZeroMQ refuses is a :class:`ConfigError` naming the upstream."""
        subscriber = self._subscriber(upstream)
        try:
            subscriber.open()
        except zmq.ZMQError as exc:
            verb = "bind" if upstream.config.bind else "connect to"
            raise ConfigError(f"upstream {upstream.name}: cannot {verb} events "
                              f"{upstream.config.events}: {exc.strerror}") from None
        return subscriber

    def _subscriber(self, upstream: UpstreamState) -> EventSubscriber:
        name = upstream.name
        cfg = upstream.config
        assert cfg.events is not None
        return EventSubscriber(
            name, cfg.events, bind=cfg.bind, replay_endpoint=cfg.replay, topic=cfg.topic,
            on_batch=lambda batch: self.router.apply_batch(name, batch),
            on_cold=lambda reason: self.router.mark_cold(name, reason),
            stats=self.router.streams[name],
            max_frame_bytes=self.config.kv_events_max_frame_bytes,
            seq_window=self.config.kv_events_seq_window,
        )

    def _resync(self, name: str) -> None:
        for subscriber in self.subscribers:
            if subscriber.replica == name:
                subscriber.request_resync()

    def index_budget(self, upstream: UpstreamState) -> int:
        """Tokens each index kept for ``upstream`` may hold: its KV capacity (scraped from
        vllm:cache_config_info, else configured) times index_budget_factor, or
        index_budget_tokens when neither says."""
        capacity = upstream.kv_capacity_tokens or upstream.config.capacity_tokens
        if capacity is None:
            return self.config.index_budget_tokens
        return max(int(capacity * self.config.index_budget_factor), 1)

    async def _watchdog(self, every_s: float = 1.0, stuck_s: float = 30.0) -> None:
        """Run again any subscriber whose loop ended without being closed (a bug that escaped
        its catch-all), or whose loop has not turned for ``stuck_s``."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(every_s)
            now = time.monotonic()
            for subscriber in list(self.subscribers):  # a removal may come during a stop
                if subscriber.closed:
                    continue
                task = self._subscriber_tasks.get(subscriber.replica)
                beat = subscriber.stats.heartbeat_at
                stuck = beat is not None and now - beat > stuck_s
                if task is not None and not task.done() and not stuck:
                    continue
                reason = "stuck" if stuck else "stopped"
                if task is not None and task.done() and not task.cancelled():
                    error = task.exception()
                    if error is not None:
                        reason = f"died: {error!r}"
                if task is not None and not task.done():
                    # Ended before its successor starts: two would share one replica's sockets.
                    await cancel_and_wait([task], f"KV-event subscriber of "
                                                   f"{subscriber.replica}")
                    if subscriber.closed:  # its upstream was removed meanwhile
                        continue
                subscriber.stats.restarts += 1
                subscriber.stats.note(f"{subscriber.replica}: subscriber {reason}; restarted")
                log.warning("KV-event subscriber of %s %s; restarting it", subscriber.replica,
                            reason)
                subscriber.stats.heartbeat_at = now
                self._subscriber_tasks[subscriber.replica] = loop.create_task(subscriber.run())

    async def _get(self, upstream: UpstreamState, path: str) -> tuple[int, bytes]:
        """GET on the control pool; raises UpstreamError."""
        response = await self._control[upstream.name].request("GET", path)
        return response.status, await response.read()

    async def _announce(self, announce: Callable[[str], None]) -> None:
        """The start-up summary, with the models each upstream serves (declared, or learned
        before the gateway took requests)."""
        announce(self.startup_summary({u.name: [m["id"] for m in u.model_cards]
                                       for u in self.upstreams}))

    def startup_summary(self, models: dict[str, list[str]]) -> str:
        """Policy, upstreams (with their models and events endpoint), tenants, the prefill
        speed routed on, metrics and access log, in one line."""
        config = self.config
        parts = []
        for upstream in config.upstreams:
            # Model names come from the upstreams: escaped, so the line stays one line.
            served = "|".join(m if m.isprintable() else ascii(m)
                              for m in models.get(upstream.name, [])) or "models unknown"
            events = f", events {upstream.events}" if upstream.events else ""
            parts.append(f"{upstream.name}={upstream.url} ({served}{events})")
        metrics = (f"port {config.metrics_port}" if config.metrics_port is not None
                   else "this port")
        tenants = (f"{len(self.tenants.keys)} keys" if self.tenants is not None else "off")
        admin = "on" if self._admin_key is not None else "off"
        found = "".join(f"; discovering {d.source} every {d.interval_s:g} s"
                        for d in config.discovery)
        speed = (f"{config.prefill_tokens_per_s:g} tokens/s and {config.prefill_overhead_s:g} s "
                 "a request")
        prefill = (f"measured from first tokens, from {speed}, and each upstream's over "
                   "its model's" if config.learn_prefill else f"fixed at {speed}")
        return (f"policy {self.policy.name}; upstreams {', '.join(parts) or 'none configured'}"
                f"{found}; tenants {tenants}; prefill speed {prefill}; /metrics on {metrics}; "
                f"access log {config.access_log}; admin API {admin}")

    async def _probe_loop(self, upstream: UpstreamState) -> None:
        while True:
            ok = await self.probe(upstream)
            if ok and not upstream.declared:
                await self.learn_models(upstream)
            await asyncio.sleep(self.config.health_interval_s)

    async def probe(self, upstream: UpstreamState) -> bool:
        """Probe ``upstream``'s ``GET /health`` now and count the result towards its health;
        whether it passed. The probe loop calls it every ``health_interval_s``, the forwarder
        after an upstream failed a request it had received (did the request bring it down?)."""
        try:
            status, _ = await self._get(upstream, "/health")
            ok = status == 200
        except UpstreamTimeout:
            if upstream.serving():  # busy, not down: counts neither way
                self._slow_probes.warning(
                    "upstream %s: /health did not answer within %g s while it serves "
                    "requests; taken for a saturated engine, not counted", upstream.name,
                    self.config.connect_timeout_s)
                return True
            ok = False
        except UpstreamError:
            ok = False
        first = upstream.awaiting_first_probe
        if ok and upstream.record_success(probe=True):
            log.warning("upstream %s %s", upstream.name,
                        "admitted: its first health probe passed" if first else "re-admitted")
        elif not ok and upstream.record_failure(probe=True):
            log.warning("upstream %s ejected (health probes failing)", upstream.name)
        elif ok and upstream.ejection_withheld and ejection_leaves_short(
                upstream, self.router.upstreams.values(), self.config.max_ejected_share) is None:
            upstream.eject_withheld()
            log.warning("upstream %s ejected: its %d failed requests in a row were past its "
                        "streak, and the share of its models' upstreams out now allows it",
                        upstream.name, upstream.request_failures)
        return ok

    async def learn_models(self, upstream: UpstreamState) -> None:
        """Read ``upstream``'s /v1/models now and route on what it says from then on; an
        unreadable answer keeps the last known set and is logged once per distinct problem."""
        try:
            status, raw = await self._get(upstream, "/v1/models")
            if status != 200:
                raise InputFormatError(f"answered HTTP {status}", "/v1/models")
            cards = parse_model_list(raw)
        except (UpstreamError, InputFormatError) as exc:
            problem = str(exc)
            if problem != upstream.models_problem:
                upstream.models_problem = problem
                kept = ("routed as serving any model no other upstream serves"
                        if upstream.models is None else
                        f"keeping its last known models {sorted(upstream.models)}")
                log.warning("upstream %s: cannot read its served models from GET /v1/models "
                            "(%s); %s. Declare them with models=NAME|NAME to stop asking",
                            upstream.name, problem, kept)
            return
        before = upstream.models
        if upstream.learned(cards):
            for card in cards:
                self.metrics.models.served_by_upstream(card["id"])
            # A change of a known set is news to the operator; the first answer is not.
            log.log(logging.INFO if before is None else logging.WARNING,
                    "upstream %s serves %s (was %s)", upstream.name,
                    sorted(upstream.models or ()),
                    "unknown" if before is None else sorted(before))
            self.router.models_changed(upstream, before)

    async def _scrape_loop(self, upstream: UpstreamState) -> None:
        while True:
            await self.scrape(upstream)
            await asyncio.sleep(self.config.metrics_interval_s)

    async def scrape(self, upstream: UpstreamState) -> None:
        """Read one upstream's /metrics now (also used by tests to avoid waiting)."""
        with contextlib.suppress(UpstreamError, UnicodeDecodeError):
            status, text = await self._get(upstream, "/metrics")
            if status == 200:
                decoded = text.decode()
                upstream.update_engine(parse_prometheus(decoded))
                capacity = parse_kv_capacity(decoded)
                if capacity is not None and capacity != upstream.kv_capacity_tokens:
                    upstream.kv_capacity_tokens = capacity
                    self.router.set_budget(upstream.name, self.index_budget(upstream))

    # ------------------------------------------------------------------ endpoints

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        admitted = [u.name for u in self.upstreams if u.healthy]
        ejected = [u.name for u in self.upstreams if not u.healthy]
        # Ready once an admitted upstream has passed a probe: not before the first one.
        probed = [name for name in admitted if self.router.upstreams[name].probed_ok]
        body: dict[str, Any] = {"ready": bool(probed) and not self.drain.draining,
                                "admitted": admitted, "ejected": ejected,
                                # admitted past their streak of failed requests (the cap)
                                "ejection_withheld": [u.name for u in self.upstreams
                                                      if u.ejection_withheld]}
        if self.drain.draining:
            body["reason"] = ("shutting down: serving what still arrives until the listener "
                              "closes; send new requests elsewhere")
        elif not probed:
            body["reason"] = ("no upstream (none configured, and DNS discovery has found "
                              "none)" if not self.upstreams else
                              "every upstream is ejected" if not admitted else
                              "no upstream has passed a health probe yet")
        # Degraded, not down: an upstream whose events went silent (or whose index is
        # suspect) still serves, routed on the approximate estimate; failing readiness would
        # take the whole gateway out of its load balancer for it. Operators see it here and
        # in kvreuse_gateway_kv_subscriber_state / _kv_events_last_age_seconds.
        silent = [name for name in self.router.indexes if self.router.events_silent(name)]
        stopped = [s.replica for s in self.subscribers
                   if s.stats.state in ("failed", "stopped") and not s.closed]
        body["kv_events_silent"] = silent
        body["kv_subscribers_down"] = stopped
        body["index_suspect"] = self.router.suspects()
        if silent or stopped or body["index_suspect"]:
            body["degraded"] = True
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    # ------------------------------------------------------------------ the admin API

    def _admin_refusal(self, request: Request) -> JSONResponse | None:
        """The answer to an admin call that is not allowed (None when it is): 403 when the
        gateway has no admin key, 401 without the right ``Authorization: Bearer KEY``."""
        if self._admin_key is None:
            return self._admin_error(403, "the admin API is off: start kvreuse route with "
                                     "--admin-key-file FILE to add and remove upstreams at "
                                     "runtime", "PermissionDenied", request)
        given = request.headers.getlist("authorization")
        key = given[0].encode("latin-1") if len(given) == 1 else b""
        if not hmac.compare_digest(key, b"Bearer " + self._admin_key):
            return self._admin_error(401, "send the admin key: Authorization: Bearer KEY",
                                     "AuthenticationError", request)
        return None

    def _admin_error(self, status: int, message: str, kind: str,
                     request: Request) -> JSONResponse:
        self._refusals.warning("admin %s %s refused with %d: %s", request.method,
                               ascii(request.url.path)[:200], status, message)
        return JSONResponse(error_body(message, kind, status), status_code=status)

    async def admin_upstreams(self, request: Request) -> Response:
        """GET: every upstream and its state. POST: add one (a JSON object with the keys of a
        TOML ``[[upstreams]]`` table); ``?wait=S`` waits up to S seconds for its admission."""
        refusal = self._admin_refusal(request)
        if refusal is not None:
            return refusal
        if request.method == "GET":
            return JSONResponse({"upstreams": self.describe_upstreams()})
        try:
            wait_s = _seconds(request.query_params.get("wait", "0"), "wait")
            raw = await _admin_body(request)
            config = upstream_from_table(raw, "body")
            upstream = await self.add_upstream(config)
        except MembershipConflict as exc:
            return self._admin_error(409, str(exc), "ConflictError", request)
        except ConfigError as exc:
            return self._admin_error(400, str(exc), "BadRequestError", request)
        deadline = time.monotonic() + wait_s
        while not upstream.healthy and not upstream.removed and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        described = next((u for u in self.describe_upstreams() if u["name"] == upstream.name),
                         {"name": upstream.name, "removed": True})
        return JSONResponse(described, status_code=201)

    async def admin_remove(self, request: Request) -> Response:
        """DELETE: take an upstream out; ``?drain=S`` (default 30, at most 3,600) waits for
        its requests in flight."""
        refusal = self._admin_refusal(request)
        if refusal is not None:
            return refusal
        name = request.path_params["name"]
        try:
            drain_s = _seconds(request.query_params.get("drain", f"{REMOVAL_DRAIN_S:g}"),
                               "drain")
        except ConfigError as exc:
            return self._admin_error(400, str(exc), "BadRequestError", request)
        if name not in self.router.upstreams:
            known = ", ".join(sorted(self.router.upstreams)) or "none"
            return self._admin_error(404, f"no upstream named {ascii(name)[:200]}; upstreams: "
                                     f"{known[:2000]}", "NotFoundError", request)
        return JSONResponse(await self.remove_upstream(name, drain_s))

    async def prometheus(self, request: Request) -> Response:
        if self.config.metrics_port is not None:
            return JSONResponse(error_body(f"/metrics is served on port "
                                           f"{self.config.metrics_port}", "NotFound", 404),
                                status_code=404)
        return await self._metrics_page(request)

    async def _metrics_page(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry),
                        media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> Response:
        """The union of the healthy upstreams' models; with tenants on, a valid key is
        required and a tenant pinned to some upstreams sees only theirs."""
        try:
            tenant = self._authenticate(request.scope["headers"])
        except RequestError as exc:
            self._refused(exc, request.scope["path"])
            return JSONResponse(exc.body(), status_code=exc.status)
        allowed = self.allowed(tenant)
        merged: dict[str, dict[str, Any]] = {}
        for upstream in self.upstreams:
            if upstream.healthy and (allowed is None or upstream.name in allowed):
                for card in upstream.model_cards:
                    merged.setdefault(card["id"], card)
        return JSONResponse({"object": "list", "data": list(merged.values())})

    # ------------------------------------------------------------------ the hot path (bare ASGI)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI entry point (what :attr:`app` is, unless something wraps it)."""
        if scope["type"] == "http":
            path = scope["path"]
            kind = ENDPOINT_KINDS.get(path)
            if kind is None and path.endswith("/"):  # served, where Starlette would redirect
                path = path.rstrip("/")
                kind = ENDPOINT_KINDS.get(path)
            if kind is not None:
                if scope["method"] == "POST":
                    await self._generate(scope, receive, send, path, kind)
                else:
                    await send_json(send, 405, error_body(
                        f"{path} takes POST", "MethodNotAllowed", 405), [(b"allow", b"POST")])
                return
        await self._starlette(scope, receive, send)

    async def _generate(self, scope: Scope, receive: Receive, send: Send, path: str,
                        kind: str) -> None:
        session_id = declared = traceparent = tracestate = coding = via = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = value
            elif name in (b"content-encoding", b"transfer-encoding"):
                coding = unsupported_coding(name, value) or coding
            elif name == b"x-session-id":
                session_id = value.decode("latin-1")
            elif name == b"traceparent":
                traceparent = value
            elif name == b"tracestate":
                tracestate = value
            elif name == VIA_HEADER:
                via = value
        request_id = request_id_of(scope["headers"])
        trace = trace_headers(traceparent, tracestate)
        hops, loop = self._via(via)
        trace["x-kvreuse-via"] = hops
        coding = coding or loop
        record = RequestRecord(request_id, path, time.perf_counter())
        reply = ClientReply(send, request_id, record)
        try:
            await self._serve(scope, receive, reply, path, kind, record, session_id, declared,
                              trace, coding)
        except Exception as exc:  # a bug: the client still gets an answer, and it is logged
            log.error("request %s: internal error, answered 500: %r", reply.request_id, exc,
                      exc_info=exc)
            record.status, record.error = 500, f"internal error: {exc!r}"
            with contextlib.suppress(Exception):
                await reply.fail(500, f"internal error in the gateway (request id "
                                 f"{reply.request_id}): {type(exc).__name__}",
                                 "InternalServerError")
        finally:
            self._finish(record)

    def _via(self, received: bytes | None) -> tuple[str, RequestError | None]:
        """The ``x-kvreuse-via`` to send upstream (the gateways a request has passed, this
        one last), and the refusal of a request that has passed this gateway before (an
        upstream that points back at a gateway would otherwise send it round for ever) or
        too many gateways. O(header)."""
        if received is None or not (received.isascii() and received.decode().isprintable()):
            return self.gateway_id, None  # not a list another kvreuse gateway wrote
        hops = received.decode()
        if self.gateway_id in hops.split(", ") or len(received) > MAX_VIA_BYTES:
            return hops, RequestError(
                "this request came back to a gateway it had passed "
                f"(x-kvreuse-via: {hops[:200]!a}): an upstream of this gateway is a "
                "gateway that routes back to it; fix its upstream list", None, 508)
        return f"{hops}, {self.gateway_id}", None

    def _finish(self, record: RequestRecord) -> None:
        """Account for a request that ended (answered, refused, or its client left)."""
        record.finished = time.perf_counter()
        total = record.finished - record.started
        if record.upstream is not None:
            self.metrics.observe_request(record.upstream, record.model, record.status,
                                         record.ttft_s, total)
        self.access_log.write(record)
        if self.recorder is not None:
            self.recorder.submit(record)

    def _refused(self, error: RequestError, path: str, model: str | None = None) -> None:
        self.metrics.reject(error.status, model)
        self._refusals.warning("refused %s with %d: %s", path, error.status, ascii(str(error)))

    async def _serve(self, scope: Scope, receive: Receive, reply: ClientReply, path: str,
                     kind: str,
                     record: RequestRecord, session_id: str | None, declared: bytes | None,
                     trace: dict[str, str], coding: RequestError | None) -> None:
        try:
            tenant = self._authenticate(scope["headers"])
            if tenant is not None:
                record.tenant = tenant.name
            raw = await read_body(receive, self.config.max_body_bytes, declared)
            if coding is not None:  # refused once read, so the connection can go on
                raise coding
            decoded = (decode_body(raw) if len(raw) <= INLINE_BODY_BYTES
                       else await self._lanes.run(len(raw), decode_body, raw))
            if decoded is None:
                raise lane_full(self._lanes)
            body = decoded.value
            if self.tenants is not None and "cache_salt" in body:
                if self.tenants.caller_salt == "reject" and body["cache_salt"] is not None:
                    raise RequestError(
                        "cache_salt is set by the gateway from your API key; remove it",
                        "cache_salt")
                del body["cache_salt"]
            parsed = parse_request(kind, body)
            record.model = parsed.model
            salt = tenant.cache_salt if tenant is not None else parsed.cache_salt
            if tenant is not None:
                body["cache_salt"] = salt
            # Only a tenant's salt changes the body; otherwise the caller's bytes go upstream.
            forwarded = decoded.encode() if self.tenants is not None else raw
            allowed = self.allowed(tenant)
            tokens, tokenize_s = None, 0.0
            if self.tokenizer.blocking:
                # An unknown model is a 404 before any tokenizing; plan() looks again after
                # the await, as the upstreams' model lists may have changed meanwhile.
                self.router.serving(parsed.model, allowed)
                started = time.perf_counter()
                # Off the event loop, in the lane of the body's size (lanes.py).
                tokens = await self._lanes.run(len(raw), self.router.tokens_for, parsed)
                if tokens is None:
                    raise lane_full(self._lanes)
                # The decision histogram covers tokenization wherever it ran, waits included.
                tokenize_s = time.perf_counter() - started
            plan = self.router.plan(
                parsed, record.request_id, self.router.identity(parsed.model, salt),
                tenant=tenant.name if tenant else None, allowed=allowed,
                session_id=session_id, tokens=tokens,
            )
        except ClientGone:
            record.status = CLIENT_LEFT
            record.error = "client left before its body was read"
            return
        except BODY_PROBLEMS as exc:
            error = as_request_error(exc)
        except KvreuseError as exc:  # e.g. a chat request and a tokenizer without a template
            error = RequestError(str(exc), None)
        else:
            if plan is None:
                self.metrics.reject(503, parsed.model)
                self._refusals.warning("no upstream serving %r admitted for %s (request %s)",
                                       parsed.model, path, record.request_id)
                record.status, record.error = 503, "no upstream admitted"
                await reply.json(503, no_upstream(parsed.model))
                return
            self.metrics.decision_seconds.observe(plan.decision_s + tokenize_s)
            record.view, record.max_tokens = plan.request, parsed.max_tokens
            assert self.forwarder is not None
            await self.forwarder.forward(receive, reply, path, forwarded, parsed, plan, record,
                                         trace, disconnect_hook(scope))
            return
        self._refused(error, path, record.model)
        record.status, record.error = error.status, str(error)
        # A body refused as too large also closes the connection: the rest is never read.
        await reply.json(error.status, error.body(),
                         [(b"connection", b"close")] if error.status == 413 else [])

    def _authenticate(self, headers: list[tuple[bytes, bytes]]) -> Tenant | None:
        """The caller's tenant from its one ``Authorization`` header (None with tenants off);
        :class:`RequestError` 401 for a missing or unknown key, 400 for two headers."""
        if self.tenants is None:
            return None
        authorization = None
        for name, value in headers:
            if name == b"authorization":
                if authorization is not None:
                    raise RequestError("send one Authorization header, not several",
                                       "authorization", 400)
                authorization = value
        tenant = self.tenants.authenticate(authorization)
        if tenant is None:
            raise RequestError("unknown or missing API key: send Authorization: Bearer KEY",
                               "authorization", 401)
        return tenant
