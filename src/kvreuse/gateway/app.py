"""The gateway's ASGI application: endpoints, authentication, background loops.

Endpoints: ``POST /v1/completions`` and ``/v1/chat/completions`` (bodies forwarded unchanged
except ``cache_salt``), ``GET /v1/models`` (union of the healthy upstreams' models),
``/health`` (the process is up), ``/ready`` (at least one upstream admitted; 503 otherwise, with
the reason), ``/metrics`` (Prometheus).

Background: a health probe per upstream every ``health_interval_s``, a scrape of each
upstream's ``/metrics`` every ``metrics_interval_s`` (0 turns scraping off), and one KV-event
subscriber per upstream that has an events endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvreuse.errors import ConfigError, InputFormatError, KvreuseError
from kvreuse.gateway.config import GatewayConfig
from kvreuse.gateway.metrics import GatewayMetrics, GatewayState, TokenTally
from kvreuse.gateway.prompts import PromptTokenizer, load_prompt_tokenizer
from kvreuse.gateway.proxy import Forwarder
from kvreuse.gateway.router import Router
from kvreuse.gateway.subscriber import EventSubscriber
from kvreuse.gateway.tenants import Tenant, Tenants, load_tenants
from kvreuse.gateway.upstreams import UpstreamState, parse_prometheus
from kvreuse.gateway.validation import (
    ENDPOINT_KINDS,
    RequestError,
    parse_json_body,
    parse_request,
)
from kvreuse.identity import CacheIdentity
from kvreuse.routing import RoutingPolicy, build_policy

log = logging.getLogger("kvreuse.gateway")


class Gateway:
    """One gateway: config, state, the policy object and the ASGI :attr:`app`."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        tokenizer: PromptTokenizer | None = None,
        policy: RoutingPolicy | None = None,
        tenants: Tenants | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer or load_prompt_tokenizer(config.tokenizer)
        self.tenants = tenants or (load_tenants(Path(config.tenants)) if config.tenants else None)
        if self.tenants is not None and config.caller_salt is not None:
            self.tenants = dataclasses.replace(self.tenants, caller_salt=config.caller_salt)
        self.policy = policy or build_policy(
            config.policy, rng=random.Random(config.seed), **config.policy_options
        )
        self.upstreams = [
            UpstreamState(u, eject_after=config.eject_after, readmit_after=config.readmit_after)
            for u in config.upstreams
        ]
        if self.tenants is not None:
            known = {u.name for u in self.upstreams}
            for tenant, allowed in self.tenants.upstreams.items():
                unknown = sorted(set(allowed) - known)
                if unknown:
                    raise ConfigError(
                        f"tenants.{tenant}.upstreams names {', '.join(unknown)}, which are "
                        f"not upstreams; known: {', '.join(sorted(known))}"
                    )
        self.router = Router(self.policy, self.upstreams, self.tokenizer)
        self.tallies: dict[str, TokenTally] = {}
        self.state = GatewayState(self.upstreams, self.tallies, self.router.streams,
                                  self.router.index_size)
        self.metrics = GatewayMetrics(self.state)
        self.subscribers: list[EventSubscriber] = []
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._client: httpx.AsyncClient | None = None
        self.forwarder: Forwarder | None = None
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.generate, methods=["POST"]),
                Route("/v1/chat/completions", self.generate, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/ready", self.ready, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
            ],
            lifespan=self._lifespan,
        )

    # ------------------------------------------------------------------ lifecycle

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        config = self.config
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        )
        self.forwarder = Forwarder(
            self._client, self.router, self.metrics, self.tallies, policy_name=self.policy.name,
            retries=config.retries, upstream_api_key=config.upstream_api_key,
        )
        loop = asyncio.get_running_loop()
        for upstream in self.upstreams:
            if upstream.config.events:
                subscriber = self._subscriber(upstream)
                subscriber.open()
                self.subscribers.append(subscriber)
                self._tasks.append(loop.create_task(subscriber.run()))
            self._tasks.append(loop.create_task(self._probe_loop(upstream)))
            if config.metrics_interval_s > 0:
                self._tasks.append(loop.create_task(self._scrape_loop(upstream)))
        try:
            yield
        finally:
            for subscriber in self.subscribers:
                subscriber.close()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._client.aclose()

    def _subscriber(self, upstream: UpstreamState) -> EventSubscriber:
        name = upstream.name
        cfg = upstream.config
        assert cfg.events is not None
        return EventSubscriber(
            name, cfg.events, bind=cfg.bind, replay_endpoint=cfg.replay, topic=cfg.topic,
            on_batch=lambda batch: self.router.apply_batch(name, batch),
            on_cold=lambda reason: self.router.mark_cold(name, reason),
            stats=self.router.streams[name],
        )

    async def _probe_loop(self, upstream: UpstreamState) -> None:
        assert self._client is not None
        url = upstream.config.url.rstrip("/") + "/health"
        while True:
            try:
                response = await self._client.get(url, timeout=self.config.connect_timeout_s)
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok and upstream.record_success(probe=True):
                log.warning("upstream %s re-admitted", upstream.name)
            elif not ok and upstream.record_failure():
                log.warning("upstream %s ejected (health probes failing)", upstream.name)
            await asyncio.sleep(self.config.health_interval_s)

    async def _scrape_loop(self, upstream: UpstreamState) -> None:
        assert self._client is not None
        url = upstream.config.url.rstrip("/") + "/metrics"
        while True:
            await self.scrape(upstream, url)
            await asyncio.sleep(self.config.metrics_interval_s)

    async def scrape(self, upstream: UpstreamState, url: str | None = None) -> None:
        """Read one upstream's /metrics now (also used by tests to avoid waiting)."""
        assert self._client is not None
        target = url or upstream.config.url.rstrip("/") + "/metrics"
        with contextlib.suppress(httpx.HTTPError):
            response = await self._client.get(target, timeout=self.config.connect_timeout_s)
            if response.status_code == 200:
                upstream.update_engine(parse_prometheus(response.text))

    # ------------------------------------------------------------------ endpoints

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        admitted = [u.name for u in self.upstreams if u.healthy]
        ejected = [u.name for u in self.upstreams if not u.healthy]
        body = {"ready": bool(admitted), "admitted": admitted, "ejected": ejected}
        return JSONResponse(body, status_code=200 if admitted else 503)

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry),
                        media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> Response:
        assert self._client is not None
        client = self._client

        headers = {} if self.forwarder is None else {
            k: v for k, v in self.forwarder.headers.items() if k == "authorization"}

        async def fetch(upstream: UpstreamState) -> list[dict[str, Any]]:
            try:
                response = await client.get(upstream.config.url.rstrip("/") + "/v1/models",
                                            headers=headers)
                data = response.json().get("data", []) if response.status_code == 200 else []
            except (httpx.HTTPError, ValueError, AttributeError):
                return []
            return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]

        lists = await asyncio.gather(*(fetch(u) for u in self.upstreams if u.healthy))
        merged: dict[str, dict[str, Any]] = {}
        for models in lists:
            for model in models:
                merged.setdefault(model["id"], model)
        return JSONResponse({"object": "list", "data": list(merged.values())})

    def _authenticate(self, request: Request) -> Tenant | None:
        if self.tenants is None:
            return None
        tenant = self.tenants.authenticate(request.headers.get("authorization"))
        if tenant is None:
            raise RequestError("unknown or missing API key: send Authorization: Bearer KEY",
                               "authorization", 401)
        return tenant

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestError(f"the body is larger than {limit} bytes", "body", 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(f"the body is larger than {limit} bytes", "body", 413)
            chunks.append(chunk)
        return b"".join(chunks)

    async def generate(self, request: Request) -> Response:
        path = request.url.path
        try:
            tenant = self._authenticate(request)
            raw = await self._read_body(request)
            body = parse_json_body(raw)
            if self.tenants is not None and "cache_salt" in body:
                if self.tenants.caller_salt == "reject":
                    raise RequestError(
                        "cache_salt is set by the gateway from your API key; remove it",
                        "cache_salt")
                del body["cache_salt"]
            parsed = parse_request(ENDPOINT_KINDS[path], body)
            salt = tenant.cache_salt if tenant is not None else parsed.cache_salt
            if tenant is not None:
                body["cache_salt"] = salt
            # Only a tenant's salt changes the body; otherwise the caller's bytes go upstream.
            forwarded = json.dumps(body).encode() if self.tenants is not None else raw
            plan = self.router.plan(
                parsed, f"gw-{next(self._ids)}-{time.monotonic_ns()}",
                CacheIdentity(cache_salt=salt),
                tenant=tenant.name if tenant else None,
                allowed=tenant.upstreams if tenant else None,
                session_id=request.headers.get("x-session-id"),
            )
        except RequestError as exc:
            self.metrics.rejected.labels(str(exc.status)).inc()
            return JSONResponse(exc.body(), status_code=exc.status)
        except InputFormatError as exc:
            error = RequestError(str(exc), exc.where or "body")
            self.metrics.rejected.labels("400").inc()
            return JSONResponse(error.body(), status_code=400)
        except KvreuseError as exc:  # e.g. a chat request and a tokenizer without a template
            self.metrics.rejected.labels("400").inc()
            return JSONResponse(RequestError(str(exc), None).body(), status_code=400)
        if plan is None:
            self.metrics.rejected.labels("503").inc()
            return JSONResponse(
                {"error": {"message": "no upstream is admitted for this request (all ejected, "
                           "or none in the tenant's subset)", "type": "ServiceUnavailable",
                           "param": None, "code": 503}}, status_code=503)
        self.metrics.decision_seconds.observe(plan.decision_s)
        assert self.forwarder is not None
        return await self.forwarder.forward(path, forwarded, parsed, plan)
