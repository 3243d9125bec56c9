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
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvreuse.gateway.metrics import GatewayMetrics, TokenTally
from kvreuse.gateway.router import Candidate, Plan, Router
from kvreuse.gateway.validation import ParsedRequest

log = logging.getLogger("kvreuse.gateway.proxy")


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
        try:
            event = json.loads(payload)
        except ValueError:
            return
        if isinstance(event, dict) and isinstance(event.get("usage"), dict):
            self.usage = event["usage"]


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


def sse_error(message: str, status: int = 502) -> bytes:
    body = {"error": {"message": message, "type": "upstream_error", "code": status}}
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


class Forwarder:
    """Sends planned requests upstream; one per gateway."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        router: Router,
        metrics: GatewayMetrics,
        tallies: dict[str, TokenTally],
        *,
        policy_name: str,
        retries: int,
        upstream_api_key: str | None = None,
    ) -> None:
        self.client = client
        self.router = router
        self.metrics = metrics
        self.tallies = tallies
        self.policy_name = policy_name
        self.retries = retries
        self.headers = {"content-type": "application/json"}
        if upstream_api_key:
            self.headers["authorization"] = f"Bearer {upstream_api_key}"

    async def forward(self, path: str, body: bytes, parsed: ParsedRequest, plan: Plan) -> Response:
        failures: list[str] = []
        last_error: Response | None = None
        for attempt, candidate in enumerate(plan.candidates[: self.retries + 1]):
            upstream = candidate.upstream
            if attempt:
                self.metrics.retries.labels(upstream.name).inc()
            self.router.committed(plan, candidate)
            try:
                request = self.client.build_request(
                    "POST", upstream.config.url.rstrip("/") + path, content=body,
                    headers={**self.headers, "x-request-id": plan.request.request_id},
                )
                response = await self.client.send(request, stream=True)
            except httpx.HTTPError as exc:
                failures.append(self._failed(plan, candidate, f"{type(exc).__name__}: {exc}"))
                continue
            if response.status_code >= 500:
                content = await self._read_quietly(response)
                failures.append(self._failed(plan, candidate, f"HTTP {response.status_code}"))
                last_error = Response(content, response.status_code,
                                      media_type=response.headers.get("content-type"))
                continue
            if parsed.stream and response.status_code == 200:
                stream = response.aiter_raw()
                try:
                    first = await stream.__anext__()
                except StopAsyncIteration:
                    first = b""
                except httpx.HTTPError as exc:
                    await response.aclose()
                    failures.append(self._failed(plan, candidate, f"stream broke: {exc}"))
                    continue
                return self._stream(plan, candidate, response, first, stream)
            try:
                content = await response.aread()
            except httpx.HTTPError as exc:
                failures.append(self._failed(plan, candidate, f"body broke: {exc}"))
                continue
            finally:
                await response.aclose()
            return self._whole(plan, candidate, response, content)
        if last_error is not None:
            return last_error
        message = "no upstream answered: " + "; ".join(failures) if failures else (
            "no upstream to try")
        return JSONResponse(
            {"error": {"message": message, "type": "upstream_error", "param": None,
                       "code": 502}}, status_code=502)

    # ------------------------------------------------------------------ outcomes

    def _failed(self, plan: Plan, candidate: Candidate, why: str) -> str:
        upstream = candidate.upstream
        self.router.first_byte(plan, candidate)
        self.router.finished(plan, candidate)
        if upstream.record_failure():
            log.warning("upstream %s ejected after %d failures", upstream.name,
                        upstream.failures)
        kind = why.split(":")[0].split(" ")[0]
        self.metrics.upstream_errors.labels(upstream.name, kind).inc()
        self.metrics.requests.labels(upstream.name, self.policy_name, candidate.branch,
                                     "upstream_error").inc()
        return f"{upstream.name}: {why}"

    def _headers(self, candidate: Candidate, response: httpx.Response) -> dict[str, str]:
        return {
            "x-kvreuse-upstream": candidate.upstream.name,
            "x-kvreuse-branch": candidate.branch,
            "x-kvreuse-predicted-cached-tokens": str(candidate.predicted_cached_tokens),
        }

    def _done(self, plan: Plan, candidate: Candidate, status: int,
              usage: dict[str, Any] | None) -> None:
        upstream = candidate.upstream
        self.router.finished(plan, candidate)
        if status < 500:
            upstream.record_success(probe=False)
        self.metrics.requests.labels(upstream.name, self.policy_name, candidate.branch,
                                     str(status)).inc()
        counted = cached_tokens_of(usage)
        if counted is not None:
            tally = self.tallies.setdefault(upstream.name, TokenTally())
            tally.prompt_tokens += counted[0]
            tally.cached_tokens += counted[1]
            tally.predicted_tokens += candidate.predicted_cached_tokens
            tally.requests_with_usage += 1

    def _whole(self, plan: Plan, candidate: Candidate, response: httpx.Response,
               content: bytes) -> Response:
        self.router.first_byte(plan, candidate)
        usage = None
        if response.status_code == 200:
            try:
                decoded = json.loads(content)
                usage = decoded.get("usage") if isinstance(decoded, dict) else None
            except ValueError:
                usage = None
        self._done(plan, candidate, response.status_code, usage)
        return Response(content, response.status_code, headers=self._headers(candidate, response),
                        media_type=response.headers.get("content-type"))

    def _stream(self, plan: Plan, candidate: Candidate, response: httpx.Response, first: bytes,
                rest: AsyncIterator[bytes]) -> StreamingResponse:
        self.router.first_byte(plan, candidate)
        scanner = UsageScanner()

        async def relay() -> AsyncIterator[bytes]:
            status = 200
            try:
                scanner.feed(first)
                yield first
                async for chunk in rest:
                    scanner.feed(chunk)
                    yield chunk
            except httpx.HTTPError as exc:
                status = 502
                candidate.upstream.record_failure()
                self.metrics.upstream_errors.labels(candidate.upstream.name, "midstream").inc()
                yield sse_error(f"upstream {candidate.upstream.name} failed mid-stream: {exc}")
            finally:
                await response.aclose()
                self._done(plan, candidate, status, scanner.usage)

        return StreamingResponse(relay(), status_code=200,
                                 headers=self._headers(candidate, response),
                                 media_type=response.headers.get("content-type",
                                                                 "text/event-stream"))

    @staticmethod
    async def _read_quietly(response: httpx.Response) -> bytes:
        try:
            return await response.aread()
        except httpx.HTTPError:
            return b""
        finally:
            await response.aclose()
