"""Prometheus text exposition parsing and the prefix-cache counters engines expose.

The token hit rate is cached prompt tokens over queried prompt tokens, from counters (seed 000):

* vLLM (V1): ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``, exposed by
  prometheus_client as ``..._total`` (plus ``..._created``); per ``engine`` and ``model_name``.
* vLLM, older releases: ``vllm:gpu_prefix_cache_hits`` / ``vllm:gpu_prefix_cache_queries``;
  the oldest expose only a gauge, ``vllm:gpu_prefix_cache_hit_rate``.
* SGLang: ``sglang:cached_tokens_total`` (per ``cache_source``) / ``sglang:prompt_tokens_total``;
  older ones only the gauge ``sglang:cache_hit_rate``.

Some exporters rewrite ``:`` to ``_``; names are matched in that normalised form. Counters are
summed over every label set (engines, cache sources), optionally filtered to one model.
"""

from __future__ import annotations

import contextlib
import http.client
import math
import re
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvreuse.errors import InputFormatError


@dataclass(frozen=True, slots=True)
class Sample:
    """One exposition line: metric name, labels, value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return next((v for k, v in self.labels if k == key), None)


_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    r"(?:\{(?P<labels>.*)\})?"
    r"\s+(?P<value>\S+)(?:\s+\S+)?\s*$"
)
# Possessive ``*+``: a label value of millions of escapes would otherwise cost the regex engine
# a backtracking frame per character (700 MB for a 4 MB value).
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*+)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _unescape(value: str) -> str:
    return re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group()], value)


def _parse_value(text: str, where: str) -> float:
    lowered = text.lower()
    if lowered in ("nan", "+inf", "-inf", "inf"):
        return float(lowered.replace("+", ""))
    try:
        return float(text)
    except ValueError:
        raise InputFormatError(f"sample value {text!r} is not a number", where=where) from None


def parse_exposition(
    text: str,
    source: str = "metrics",
    *,
    only: Collection[str] | None = None,
    strict: bool = True,
) -> list[Sample]:
    """Parse Prometheus text format (and OpenMetrics' ``# EOF``). O(size of the page).

    ``only``: keep the samples of these names (default: all); the other lines are not read
    further, which keeps a scrape for a few names cheap.
    ``strict=False`` skips a malformed line instead of raising: a scrape that must go on with
    what it can read."""
    samples: list[Sample] = []
    prefixes = ("",) if only is None else tuple(only)
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#") or not line.startswith(prefixes):
            continue
        where = f"{source}: line {number}"
        match = _SAMPLE.match(line)
        if match is not None and only is not None and match.group("name") not in only:
            continue
        try:
            if match is None:
                raise InputFormatError(f"not a metric sample: {line[:80]!r}", where=where)
            labels = _labels(match.group("labels") or "", line, where)
            value = _parse_value(match.group("value"), where)
        except InputFormatError:
            if strict:
                raise
            continue
        samples.append(Sample(match.group("name"), labels, value))
    return samples


def _labels(body: str, line: str, where: str) -> tuple[tuple[str, str], ...]:
    labels: list[tuple[str, str]] = []
    position = 0
    while position < len(body):
        label = _LABEL.match(body, position)
        if label is None:
            raise InputFormatError(f"bad labels in {line[:80]!r}", where=where)
        labels.append((label.group(1), _unescape(label.group(2))))
        position = label.end()
    return tuple(labels)


def normalise(name: str) -> str:
    return name.replace(":", "_")


@dataclass(frozen=True, slots=True)
class CounterFamily:
    """A pair of counters whose ratio is the token hit rate, by base name (no ``_total``)."""

    engine: str
    hits: str
    queries: str


COUNTER_FAMILIES: dict[str, CounterFamily] = {
    "vllm": CounterFamily("vllm", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"),
    "vllm-gpu": CounterFamily(
        "vllm", "vllm:gpu_prefix_cache_hits", "vllm:gpu_prefix_cache_queries"
    ),
    "sglang": CounterFamily("sglang", "sglang:cached_tokens", "sglang:prompt_tokens"),
}
"""Counter pairs in order of preference."""

GAUGE_HIT_RATES: dict[str, str] = {
    "vllm-gauge": "vllm:gpu_prefix_cache_hit_rate",
    "sglang-gauge": "sglang:cache_hit_rate",
}
"""Engines that expose only a precomputed rate (no window arithmetic possible)."""


@dataclass(frozen=True, slots=True)
class CacheCounters:
    """What one scrape says about prefix caching: cumulative hit and query tokens from a
    counter family, or only an engine-computed gauge."""

    family: str
    hits: float | None
    queries: float | None
    gauge_rate: float | None = None


def _sum(samples: Iterable[Sample], base: str, model: str | None) -> float | None:
    """Sum a counter over label sets; ``name_total`` preferred over the bare name."""
    wanted = normalise(base)
    by_name: dict[str, float] = {}
    for sample in samples:
        name = normalise(sample.name)
        if name not in (wanted, wanted + "_total"):
            continue
        if model is not None and sample.label("model_name") not in (None, model):
            continue
        if math.isnan(sample.value):
            continue
        if not 0 <= sample.value < math.inf:
            raise InputFormatError(f"{sample.name} is {sample.value!r}; a counter is finite "
                                   "and >= 0")
        by_name[name] = by_name.get(name, 0.0) + sample.value
    if wanted + "_total" in by_name:
        return by_name[wanted + "_total"]
    return by_name.get(wanted)


def cache_counters(samples: list[Sample], model: str | None = None) -> CacheCounters | None:
    """The first counter family present in ``samples``; else a gauge; else ``None``. Raises
    :class:`InputFormatError` for a counter that is infinite or negative (no rate from it)."""
    for key, family in COUNTER_FAMILIES.items():
        hits, queries = _sum(samples, family.hits, model), _sum(samples, family.queries, model)
        if hits is not None and queries is not None:
            return CacheCounters(key, hits, queries)
    for key, name in GAUGE_HIT_RATES.items():
        values = [
            s.value
            for s in samples
            if normalise(s.name) == normalise(name)
            and math.isfinite(s.value)
            and (model is None or s.label("model_name") in (None, model))
        ]
        if values:
            return CacheCounters(key, None, None, gauge_rate=sum(values) / len(values))
    return None


def metric_names(samples: Iterable[Sample]) -> Mapping[str, int]:
    """Metric names on a page with their sample counts (for 'no prefix-cache metrics' errors)."""
    counts: dict[str, int] = {}
    for sample in samples:
        counts[sample.name] = counts.get(sample.name, 0) + 1
    return counts


MAX_PAGE_BYTES = 64 << 20
"""A metrics page larger than this is refused, not read into memory (vLLM's is ~100 KB)."""


class _Deadline:
    """Shuts every socket of one fetch when its time is up: a socket timeout bounds each read,
    not the exchange, so a server that trickles a byte a second would otherwise hold a scrape
    for ever."""

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:  # the plain socket's shutdown, also under TLS: it
                with contextlib.suppress(OSError):  # wakes the read blocked on it
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            if self.expired:
                raise TimeoutError("timed out")
            self._sockets.append(sock)

    def handlers(self) -> list[urllib.request.BaseHandler]:
        """urllib handlers whose connections this deadline watches."""
        deadline = self

        class HTTP(urllib.request.HTTPHandler):
            def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
                return self.do_open(_watched(http.client.HTTPConnection, deadline), req)

        class HTTPS(urllib.request.HTTPSHandler):
            def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
                return self.do_open(_watched(http.client.HTTPSConnection, deadline), req,
                                    context=self._context)  # type: ignore[attr-defined]

        return [HTTP(), HTTPS()]


def _watched(base: type[http.client.HTTPConnection], deadline: _Deadline) -> Any:
    class Watched(base):  # type: ignore[valid-type,misc]
        def connect(self) -> None:
            super().connect()
            deadline.watch(self.sock)

    return Watched


def _one_line(text: str, limit: int = 200) -> str:
    """``text`` on one line, cut to ``limit`` characters (a peer chooses what it says)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def fetch_bytes(url: str, timeout_s: float, max_bytes: int = MAX_PAGE_BYTES) -> bytes:
    """GET ``url`` (redirects followed) within ``timeout_s`` seconds in all, reading at most
    ``max_bytes`` of body. Raises :class:`OSError` with a one-line reason when it cannot: no
    connection, an HTTP error status (``urllib.error.HTTPError``), a peer that does not speak
    HTTP, the time up, the body over ``max_bytes``."""
    request = urllib.request.Request(url, headers={"Accept": "text/plain"})
    chunks: list[bytes] = []
    size = 0
    with _Deadline(timeout_s) as deadline:
        opener = urllib.request.build_opener(*deadline.handlers())
        try:
            with opener.open(request, timeout=timeout_s) as response:
                while chunk := response.read1(1 << 16):
                    size += len(chunk)
                    if size > max_bytes:
                        raise OSError(f"answer is over the {max_bytes:,}-byte limit, not read "
                                      "further")
                    chunks.append(chunk)
                if response.length:  # read1 ends quietly where read() raises IncompleteRead
                    raise ConnectionError(f"the answer broke off {response.length:,} bytes "
                                          "short of its Content-Length")
        except urllib.error.HTTPError as exc:
            exc.msg = _one_line(str(exc.msg))  # a redirect loop's message spans three lines
            raise
        except (OSError, http.client.HTTPException) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            if deadline.expired or isinstance(reason, TimeoutError):
                raise TimeoutError(f"no whole answer within {timeout_s:g} s") from None
            if isinstance(exc, urllib.error.URLError):  # urlopen's wrapper: say its reason
                raise ConnectionError(_one_line(str(exc.reason))) from None
            if isinstance(exc, http.client.HTTPException):
                raise ConnectionError(_one_line(f"not a valid HTTP answer: "
                                                f"{type(exc).__name__}: {exc}")) from None
            raise
        if deadline.expired:
            raise TimeoutError(f"no whole answer within {timeout_s:g} s")
    return b"".join(chunks)


def fetch_page(url: str, timeout_s: float, max_bytes: int = MAX_PAGE_BYTES) -> str:
    """GET one metrics page (``url`` is the page itself, e.g. ``http://host:8000/metrics``):
    :func:`fetch_bytes`, decoded (invalid UTF-8 replaced). Raises :class:`OSError`."""
    return fetch_bytes(url, timeout_s, max_bytes).decode("utf-8", errors="replace")
