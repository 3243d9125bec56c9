"""Forwarding: try candidates in order until one answers, then pass its bytes through.

* Before the first byte reaches the client, an upstream failure (connection refused, no first
  byte within ``upstream_timeout_s``, 5xx, a stream that breaks before its first chunk) is
  retried on the next candidate, up to ``retries`` times; the failure counts against the
  upstream's health (:meth:`UpstreamState.record_failure`), and a timed-out request is
  cancelled upstream by closing its connection. A 5xx *answer* or a timeout, which the request
  itself may have caused, counts only on a second opinion (:mod:`kvreuse.gateway.quarantine`):
  once another upstream served the request, or when no other failed it the same way. Failed
  requests never eject more than ``max_ejected_share`` of a model's upstreams
  (:func:`~kvreuse.gateway.upstreams.ejection_leaves_short`).
* When every candidate failed, the client gets an OpenAI error body: 504 when they all timed
  out (then no upstream is charged: an overloaded fleet), the last upstream's 5xx status
  otherwise, 502 when none could be reached. A request answered 5xx twice and served nowhere
  is a request of death: no upstream is charged, and its repeats within the quarantine time
  are answered here, sent nowhere. One that two upstreams went down serving (their
  ``/health`` failing right after) is stopped there and held the same way.
* After the first byte, a stream whose upstream fails is continued on the next candidate
  (stream migration, :mod:`kvreuse.gateway.migration`; the same ``retries`` bound the
  upstreams one request may use); one that cannot be continued, or that no candidate could
  continue, ends with an SSE error event (``data: {"error": ...}``) and ``data: [DONE]``:
  nothing is dropped silently. A stream whose whole answer was sent before the break just
  gets its ``[DONE]``.
* Every failure the client sees, and every failed attempt, is logged at warning level with
  the request id, the upstream and the cause.
* 4xx answers are the caller's to fix: passed through unchanged, never retried.
* Whole responses are relayed up to ``max_response_bytes`` (larger: 502 naming the limit).
* A client that disconnects cancels its request wherever it is (waiting for the upstream,
  reading a whole response, relaying a stream): the upstream connection is closed, which
  makes vLLM abort the request.
* Streams are forwarded chunk by chunk as the upstream sends them (no buffering); the usage
  chunk, when the caller asked for one, is read on the fly to tally cached tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvreuse.gateway.asgi import DisconnectHook, RawHeaders, Receive, until_disconnect
from kvreuse.gateway.exchange import ClientReply, sse_error_event
from kvreuse.gateway.metrics import GatewayMetrics, TokenTally
from kvreuse.gateway.migration import (
    Complete,
    Continuation,
    StreamProgress,
    decode_usage,
    excerpt,
    opens_with_choices,
)
from kvreuse.gateway.quarantine import DEATHS_TO_STOP, UNAVAILABLE, Quarantine
from kvreuse.gateway.router import Candidate, Plan, Router
from kvreuse.gateway.serve import SHUTDOWN_MESSAGE, Drain
from kvreuse.gateway.telemetry import RequestRecord, ThrottledLog
from kvreuse.gateway.upstream_client import (
    UpstreamError,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamTooLarge,
)
from kvreuse.gateway.upstreams import (
    DEFAULT_MAX_EJECTED_SHARE,
    UpstreamState,
    ejection_leaves_short,
)
from kvreuse.gateway.validation import ParsedRequest, error_body

log = logging.getLogger("kvreuse.gateway.proxy")

CLIENT_LEFT = 499  # nginx's status for "the client closed the connection first"; metrics only


MAX_USAGE_TOKENS = 2**40
"""A usage figure above this is not a count an engine could report: the gateway ignores it, as
it does negative ones, booleans and non-integers (a single 10**400 once made every later
``/metrics`` scrape fail converting the running total to a float)."""


def token_count(value: object) -> int | None:
    """``value`` if it is a plausible token count from an upstream's usage, else None."""
    return value if type(value) is int and 0 <= value <= MAX_USAGE_TOKENS else None


def cached_tokens_of(usage: dict[str, Any] | None) -> tuple[int, int] | None:
    """``(prompt_tokens, cached_tokens)`` from an OpenAI usage object, or None when the engine
    did not report cached tokens or reported figures no engine could (:func:`token_count`;
    more cached than prompt tokens)."""
    if not usage:
        return None
    details = usage.get("prompt_tokens_details")
    prompt = token_count(usage.get("prompt_tokens"))
    if not isinstance(details, dict) or prompt is None:
        return None
    cached = token_count(details.get("cached_tokens"))
    return (prompt, cached) if cached is not None and cached <= prompt else None


def usage_of(content: bytes) -> dict[str, Any] | None:
    """The ``usage`` object of a whole JSON response, or None. O(bytes)."""
    if b'"usage"' not in content:  # errors and engines that report none: skip the decode
        return None
    return decode_usage(content)


class UpstreamErrorEvent(UpstreamError):
    """The upstream sent an error event in place of the rest of a stream."""

    kind = "ErrorEvent"


@dataclass(slots=True)
class _Attempts:
    """What the failed attempts of one request came to."""

    causes: list[str]
    timeouts: int = 0
    last_5xx: int = 0
    # Failures the request may have caused (a 5xx answer, no first byte in time), not yet
    # charged to their upstreams: a second opinion decides (quarantine.py).
    uncharged: list[tuple[Candidate, str]] = field(default_factory=list)
    answered_5xx: int = 0
    # Upstreams whose /health failed right after they failed this request.
    brought_down: list[str] = field(default_factory=list)


class Forwarder:
    """Sends planned requests upstream and answers the client; one per gateway."""

    def __init__(
        self,
        pools: Mapping[str, UpstreamPool],
        router: Router,
        metrics: GatewayMetrics,
        tallies: dict[str, TokenTally],
        *,
        policy_name: str,
        retries: int,
        upstream_timeout_s: float = 60.0,
        max_response_bytes: int = 64 << 20,
        migrate: bool = True,
        max_continuation_bytes: int = 8 << 20,
        drain: Drain | None = None,
        quarantine: Quarantine | None = None,
        probe: Callable[[UpstreamState], Awaitable[bool]] | None = None,
        max_ejected_share: float = DEFAULT_MAX_EJECTED_SHARE,
    ) -> None:
        """``quarantine`` remembers requests upstreams answered 5xx (its defaults when None);
        ``probe`` checks an upstream's health now (None: never checked here), after it failed
        a request it had received. ``max_ejected_share``: failed requests take at most this
        share of a model's upstreams out of rotation (:func:`ejection_leaves_short`).
        ``max_continuation_bytes`` bounds the answer kept to continue a stream (a longer
        one is not continued): the gateway's ``max_body_bytes``, as a continuation is a
        request the gateway sends. ``drain`` says when the server's grace period for
        requests in flight is over (their cancellation is then an ending to send)."""
        self.drain = drain if drain is not None else Drain()
        self.quarantine = quarantine if quarantine is not None else Quarantine()
        self.probe = probe
        self.max_ejected_share = max_ejected_share
        self._kept_admitted = ThrottledLog(log, burst=1, interval_s=10.0)
        self.pools = pools
        self.router = router
        self.metrics = metrics
        self.tallies = tallies
        self.policy_name = policy_name
        self.retries = retries
        self.upstream_timeout_s = upstream_timeout_s
        self.max_response_bytes = max_response_bytes
        self.migrate = migrate
        self.max_continuation_bytes = max_continuation_bytes

    async def forward(self, receive: Receive, reply: ClientReply, path: str, body: bytes,
                      parsed: ParsedRequest, plan: Plan, record: RequestRecord,
                      trace: Mapping[str, str], hook: DisconnectHook | None = None) -> None:
        """Answer the request from the first upstream that can (see the module docstring);
        ``record`` learns which upstream, the decision, the tokens and the status; ``trace``
        (validated trace-context headers) goes upstream with the request id; ``hook`` tells of
        the client leaving (else ``receive`` is watched)."""
        try:
            await until_disconnect(receive, self._forward(reply, path, body, parsed, plan,
                                                          record, trace), hook)
        except asyncio.CancelledError:
            if not self.drain.expired:
                raise
            task = asyncio.current_task()
            assert task is not None, "forward runs inside a task"
            task.uncancel()  # the server's grace period ended: end the request readably
            await self._shut_down(reply, record)
            return
        if record.status == 0:  # the client left before anything was sent upstream
            record.status, record.error = CLIENT_LEFT, "client left before the request was sent"

    async def _forward(self, reply: ClientReply, path: str, body: bytes,
                       parsed: ParsedRequest, plan: Plan, record: RequestRecord,
                       trace: Mapping[str, str]) -> None:
        if len(self.quarantine):  # hashed only while some request is remembered
            now = time.monotonic()
            verdict = self.quarantine.held(self._key(path, plan, body), now)
            if verdict is not None:
                self.metrics.requests_of_death.labels("held").inc()
                await self._answer_failure(reply, record, verdict.status, verdict.message(now),
                                           "-")
                return
        attempts = _Attempts([])
        try:
            await self._attempt(reply, path, body, parsed, plan, record, trace, attempts)
        finally:
            # Nothing said the request was at fault (no other upstream served it, or failed
            # it the same way): its failures count against their upstreams, as any failure.
            self._charge_deferred(attempts)

    @staticmethod
    def _defer_charge(attempts: _Attempts, candidate: Candidate, exc: UpstreamError,
                      progress: StreamProgress | None) -> bool:
        """Keep the failure in ``attempts.uncharged`` for a second opinion, and say so, when it
        may be the request's doing: no first byte in time (a prompt too long, a fleet
        overloaded by it and its like), unlike a refused or broken connection."""
        if progress is not None or not isinstance(exc, UpstreamTimeout):
            return False
        attempts.uncharged.append((candidate, exc.kind))
        return True

    def _served_elsewhere(self, path: str, plan: Plan, body: bytes,
                          attempts: _Attempts) -> None:
        """An upstream answered the request (below 500; a stream's first chunk): the failures
        before were their upstreams' fault, and the request is no request of death."""
        self._charge_deferred(attempts)
        if len(self.quarantine):
            self.quarantine.served(self._key(path, plan, body))

    def _charge_deferred(self, attempts: _Attempts) -> None:
        """Charge the failures kept for a second opinion to their upstreams, once."""
        for candidate, kind in attempts.uncharged:
            self._charge_health(candidate, kind)
        attempts.uncharged.clear()

    def _withhold(self, attempts: _Attempts, reason: str) -> None:
        """The failures kept for a second opinion were the request's doing, or the fleet's
        load's: none is charged, and the metric says how many and why."""
        if attempts.uncharged:
            self.metrics.failures_not_charged.labels(reason).inc(len(attempts.uncharged))
        attempts.uncharged.clear()

    def _key(self, path: str, plan: Plan, body: bytes) -> int:
        return Quarantine.key(path, plan.request.identity, body)

    async def _stop_after_deaths(self, reply: ClientReply, path: str, body: bytes, plan: Plan,
                                 record: RequestRecord, attempts: _Attempts,
                                 upstream: UpstreamState, status: int) -> bool:
        """``upstream`` failed the request after receiving it: when it was passing its probes,
        probe it, and when it is the ``DEATHS_TO_STOP``-th upstream found down, answer the
        client (the request goes no further: quarantine.py) and say True."""
        if self.probe is None or upstream.probe_failures or not upstream.healthy:
            return False  # down before this request, if down: not its doing
        if await self.probe(upstream):
            return False
        attempts.brought_down.append(upstream.name)
        log.warning("request %s: upstream %s failed it and its /health failed right after",
                    reply.request_id, upstream.name)
        if len(attempts.brought_down) < DEATHS_TO_STOP:
            return False
        now = time.monotonic()
        verdict = self.quarantine.brought_down(
            self._key(path, plan, body), tuple(attempts.brought_down), status,
            "; ".join(attempts.causes), now)
        # They are down: their probes eject them; a request that killed them charges none.
        self._withhold(attempts, "brought_down")
        self.metrics.requests_of_death.labels("brought_down").inc()
        await self._answer_failure(reply, record, status, verdict.message(now), "-")
        return True

    async def _attempt(self, reply: ClientReply, path: str, body: bytes,
                       parsed: ParsedRequest, plan: Plan, record: RequestRecord,
                       trace: Mapping[str, str], attempts: _Attempts) -> None:
        headers = {"x-request-id": reply.request_id, **trace}
        # Set once the client's stream has started: from then on an attempt continues it.
        progress: StreamProgress | None = None
        for attempt, candidate in enumerate(self.router.candidates(plan, self.retries + 1)):
            upstream = candidate.upstream
            record.upstream = upstream.name
            record.branch = candidate.branch
            record.predicted_cached_tokens = candidate.predicted_cached_tokens
            if attempt:
                record.retries = attempt
                if progress is None:
                    self.metrics.retries.labels(upstream.name).inc()
            sent = body
            if progress is not None:
                continuation = progress.continuation()
                assert isinstance(continuation, Continuation), "a stream continued unasked"
                sent = continuation.body
            sent_at = self.router.committed(plan, candidate)
            settled = False  # the router was told how this attempt ended
            try:
                try:
                    response = await self.pools[upstream.name].request(
                        "POST", path, sent, headers,
                        first_byte_timeout_s=self.upstream_timeout_s)
                except UpstreamError as exc:
                    settled = True
                    deferred = self._defer_charge(attempts, candidate, exc, progress)
                    self._failed(reply, plan, candidate, attempts, exc.kind, str(exc),
                                 timeout=isinstance(exc, UpstreamTimeout), health=not deferred)
                    if (progress is None and isinstance(exc, UpstreamProtocolError)
                            and await self._stop_after_deaths(reply, path, body, plan, record,
                                                              attempts, upstream, 502)):
                        return
                    continue
                if response.status >= 500:
                    content = await self._read_quietly(response)
                    settled = True
                    attempts.last_5xx = response.status
                    detail = f"{response.status} {excerpt(content, 200)}"
                    if progress is not None:
                        self._failed(reply, plan, candidate, attempts, "HTTP", detail)
                        continue
                    self._failed(reply, plan, candidate, attempts, "HTTP", detail, health=False)
                    attempts.uncharged.append((candidate, "HTTP"))
                    attempts.answered_5xx += 1
                    self.quarantine.answered_5xx(self._key(path, plan, body), upstream.name,
                                                 response.status, detail, time.monotonic())
                    # 502-504 say "cannot serve now" (a draining vLLM's /health fails too).
                    if (response.status not in UNAVAILABLE
                            and await self._stop_after_deaths(reply, path, body, plan, record,
                                                              attempts, upstream,
                                                              response.status)):
                        return
                    continue
                streamed = parsed.stream and response.status == 200
                if not streamed:
                    upstream.answered()
                    if progress is None:
                        self._served_elsewhere(path, plan, body, attempts)
                if progress is not None and response.status != 200:
                    content = await self._read_quietly(response)
                    settled = True
                    self._continuation_refused(reply, plan, candidate, response.status,
                                               content, record)
                    await self._end_stream(reply, record, progress, f"upstream {upstream.name} "
                                           f"refused the continuation: {response.status} "
                                           f"{excerpt(content, 200)}")
                    return
                if streamed:
                    stream = response.chunks()
                    try:
                        first = await stream.__anext__()
                    except StopAsyncIteration:
                        first = b""
                    except UpstreamError as exc:
                        await response.aclose()
                        settled = True
                        deferred = self._defer_charge(attempts, candidate, exc, progress)
                        self._failed(reply, plan, candidate, attempts, exc.kind,
                                     f"stream broke before its first chunk: {exc}",
                                     timeout=isinstance(exc, UpstreamTimeout),
                                     health=not deferred)
                        if (progress is None and isinstance(exc, UpstreamProtocolError)
                                and await self._stop_after_deaths(
                                    reply, path, body, plan, record, attempts, upstream, 502)):
                            return
                        continue
                    settled = True
                    upstream.answered()
                    # The first token times the prefill; a continuation's prompt is longer
                    # than the plan's, so it is not a sample.
                    if progress is None and opens_with_choices(first):
                        self.router.first_token(sent_at, self.router.clock() - sent_at.at)
                    if progress is None:
                        self._served_elsewhere(path, plan, body, attempts)
                        progress = StreamProgress(
                            parsed, migratable=self.migrate and self.retries > 0,
                            max_text_bytes=self.max_continuation_bytes)
                    else:
                        self.metrics.migrations.labels(upstream.name, "continued").inc()
                    if not await self._stream(reply, plan, candidate, response, first,
                                              stream, record, progress):
                        return
                    continue  # the stream broke and can be continued elsewhere
                try:
                    content = await response.read(self.max_response_bytes)
                except UpstreamTooLarge as exc:
                    settled = True
                    self._too_large(plan, candidate)
                    await self._answer_failure(reply, record, 502, str(exc), upstream.name)
                    return
                except UpstreamError as exc:
                    settled = True
                    self._failed(reply, plan, candidate, attempts, "body", f"broke: {exc}")
                    continue
                settled = True
                await self._whole(reply, plan, candidate, response, content, record)
                return
            except asyncio.CancelledError:  # the client left (or shutdown): abort quietly
                if not settled:
                    self._client_left(plan, candidate)
                    record.status = CLIENT_LEFT
                    record.error = "client left before the first byte"
                raise
        if progress is not None:
            self.metrics.migrations.labels(record.upstream or "-", "no_upstream").inc()
            causes = "; ".join(attempts.causes) or "no other upstream to try"
            await self._end_stream(reply, record, progress,
                                   f"{record.error}, and no upstream could continue the "
                                   f"stream: {causes}")
            return
        if attempts.timeouts >= 2 and attempts.timeouts == len(attempts.causes):
            # Too slow everywhere it was tried: an overloaded fleet (or a request too long for
            # the timeout), which ejecting replicas would turn into an outage.
            log.warning("request %s: no first byte from %d upstreams in time; none is charged "
                        "for it", reply.request_id, attempts.timeouts)
            self._withhold(attempts, "timed_out_everywhere")
        if attempts.answered_5xx:
            now = time.monotonic()
            verdict = self.quarantine.failed(self._key(path, plan, body),
                                             "; ".join(attempts.causes), now,
                                             attempts.answered_5xx)
            if verdict is not None:
                # The request's doing, or a fleet that cannot serve now: charge no upstream.
                self._withhold(attempts, "request_of_death" if verdict.held else "unavailable")
                self.metrics.requests_of_death.labels(
                    "detected" if verdict.held else "unavailable").inc()
                await self._answer_failure(reply, record, verdict.status,
                                           verdict.message(now), "-")
                return
        await self._all_failed(reply, attempts, record)

    async def _shut_down(self, reply: ClientReply, record: RequestRecord) -> None:
        """The gateway's grace period for requests in flight is over and this one still
        runs: a stream ends with an SSE error event, an unanswered request gets a 503 (a
        whole answer already under way can only be cut)."""
        message = (f"{SHUTDOWN_MESSAGE} and its grace period for requests in flight is over; "
                   "retry on another gateway")
        record.status, record.error = 503, message
        log.warning("request %s: %s", reply.request_id, message)
        await reply.fail(503, f"{message} (request id {reply.request_id})",
                         "ServiceUnavailableError")

    # ------------------------------------------------------------------ outcomes

    def _failed(self, reply: ClientReply, plan: Plan, candidate: Candidate,
                attempts: _Attempts, kind: str, detail: str, *, timeout: bool = False,
                health: bool = True) -> None:
        """An attempt failed before any byte reached the client: count and log it, and charge
        the upstream's health unless ``health`` is False (a second opinion decides)."""
        upstream = candidate.upstream
        self.router.first_byte(plan, candidate)
        self.router.finished(plan, candidate)
        attempts.causes.append(f"{upstream.name}: {detail}")
        if timeout:
            attempts.timeouts += 1
        log.warning("request %s: upstream %s failed before the first byte (%s): %s",
                    reply.request_id, upstream.name, kind, detail)
        self.metrics.upstream_errors.labels(upstream.name, kind).inc()
        if health:
            self._charge_health(candidate, kind)
        self.metrics.count_request(upstream.name, self.policy_name, candidate.branch,
                                   "upstream_error", plan.request.identity.model)

    def _charge_health(self, candidate: Candidate, kind: str) -> None:
        """A failed request counts against its upstream's health (passive ejection), up to
        the share of its models' upstreams failed requests may take out of rotation."""
        upstream = candidate.upstream
        short = (ejection_leaves_short(upstream, self.router.upstreams.values(),
                                       self.max_ejected_share)
                 if upstream.ejects_on_failure() else None)
        if upstream.record_failure(probe=False, may_eject=short is None):
            log.warning("upstream %s ejected after %d consecutive failed requests (last: %s)",
                        upstream.name, upstream.request_failures, kind)
        elif short is not None:
            self.metrics.ejections_withheld.labels(upstream.name).inc()
            self._kept_admitted.warning(
                "upstream %s kept admitted after %d consecutive failed requests (last: %s): "
                "ejecting it would take more than %s of the upstreams of model %s out of "
                "rotation (--max-ejected-share); it is sent requests only when no other "
                "upstream can take them, until a failed probe ejects it or the share allows",
                upstream.name, upstream.request_failures, kind,
                f"{self.max_ejected_share:.0%}", short)

    def _too_large(self, plan: Plan, candidate: Candidate) -> None:
        upstream = candidate.upstream
        self.router.first_byte(plan, candidate)
        self.router.finished(plan, candidate)
        self.metrics.upstream_errors.labels(upstream.name, UpstreamTooLarge.kind).inc()
        self.metrics.count_request(upstream.name, self.policy_name, candidate.branch, "502",
                                   plan.request.identity.model)

    def _client_left(self, plan: Plan, candidate: Candidate) -> None:
        self.router.first_byte(plan, candidate)
        self.router.finished(plan, candidate)
        self.metrics.count_request(candidate.upstream.name, self.policy_name,
                                   candidate.branch, str(CLIENT_LEFT),
                                   plan.request.identity.model)

    async def _all_failed(self, reply: ClientReply, attempts: _Attempts,
                          record: RequestRecord) -> None:
        causes = "; ".join(attempts.causes)
        if not attempts.causes:
            await self._answer_failure(reply, record, 503, "no upstream to try", "-")
        elif attempts.timeouts == len(attempts.causes):
            await self._answer_failure(
                reply, record, 504, f"no upstream sent a first byte within the upstream "
                f"timeout ({self.upstream_timeout_s:g} s): {causes}", "-",
                kind="GatewayTimeout")
        else:
            await self._answer_failure(reply, record, attempts.last_5xx or 502,
                                       f"no upstream answered: {causes}", "-")

    async def _answer_failure(self, reply: ClientReply, record: RequestRecord, status: int,
                              message: str, upstream: str, kind: str = "upstream_error"
                              ) -> None:
        log.warning("request %s: answered %d (upstream %s): %s", reply.request_id, status,
                    upstream, message)
        record.status, record.error = status, message
        await reply.json(status, error_body(f"{message} (request id {reply.request_id})",
                                            kind, status))

    def _headers(self, candidate: Candidate, content_type: bytes | None) -> RawHeaders:
        headers = [
            (b"x-kvreuse-upstream", candidate.upstream.header_name),
            (b"x-kvreuse-branch", candidate.branch.encode()),
            (b"x-kvreuse-predicted-cached-tokens", b"%d" % candidate.predicted_cached_tokens),
        ]
        if content_type is not None:
            headers.append((b"content-type", content_type))
        return headers

    def _done(self, plan: Plan, candidate: Candidate, status: int,
              usage: dict[str, Any] | None, record: RequestRecord) -> None:
        upstream = candidate.upstream
        record.status = status
        self.router.finished(plan, candidate)
        if status < 500:
            upstream.record_success(probe=False)
        self.metrics.count_request(upstream.name, self.policy_name, candidate.branch,
                                   str(status), plan.request.identity.model)
        completion = token_count(usage.get("completion_tokens")) if usage is not None else None
        if completion is not None:
            record.completion_tokens = completion
        counted = cached_tokens_of(usage)
        if counted is not None:
            record.prompt_tokens, record.cached_tokens = counted
            tally = self.tallies.get(upstream.name)
            if tally is None:
                tally = self.tallies[upstream.name] = TokenTally()
            tally.prompt_tokens += counted[0]
            tally.cached_tokens += counted[1]
            tally.predicted_tokens += candidate.predicted_cached_tokens
            self.router.realized(candidate, counted[0], counted[1])

    async def _whole(self, reply: ClientReply, plan: Plan, candidate: Candidate,
                     response: UpstreamResponse, content: bytes, record: RequestRecord) -> None:
        self.router.first_byte(plan, candidate)
        usage = usage_of(content) if response.status == 200 else None
        self._done(plan, candidate, response.status, usage, record)
        headers = self._headers(candidate, response.header_bytes(b"content-type"))
        await reply.send({"type": "http.response.start", "status": response.status,
                          "headers": [(b"content-length", b"%d" % len(content)), *headers]})
        await reply.send({"type": "http.response.body", "body": content})

    async def _stream(self, reply: ClientReply, plan: Plan, candidate: Candidate,
                      response: UpstreamResponse, first: bytes,
                      rest: AsyncIterator[bytes], record: RequestRecord,
                      progress: StreamProgress) -> bool:
        """Relay the stream chunk by chunk (``progress`` holds back an unfinished event and
        rewrites a continuation's); the upstream's part is done when its stream ends, breaks
        or the client leaves (the caller cancels this; the upstream connection is then closed,
        which makes vLLM abort the request). True when the stream broke and ``progress`` can
        continue it on another upstream; otherwise the client's stream has been ended (an SSE
        error event when it broke)."""
        self.router.first_byte(plan, candidate)
        upstream = candidate.upstream
        status = CLIENT_LEFT
        continuing = False
        try:
            if progress.upstreams == 0:
                content_type = (response.header_bytes(b"content-type")
                                or b"text/event-stream")
                await reply.send({"type": "http.response.start", "status": 200,
                                  "headers": self._headers(candidate, content_type)})
            progress.begin_upstream()
            try:
                await self._send_part(reply, progress.relay(first))
                if progress.failure is None:
                    async for chunk in rest:
                        upstream.answered()  # a busy engine's late /health is not a death
                        await self._send_part(reply, progress.relay(chunk))
                        if progress.failure is not None:
                            break
                if progress.failure is not None:
                    raise UpstreamErrorEvent(progress.failure)
            except UpstreamError as exc:
                status = 502
                self.metrics.upstream_errors.labels(upstream.name, "midstream").inc()
                self._charge_health(candidate, "midstream")
                continuation = progress.continuation()
                if isinstance(continuation, Complete):
                    log.warning("request %s: upstream %s failed after the whole answer was "
                                "sent (%s), the stream is ended for it: %s", reply.request_id,
                                upstream.name, exc.kind, exc)
                    await reply.send({"type": "http.response.body", "more_body": False,
                                      "body": continuation.tail})
                    status = 200
                    return False
                if isinstance(continuation, Continuation) and self.retries > record.retries:
                    log.warning("request %s: upstream %s failed after the first byte (%s), "
                                "continuing the stream elsewhere after %d tokens: %s",
                                reply.request_id, upstream.name, exc.kind,
                                continuation.carried, exc)
                    record.error = f"upstream {upstream.name} failed mid-stream: {exc}"
                    record.continued_from = (upstream.name if record.continued_from is None
                                             else f"{record.continued_from},{upstream.name}")
                    continuing = True
                    return True
                why = continuation if isinstance(continuation, str) else "no retries left"
                if isinstance(continuation, str):
                    self.metrics.migrations.labels(upstream.name, "not_continuable").inc()
                record.error = f"mid-stream: {exc}"
                log.warning("request %s: upstream %s failed after the first byte (%s), not "
                            "continued (%s): %s", reply.request_id, upstream.name, exc.kind,
                            why, exc)
                await reply.send({"type": "http.response.body", "more_body": False,
                                  "body": sse_error_event(
                                      f"upstream {upstream.name} failed mid-stream: {exc} "
                                      f"(request id {reply.request_id})")})
                return False
            await reply.send({"type": "http.response.body", "body": progress.flush(),
                              "more_body": False})
            status = 200
            return False
        except OSError:  # a server that reports the gone client by raising (ASGI spec 2.4)
            status = CLIENT_LEFT
            return False
        finally:
            await response.aclose()
            self._done(plan, candidate, status, progress.usage, record)
            if status == 200 and progress.upstreams > 1:
                record.completion_tokens = progress.completion_tokens()
                record.error = None  # continued: the client got one whole answer
            if continuing:
                progress.usage = None  # the next upstream's usage is its own

    @staticmethod
    async def _send_part(reply: ClientReply, part: bytes) -> None:
        if part:
            await reply.send({"type": "http.response.body", "body": part, "more_body": True})

    async def _end_stream(self, reply: ClientReply, record: RequestRecord,
                          progress: StreamProgress, message: str) -> None:
        """End a started stream that no upstream could continue: an SSE error event."""
        record.status, record.error = 502, message
        log.warning("request %s: %s", reply.request_id, message)
        await reply.send({"type": "http.response.body", "more_body": False,
                          "body": sse_error_event(f"{message} (request id {reply.request_id})")})

    def _continuation_refused(self, reply: ClientReply, plan: Plan, candidate: Candidate,
                              status: int, content: bytes, record: RequestRecord) -> None:
        self.router.first_byte(plan, candidate)
        self.router.finished(plan, candidate)
        self.metrics.migrations.labels(candidate.upstream.name, "refused").inc()
        self.metrics.count_request(candidate.upstream.name, self.policy_name, candidate.branch,
                                   str(status), plan.request.identity.model)

    @staticmethod
    async def _read_quietly(response: UpstreamResponse) -> bytes:
        try:
            return await response.read(1 << 20)
        except UpstreamError:
            return b""
