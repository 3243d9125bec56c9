"""What the gateway tells operators about each request: the access log and trace headers.

A :class:`RequestRecord` is created when a request arrives, filled in as it is routed and
answered (upstream, policy decision, predicted and realized cached tokens, status, when the
first byte went to the client), and finished exactly once: it then feeds the request-duration
and TTFT histograms (:class:`~kvreuse.gateway.metrics.GatewayMetrics`) and, when the access log
is on, becomes one line on stdout, as text or JSON (:class:`AccessLog`).

What a line never holds: the tenant's cache salt (it is derived from the gateway's secret), the
API key, or the prompt. Values that come from the caller (model, request id) are escaped, and
the model is cut to :data:`MAX_LOGGED_MODEL_CHARS` characters, so one line stays one line.

Trace context (W3C Trace Context): a valid ``traceparent`` and, with it, a bounded
``tracestate`` are forwarded upstream unchanged; an invalid ``traceparent`` is dropped with its
``tracestate`` (as the specification asks of a component that cannot parse it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import msgspec

from kvreuse.errors import ConfigError
from kvreuse.gateway.config import ACCESS_LOG_MODES
from kvreuse.routing.base import RequestView

MAX_LOGGED_MODEL_CHARS = 128
MAX_TRACESTATE_BYTES = 512  # W3C: vendors may drop longer tracestate values
FLUSH_INTERVAL_S = 0.2  # how long an access line may wait to be written
FLUSH_LINES = 256

_TRACEPARENT = re.compile(rb"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_TRACESTATE_CHAR = re.compile(rb"[\x20-\x7e]*")


def valid_traceparent(value: bytes) -> bool:
    """A W3C ``traceparent`` (version-traceid-parentid-flags, lowercase hex) whose trace and
    parent ids are not all zeros, and not the forbidden version ``ff``."""
    if len(value) != 55 or _TRACEPARENT.fullmatch(value) is None:
        return False
    return value[:2] != b"ff" and value[3:35] != b"0" * 32 and value[36:52] != b"0" * 16


def trace_headers(traceparent: bytes | None, tracestate: bytes | None) -> dict[str, str]:
    """The trace headers to forward upstream: none without a valid ``traceparent``;
    ``tracestate`` only when it is printable ASCII of at most :data:`MAX_TRACESTATE_BYTES`."""
    if traceparent is None or not valid_traceparent(traceparent):
        return {}
    headers = {"traceparent": traceparent.decode("ascii")}
    if (tracestate is not None and len(tracestate) <= MAX_TRACESTATE_BYTES
            and _TRACESTATE_CHAR.fullmatch(tracestate) is not None and tracestate.strip()):
        headers["tracestate"] = tracestate.decode("ascii")
    return headers


@dataclass(slots=True)
class RequestRecord:
    """One request as it goes: filled in by the gateway and the forwarder, finished once.

    Times are ``time.perf_counter()`` readings; ``first_byte`` stays None when nothing was
    sent to the client (a refusal, or the client left first)."""

    request_id: str
    path: str
    started: float
    model: str | None = None
    tenant: str | None = None
    upstream: str | None = None
    branch: str | None = None
    predicted_cached_tokens: int | None = None
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    retries: int = 0
    # The upstreams whose stream broke mid-answer and was continued elsewhere, in order.
    continued_from: str | None = None
    status: int = 0
    first_byte: float | None = None
    finished: float | None = None
    error: str | None = None
    # For `--record`: what the router saw, the request's max_tokens, the engine's usage.
    view: RequestView | None = None
    max_tokens: int | None = None
    completion_tokens: int | None = None

    def sent_first_byte(self) -> None:
        """Called just before the response's first byte goes to the client. O(1)."""
        if self.first_byte is None:
            self.first_byte = time.perf_counter()

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_byte is None else self.first_byte - self.started

    @property
    def total_s(self) -> float | None:
        return None if self.finished is None else self.finished - self.started


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def access_fields(record: RequestRecord, policy: str) -> dict[str, Any]:
    """The access-log fields of a finished record, in their logged order."""
    model = record.model
    if model is not None and len(model) > MAX_LOGGED_MODEL_CHARS:
        model = model[:MAX_LOGGED_MODEL_CHARS] + "..."
    return {
        "request_id": record.request_id,
        "path": record.path,
        "model": model,
        "tenant": record.tenant,
        "upstream": record.upstream,
        "policy": policy,
        "branch": record.branch,
        "predicted_cached_tokens": record.predicted_cached_tokens,
        "cached_tokens": record.cached_tokens,
        "prompt_tokens": record.prompt_tokens,
        "retries": record.retries,
        "continued_from": record.continued_from,
        "status": record.status,
        "ttft_ms": _ms(record.ttft_s),
        "total_ms": _ms(record.total_s),
        "error": record.error,
    }


_BARE = re.compile(r"[A-Za-z0-9._:/@+-]+")


def _text_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        # Caller-chosen strings (model, request id) are quoted JSON-style unless plainly safe:
        # no spaces, quotes, '=' or control characters can break the line into fake fields.
        return value if _BARE.fullmatch(value) else json.dumps(value)
    return str(value)


def format_access_line(fields: dict[str, Any], mode: str, now: float) -> str:
    """One access-log line: ``time=... key=value ...`` (text) or a JSON object (json)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
    if mode == "json":
        line = {"time": stamp, **fields}
        try:
            return msgspec.json.encode(line).decode()
        except UnicodeEncodeError:  # a lone surrogate a caller sent as "\ud800": escape it
            return json.dumps(line, separators=(",", ":"))
    return f"time={stamp} " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())


class AccessLog:
    """Writes finished records as lines in ``mode`` (off, text, json) to ``stream`` (default:
    ``sys.stdout`` as it is when the lines are written).

    Lines are held and written together, on :meth:`flush`: every :data:`FLUSH_INTERVAL_S`
    (the gateway runs :meth:`run`), when :data:`FLUSH_LINES` are pending, and at shutdown. One
    write and flush per request cost a gateway process about 75 us of CPU per request under
    load (benchmarks/gateway_throughput.py, part d); batched, a line costs its formatting.
    A stream that cannot be written (a closed pipe) turns the access log off, with a warning.
    """

    def __init__(self, mode: str, policy: str, stream: TextIO | None = None) -> None:
        if mode not in ACCESS_LOG_MODES:
            raise ValueError(f"access log mode must be one of {ACCESS_LOG_MODES}, got {mode!r}")
        self.mode = mode
        self.policy = policy
        self.stream = stream
        self._pending: list[str] = []

    def write(self, record: RequestRecord) -> None:
        """Queue one line for ``record`` (nothing when off). O(fields)."""
        if self.mode == "off":
            return
        self._pending.append(format_access_line(access_fields(record, self.policy), self.mode,
                                                time.time()))
        if len(self._pending) >= FLUSH_LINES:
            self.flush()

    def flush(self) -> None:
        """Write the pending lines and flush the stream. O(pending)."""
        if not self._pending:
            return
        text = "\n".join(self._pending) + "\n"
        self._pending.clear()
        stream = self.stream or sys.stdout
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError) as exc:  # a closed pipe or file
            self.mode = "off"
            logging.getLogger("kvreuse.gateway").warning(
                "access log: cannot write (%s); access log turned off", exc)

    async def run(self) -> None:
        """Flush every :data:`FLUSH_INTERVAL_S` until cancelled (then flush once more)."""
        try:
            while True:
                await asyncio.sleep(FLUSH_INTERVAL_S)
                self.flush()
        finally:
            self.flush()


class ThrottledLog:
    """Logs at most ``burst`` messages per ``interval_s`` to ``logger`` at WARNING; the ones
    held back are counted and the next message that passes says how many. A flood of bad
    requests then costs a few lines a second, not one each."""

    def __init__(self, logger: logging.Logger, *, burst: int = 10, interval_s: float = 1.0
                 ) -> None:
        self.logger = logger
        self.burst = burst
        self.interval_s = interval_s
        self._window_start = float("-inf")
        self._in_window = 0
        self.suppressed = 0

    def warning(self, message: str, *args: object) -> None:
        """``message % args`` (each argument cut to 300 characters), unless over budget."""
        now = time.monotonic()
        if now - self._window_start >= self.interval_s:
            self._window_start = now
            self._in_window = 0
        if self._in_window >= self.burst:
            self.suppressed += 1
            return
        self._in_window += 1
        if self.suppressed:
            message += f" ({self.suppressed} similar messages suppressed)"
            self.suppressed = 0
        self.logger.warning(message, *(
            arg[:300] + "..." if isinstance(arg, str) and len(arg) > 300 else arg
            for arg in args))


def configure_logging(level: str) -> None:
    """Root logging for ``kvreuse route`` and ``kvreuse engine``: ``level`` and above to
    stderr with time, level and logger name, so warnings show at the default level."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ConfigError(f"--log-level must be one of debug, info, warning, error, critical; "
                          f"got {level!r}")
    logging.basicConfig(level=numeric, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
