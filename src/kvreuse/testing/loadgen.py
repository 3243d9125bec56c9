"""An open-loop OpenAI client for the load benchmarks and multi-process tests.

Traffic comes from :mod:`kvreuse.sim.workloads` (the simulator's seeded generators), turned into
HTTP bodies every router understands: each token id becomes one 4-character ASCII word, so a
``kvreuse engine`` without a tokenizer (one token per 4 bytes) sees exactly the generated token
sequence, and text-based routers (sglang-router's character trees) see the same prefix structure.
Chats are sent to ``/v1/chat/completions`` as system / user / assistant messages (each turn
repeats the history), documents to ``/v1/completions``.

Requests are fired at their arrival times whatever the server does (open loop, so a slow router
is not rewarded with less traffic), streamed, and timed client-side: TTFT is the time to the
first SSE ``data:`` chunk. Hit rates are read from the engines' own ``/metrics`` counters.
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvreuse.gateway.upstreams import parse_prometheus
from kvreuse.hitrate.prometheus import fetch_page
from kvreuse.sim.requests import SimRequest
from kvreuse.sim.summary import percentile
from kvreuse.sim.workloads import ChatWorkload, DocumentWorkload
from kvreuse.testing.rawhttp import RawClient
from kvreuse.tokens import TOKEN_BYTES, unpack

ALPHABET = "".join(chr(c) for c in range(33, 127) if chr(c) not in "\"\\<|>")
"""Printable ASCII without JSON escapes or the approximate chat template's ``<|`` markers."""


def token_word(token: int) -> str:
    """Four ASCII characters naming ``token`` (ids beyond 89**4 wrap). O(1)."""
    base = len(ALPHABET)
    out = []
    for _ in range(4):
        token, digit = divmod(token, base)
        out.append(ALPHABET[digit])
    return "".join(out)


def tokens_text(tokens: bytes) -> str:
    """The text whose 4-byte approximation is exactly ``tokens``. O(n)."""
    return "".join(token_word(t) for t in unpack(tokens))


@dataclass(frozen=True, slots=True)
class Call:
    """One request of a workload: when, where, what."""

    at_s: float
    path: str
    body: bytes
    tenant: str = ""
    session: str = ""
    measured: bool = True
    prompt_tokens: int = 0


def _call(request: SimRequest, path: str, body: dict[str, object]) -> Call:
    """``request`` sent to ``path`` as ``body``, streamed at temperature 0."""
    body = {**body, "stream": True, "temperature": 0}
    return Call(request.arrival_s, path, json.dumps(body).encode(), request.tenant or "",
                request.session_id or "", request.measured, request.prompt_len)


def document_calls(workload: DocumentWorkload, seed: int, *, model: str,
                   max_tokens: int) -> list[Call]:
    """The contract library: each question is its document plus the question."""
    return [_call(request, "/v1/completions", {
        "model": model, "prompt": tokens_text(request.tokens), "max_tokens": max_tokens,
    }) for request in workload.generate(seed)]


def _chat_messages(request: SimRequest, workload: ChatWorkload) -> list[dict[str, str]]:
    """Cut a generated chat prompt back into its messages (fixed user/answer lengths)."""
    system, user, answer = (workload.system_tokens, workload.user_tokens[0],
                            workload.answer_tokens[0])
    buf = request.tokens
    words = [token_word(t) for t in unpack(buf)]
    messages = [{"role": "system", "content": "".join(words[:system])}]
    pos = system
    while pos + user < len(words):
        messages.append({"role": "user", "content": "".join(words[pos : pos + user])})
        messages.append({"role": "assistant",
                         "content": "".join(words[pos + user : pos + user + answer])})
        pos += user + answer
    messages.append({"role": "user", "content": "".join(words[pos:])})
    assert pos + user == len(buf) // TOKEN_BYTES, "chat prompt is not system + turns + user"
    return messages


def chat_calls(workload: ChatWorkload, seed: int, *, model: str, max_tokens: int) -> list[Call]:
    """Multi-turn chats: every turn resends the whole history as messages."""
    if workload.user_tokens[0] != workload.user_tokens[1] or (
            workload.answer_tokens[0] != workload.answer_tokens[1]):
        raise ValueError("chat_calls needs fixed user_tokens and answer_tokens lengths")
    return [_call(request, "/v1/chat/completions", {
        "model": model, "messages": _chat_messages(request, workload), "max_tokens": max_tokens,
    }) for request in workload.generate(seed)]


# ---------------------------------------------------------------------------- running


CANCELLED = "CancelledError"
"""How the ``error`` of a call cut off by the run's own stop begins (:func:`run_stream`)."""


@dataclass(slots=True)
class Result:
    """What the client saw of one call."""

    call: Call
    target: str
    status: int = 0
    ttft_s: float | None = None  # None: no first byte (the request was lost)
    total_s: float = 0.0
    error: str = ""
    upstream: str = ""
    cached_tokens: int | None = None  # from the usage chunk, when the caller asked for it
    late_s: float = 0.0  # how long after its ``at_s`` the sender got it out (a busy client)


async def _one(client: RawClient, call: Call, target: str,
               headers: Mapping[str, str], late_s: float = 0.0) -> Result:
    result = Result(call, target, late_s=late_s)
    hdrs = {"content-type": "application/json", **headers}
    if call.session:
        hdrs["x-session-id"] = call.session
    started = time.perf_counter()
    reply = await client.post(target + call.path, call.body, hdrs)
    result.total_s = time.perf_counter() - started
    result.status = reply.status
    result.upstream = reply.headers.get("x-kvreuse-upstream", "")
    if reply.first_byte_at is not None and reply.status == 200:
        result.ttft_s = reply.first_byte_at - started
    if reply.error:
        result.error = reply.error
    elif reply.status != 200:
        result.error = reply.tail[:300].decode(errors="replace")
    elif reply.saw_error_event:
        result.error = reply.tail[-300:].decode(errors="replace")
    else:
        result.cached_tokens = _cached_tokens(reply.tail)
    return result


def _cached_tokens(tail: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` from the last usage chunk of a stream."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data:") and b'"usage"' in line:
            try:
                event = json.loads(line[5:])
            except ValueError:
                return None
            # Whatever the target sent: only an object's usage object's details count.
            usage = event.get("usage") if isinstance(event, dict) else None
            details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            return cached if isinstance(cached, int) and not isinstance(cached, bool) else None
    return None


async def run_stream(
    calls: Iterable[Call],
    pick: Callable[[int, Call], str],
    on_result: Callable[[Result], None],
    *,
    headers: Callable[[Call], Mapping[str, str]] | None = None,
    timeout_s: float = 120.0,
    on_tick: Callable[[float], None] | None = None,
) -> int:
    """Like :func:`run_calls` for long runs: calls may be generated lazily and each result goes
    to ``on_result`` instead of being kept. Returns the number of calls sent. Every call sent
    gets exactly one result: one still in flight when the run is cancelled (Ctrl-C) gets a
    result whose ``error`` starts with :data:`CANCELLED`."""
    pending: set[asyncio.Task[Result]] = set()
    sent = 0

    def done(call: Call, target: str, task: asyncio.Task[Result]) -> None:
        pending.discard(task)
        if task.cancelled():
            on_result(Result(call, target, error=f"{CANCELLED}: the run was stopped"))
        else:
            on_result(task.result())

    client = RawClient(timeout_s=timeout_s)
    try:
        loop = asyncio.get_running_loop()
        clock = _Pacer(loop, on_tick)
        for i, call in enumerate(calls):
            late_s = await clock.wait_until(call.at_s)
            extra = headers(call) if headers is not None else {}
            target = pick(i, call)
            task = loop.create_task(_one(client, call, target, extra, late_s))
            pending.add(task)
            task.add_done_callback(functools.partial(done, call, target))
            sent += 1
        while pending:
            await asyncio.sleep(0.05)
            clock.tick_if_due()
    finally:
        await client.close()
    return sent


async def run_calls(
    calls: Sequence[Call],
    pick: Callable[[int, Call], str],
    *,
    headers: Callable[[Call], Mapping[str, str]] | None = None,
    timeout_s: float = 120.0,
    on_tick: Callable[[float], None] | None = None,
) -> list[Result]:
    """Fire every call at its ``at_s`` (seconds from now) at the URL ``pick(i, call)`` returns;
    wait for all. ``on_tick(elapsed)`` runs about every 0.5 s (fault injection hooks in)."""
    client = RawClient(timeout_s=timeout_s)
    try:
        loop = asyncio.get_running_loop()
        clock = _Pacer(loop, on_tick)
        tasks: list[asyncio.Task[Result]] = []
        for i, call in enumerate(calls):
            late_s = await clock.wait_until(call.at_s)
            extra = headers(call) if headers is not None else {}
            tasks.append(loop.create_task(_one(client, call, pick(i, call), extra, late_s)))
        return list(await asyncio.gather(*tasks))
    finally:
        await client.close()


class _Pacer:
    """Open-loop timing shared by the senders: sleep until a call is due, calling ``on_tick``
    with the elapsed seconds every 0.5 s on the way. A sender that has fallen behind still fires
    the ticks already due (each after a zero sleep) before its next call, so fault injection
    keeps its schedule when the client is late."""

    TICK_S = 0.5

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 on_tick: Callable[[float], None] | None) -> None:
        self._loop = loop
        self._on_tick = on_tick
        self._start = loop.time()
        self._next_tick = 0.0

    async def wait_until(self, at_s: float) -> float:
        """Return when ``at_s`` seconds have passed since the start, ticking on the way: how
        many seconds late that is (0 when the sender was waiting for it and woke on time)."""
        loop, start = self._loop, self._start
        if self._on_tick is not None:
            while self._next_tick <= at_s:
                await asyncio.sleep(max(start + self._next_tick - loop.time(), 0))
                self._on_tick(loop.time() - start)
                self._next_tick += self.TICK_S
        delay = start + at_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        return max(loop.time() - start - at_s, 0.0)  # a busy loop wakes a sleeper late too

    def tick_if_due(self) -> None:
        """While draining: one tick if its time has come."""
        elapsed = self._loop.time() - self._start
        if self._on_tick is not None and elapsed >= self._next_tick:
            self._on_tick(elapsed)
            self._next_tick += self.TICK_S


# ---------------------------------------------------------------------------- measuring


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """An engine's prefix-cache counters (vLLM's meaning: tokens looked up / served) and its
    time-to-first-token histogram's sum (seconds) and count."""

    queries: float = 0.0
    hits: float = 0.0
    ttft_sum_s: float = 0.0
    ttft_count: float = 0.0

    def minus(self, other: EngineCounters) -> EngineCounters:
        return EngineCounters(self.queries - other.queries, self.hits - other.hits,
                              self.ttft_sum_s - other.ttft_sum_s,
                              self.ttft_count - other.ttft_count)


SCRAPED = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
           "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count")


def scrape(urls: Sequence[str], timeout_s: float = 5.0) -> dict[str, EngineCounters]:
    """Each engine's :data:`SCRAPED` counters now (missing: zeros)."""
    out = {}
    for url in urls:
        try:
            text = fetch_page(url.rstrip("/") + "/metrics", timeout_s)
        except (OSError, http.client.HTTPException):
            out[url] = EngineCounters()
            continue
        values = parse_prometheus(text, SCRAPED)
        out[url] = EngineCounters(*(values.get(name, 0.0) for name in SCRAPED))
    return out


def engine_mean_ttft_s(before: Mapping[str, EngineCounters],
                       after: Mapping[str, EngineCounters]) -> float:
    """The engines' own mean time to first token between two scrapes (NaN without one)."""
    deltas = [after[u].minus(before.get(u, EngineCounters())) for u in after]
    count = sum(d.ttft_count for d in deltas)
    return sum(d.ttft_sum_s for d in deltas) / count if count else math.nan


@dataclass(frozen=True, slots=True)
class FleetHits:
    """Fleet token hit rate and how evenly the prompt tokens were spread."""

    hit_rate: float
    queries: float
    max_over_mean_load: float
    per_engine_queries: tuple[float, ...] = field(default=())


def fleet_hits(before: Mapping[str, EngineCounters],
               after: Mapping[str, EngineCounters]) -> FleetHits:
    deltas = [after[u].minus(before.get(u, EngineCounters())) for u in after]
    queries = sum(d.queries for d in deltas)
    hits = sum(d.hits for d in deltas)
    loads = [d.queries for d in deltas]
    mean = queries / len(loads) if loads else 0.0
    return FleetHits(hits / queries if queries else 0.0, queries,
                     max(loads) / mean if mean else 0.0, tuple(loads))


@dataclass(frozen=True, slots=True)
class LatencySummary:
    count: int
    lost: int
    p50_ms: float
    p95_ms: float
    p99_ms: float

    @staticmethod
    def of(results: Sequence[Result]) -> LatencySummary:
        measured = [r for r in results if r.call.measured]
        ttfts = [r.ttft_s * 1000 for r in measured if r.ttft_s is not None and not r.error]
        lost = sum(1 for r in measured if r.ttft_s is None or r.status != 200)
        p50, p95, p99 = (percentile(ttfts, q, empty=math.nan) for q in (0.5, 0.95, 0.99))
        return LatencySummary(len(measured), lost, p50, p95, p99)


@dataclass(frozen=True, slots=True)
class Measured:
    """A run's fleet hits (after warm-up), client latencies and raw results."""

    hits: FleetHits
    latency: LatencySummary
    results: tuple[Result, ...]


def measure_run(calls: Sequence[Call], targets: Sequence[str], engine_urls: Sequence[str],
                *, warmup_s: float,
                on_tick: Callable[[float], None] | None = None) -> Measured:
    """Send ``calls`` spread round robin over ``targets`` (gateways, or the engines themselves)
    and read the engines' counters at the end of warm-up and after the last answer."""
    snapshots: dict[str, dict[str, EngineCounters]] = {"start": scrape(engine_urls)}

    def tick(elapsed: float) -> None:
        if elapsed >= warmup_s and "warm" not in snapshots:
            snapshots["warm"] = {}
            future = asyncio.get_running_loop().run_in_executor(None, scrape, engine_urls)
            future.add_done_callback(lambda f: snapshots.__setitem__("warm", f.result()))
        if on_tick is not None:
            on_tick(elapsed)

    results = asyncio.run(run_calls(calls, lambda i, call: targets[i % len(targets)],
                                    on_tick=tick))
    hits = fleet_hits(snapshots.get("warm") or snapshots["start"], scrape(engine_urls))
    return Measured(hits, LatencySummary.of(results), tuple(results))
