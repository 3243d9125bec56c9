"""Forwarding: try candidates in order until one answers, then pass its bytes through.

* Before the first byte reaches the client, an upstream failure (connection refused, timeout,
  5xx, a stream that breaks before its first chunk) is retried on the next candidate, up to
  ``retries`` times; the failure counts against the upstream's health.
* After the first byte, a failure ends the stream with an SSE error event
  (``data: {"error": ...}``) and ``data: [DONE]``: nothing is dropped silently.
* 4xx answers are the caller's to fix: passed through unchanged, never retried.
* Streams are forwarded chunk by chunk as the upstream sends them (no buffering); the usage
  chunk, when the caller asked for one, is read on the fly to tally cached tokens.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec

from kvreuse.gateway.asgi import (
    RawHeaders,
    Receive,
    Send,
    send_bytes,
    send_json,
    until_disconnect,
)
from kvreuse.gateway.metrics import GatewayMetrics, TokenTally
from kvreuse.gateway.router import Candidate, Plan, Router
from kvreuse.gateway.telemetry import RequestRecord
from kvreuse.gateway.upstream_client import UpstreamError, UpstreamPool, UpstreamResponse
from kvreuse.gateway.validation import ParsedRequest

log = logging.getLogger("kvreuse.gateway.proxy")

CLIENT_LEFT = 499  # nginx's status for "the client closed the connection first"; metrics only


class UsageScanner:
    """Finds the ``usage`` object in an SSE stream without holding the stream. O(bytes)."""

    def __init__(self) -> None:
        self._tail = b""
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> None:
        data = self._tail + chunk
        lines = data.split(b"\n")
        self._tail = lines.pop()
        if len(self._tail) > 1 << 20:  # a line this long is not an SSE event we care about
            self._tail = b""
        for line in lines:
            if line.startswith(b"data:") and b'"usage"' in line:
                self._take(line[5:])

    def _take(self, payload: bytes) -> None:
        usage = _decode_usage(payload)
        if usage is not None:
            self.usage = usage


def cached_tokens_of(usage: dict[str, Any] | None) -> tuple[int, int] | None:
    """``(prompt_tokens, cached_tokens)`` from an OpenAI usage object, or None when the engine
    did not report cached tokens."""
    if not usage:
        return None
    details = usage.get("prompt_tokens_details")
    prompt = usage.get("prompt_tokens")
    if not isinstance(details, dict) or not isinstance(prompt, int):
        return None
    cached = details.get("cached_tokens")
    return (prompt, cached) if isinstance(cached, int) else None


class _UsageEnvelope(msgspec.Struct):
    """A response or SSE event, reduced to its ``usage``: msgspec skips every other field
    without building it (about 6x faster than ``json.loads`` on a short completion)."""

    usage: dict[str, Any] | None = None


_usage_decoder = msgspec.json.Decoder(_UsageEnvelope)


def _decode_usage(payload: bytes) -> dict[str, Any] | None:
    try:
        return _usage_decoder.decode(payload).usage
    except msgspec.DecodeError:  # not JSON, not an object, or usage not an object
        return None


def usage_of(content: bytes) -> dict[str, Any] | None:
    """The ``usage`` object of a whole JSON response, or None. O(bytes)."""
    if b'"usage"' not in content:  # errors and engines that report none: skip the decode
        return None
    return _decode_usage(content)


def sse_error(message: str, status: int = 502) -> bytes:
    body = {"error": {"message": message, "type": "upstream_error", "code": status}}
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


class Forwarder:
    """Sends planned requests upstream and answers the client's ASGI ``send``; one per
    gateway."""

    def __init__(
        self,
        pools: Mapping[str, UpstreamPool],
        router: Router,
        metrics: GatewayMetrics,
        tallies: dict[str, TokenTally],
        *,
        policy_name: str,
        retries: int,
    ) -> None:
        self.pools = pools
        self.router = router
        self.metrics = metrics
        self.tallies = tallies
        self.policy_name = policy_name
        self.retries = retries
        self._names = {name: name.encode("latin-1") for name in pools}

    async def forward(self, receive: Receive, send: Send, path: str, body: bytes,
                      parsed: ParsedRequest, plan: Plan, record: RequestRecord,
                      trace: Mapping[str, str]) -> None:
        """Answer the client from the first candidate that answers; ``record`` learns which
        upstream, the decision, the tokens and the status; ``trace`` (validated trace-context
        headers) goes upstream with the request id."""
        failures: list[str] = []
        last_error: tuple[int, bytes, bytes | None] | None = None
        headers = {"x-request-id": plan.request.request_id, **trace}
        for attempt, candidate in enumerate(self.router.candidates(plan, self.retries + 1)):
            upstream = candidate.upstream
            record.upstream = upstream.name
            record.branch = candidate.branch
            record.predicted_cached_tokens = candidate.predicted_cached_tokens
            if attempt:
                record.retries = attempt
                self.metrics.retries.labels(upstream.name).inc()
            self.router.committed(plan, candidate)
            try:
                response = await self.pools[upstream.name].request("POST", path, body, headers)
            except UpstreamError as exc:
                failures.append(self._failed(plan, candidate, exc.kind, str(exc)))
                continue
            if response.status >= 500:
                content = await self._read_quietly(response)
                failures.append(self._failed(plan, candidate, "HTTP", str(response.status)))
                last_error = (response.status, content, response.header_bytes(b"content-type"))
                continue
            if parsed.stream and response.status == 200:
                stream = response.chunks()
                try:
                    first = await stream.__anext__()
                except StopAsyncIteration:
                    first = b""
                except UpstreamError as exc:
                    await response.aclose()
                    failures.append(self._failed(plan, candidate, "stream", f"broke: {exc}"))
                    continue
                await self._stream(receive, send, plan, candidate, response, first, stream,
                                   record)
                return
            try:
                content = await response.read()
            except UpstreamError as exc:
                failures.append(self._failed(plan, candidate, "body", f"broke: {exc}"))
                continue
            await self._whole(send, plan, candidate, response, content, record)
            return
        record.error = "; ".join(failures) or "no upstream to try"
        log.warning("request %s failed on every upstream tried: %s", record.request_id,
                    record.error)
        record.sent_first_byte()
        if last_error is not None:
            status, content, content_type = last_error
            record.status = status
            await send_bytes(send, status, content,
                             [(b"content-type", content_type)] if content_type else [])
            return
        record.status = 502
        message = "no upstream answered: " + "; ".join(failures) if failures else (
            "no upstream to try")
        await send_json(send, 502, {"error": {"message": message, "type": "upstream_error",
                                              "param": None, "code": 502}})

    # ------------------------------------------------------------------ outcomes

    def _failed(self, plan: Plan, candidate: Candidate, kind: str, detail: str) -> str:
        upstream = candidate.upstream
        self.router.first_byte(plan, candidate)
        self.router.finished(plan, candidate)
        log.warning("upstream %s failed (%s %s)", upstream.name, kind, detail)
        if upstream.record_failure():
            log.warning("upstream %s ejected after %d failures", upstream.name,
                        upstream.failures)
        self.metrics.upstream_errors.labels(upstream.name, kind).inc()
        self.metrics.count_request(upstream.name, self.policy_name, candidate.branch,
                                   "upstream_error", plan.request.identity.model)
        return f"{upstream.name}: {kind} {detail}"

    def _headers(self, candidate: Candidate, content_type: bytes | None) -> RawHeaders:
        headers = [
            (b"x-kvreuse-upstream", self._names[candidate.upstream.name]),
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
        if usage is not None and type(usage.get("completion_tokens")) is int:
            record.completion_tokens = usage["completion_tokens"]
        counted = cached_tokens_of(usage)
        if counted is not None:
            record.prompt_tokens, record.cached_tokens = counted
            tally = self.tallies.get(upstream.name)
            if tally is None:
                tally = self.tallies[upstream.name] = TokenTally()
            tally.prompt_tokens += counted[0]
            tally.cached_tokens += counted[1]
            tally.predicted_tokens += candidate.predicted_cached_tokens
            tally.requests_with_usage += 1
            self.router.realized(candidate, counted[0], counted[1])

    async def _whole(self, send: Send, plan: Plan, candidate: Candidate,
                     response: UpstreamResponse, content: bytes, record: RequestRecord) -> None:
        self.router.first_byte(plan, candidate)
        usage = usage_of(content) if response.status == 200 else None
        self._done(plan, candidate, response.status, usage, record)
        record.sent_first_byte()
        await send_bytes(send, response.status, content,
                         self._headers(candidate, response.header_bytes(b"content-type")))

    async def _stream(self, receive: Receive, send: Send, plan: Plan, candidate: Candidate,
                      response: UpstreamResponse, first: bytes,
                      rest: AsyncIterator[bytes], record: RequestRecord) -> None:
        """Relay the stream chunk by chunk; the request is done when the upstream's stream
        ends, breaks (an SSE error event ends the client's stream) or the client leaves (the
        upstream connection is then closed, which makes vLLM abort the request)."""
        self.router.first_byte(plan, candidate)
        scanner = UsageScanner()
        upstream = candidate.upstream
        content_type = response.header_bytes(b"content-type") or b"text/event-stream"

        async def relay() -> int:
            record.sent_first_byte()
            await send({"type": "http.response.start", "status": 200,
                        "headers": self._headers(candidate, content_type)})
            status = 200
            try:
                scanner.feed(first)
                await send({"type": "http.response.body", "body": first, "more_body": True})
                async for chunk in rest:
                    scanner.feed(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except UpstreamError as exc:
                status = 502
                record.error = f"mid-stream: {exc}"
                log.warning("request %s: upstream %s failed mid-stream: %s", record.request_id,
                            upstream.name, exc)
                upstream.record_failure()
                self.metrics.upstream_errors.labels(upstream.name, "midstream").inc()
                await send({"type": "http.response.body", "more_body": True, "body": sse_error(
                    f"upstream {upstream.name} failed mid-stream: {exc}")})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return status

        status: int | None = None
        try:
            status = await until_disconnect(receive, relay())
        except OSError:  # a server that reports the gone client by raising (ASGI spec 2.4)
            status = None
        finally:
            await response.aclose()
            self._done(plan, candidate, CLIENT_LEFT if status is None else status,
                       scanner.usage, record)

    @staticmethod
    async def _read_quietly(response: UpstreamResponse) -> bytes:
        try:
            return await response.read()
        except UpstreamError:
            return b""
