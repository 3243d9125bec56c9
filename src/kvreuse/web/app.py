"""The lab's HTTP side: one page, its static files, and a small JSON API.

Routes:

* ``GET /`` — the page (``static/index.html``); ``GET /static/...`` — its JS and CSS;
* ``GET /api/config`` — defaults, the names each control may take, limits, and the missions;
* ``POST /api/run`` — a JSON object of controls (absent fields keep their defaults) → the run
  (:func:`kvreuse.web.result.result_to_json`); ``GET /api/run?...`` takes the same controls as
  a query string (what :func:`kvreuse.web.links.lab_url` builds).

Bad input answers 400 with ``{"error": ..., "field": ...}`` naming what to fix: malformed JSON,
bytes that are not UTF-8, lone surrogates, oversized integers and deep nesting included
(:func:`kvreuse.json_input.parse_json`). A body over :data:`MAX_BODY_BYTES` is refused with 413
as soon as its ``Content-Length`` or its first bytes past the limit show it, never read whole.

Work is bounded twice: one run may simulate at most ``Limits.max_requests`` requests (the
controls' ranges bound the rest), and at most ``max_concurrent_runs`` simulations run at once;
further runs wait for a slot (up to ``max_waiting_runs`` of them, for at most
``queue_timeout_s``) and are otherwise answered 503 with ``Retry-After``. Runs are deterministic
for given controls, so recent results are kept and a repeated run (the page's replay, a mission
re-check) is answered without simulating again.

A run belongs to its client: when the connection closes (a closed tab, a script that gave up)
the run leaves the queue, or, if it is simulating, is cancelled at its next arrival
(:class:`~kvreuse.web.controls.RunCancelled`) and frees its slot. Before, starlette ran the
handler to its end for nobody: ten largest runs posted and hung up on at once cost 25 CPU s and
kept every other client at 503 for ~30 s; now ~2.5 CPU s (the two that had started stop once
their traffic is generated) and the next client's run is answered 200 within ~2 s.

Refusals (400, 413, 503) are logged as warnings, throttled (:class:`ThrottledLog`), since a
client can send them as fast as it likes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from kvreuse import defaults
from kvreuse.errors import ConfigError, InputFormatError, require_at_least
from kvreuse.gateway.telemetry import ThrottledLog
from kvreuse.json_input import parse_json
from kvreuse.web.controls import (
    LIMITS,
    ControlChoices,
    LabControls,
    RunCancelled,
    parse_controls,
    parse_query,
)
from kvreuse.web.missions import Mission, mission_to_json
from kvreuse.web.result import SEGMENT_KINDS, LabResult, result_to_json

STATIC_DIR = Path(__file__).parent / "static"
MAX_BODY_BYTES = 64 * 1024
MAX_BODY_DEPTH = 8
"""The controls are a flat object; anything nested deeper than this is not a lab request."""
RESULT_CACHE_SIZE = 32
MAX_CONCURRENT_RUNS = defaults.LAB_MAX_CONCURRENT_RUNS
MAX_WAITING_RUNS = 8
QUEUE_TIMEOUT_S = 30.0

log = logging.getLogger("kvreuse.lab")


class LabRunner(Protocol):
    """What the server needs from the simulator side (:class:`kvreuse.web.adapter.SimLab`)."""

    def choices(self) -> ControlChoices:
        """Names each choice control accepts; called once per config request."""
        ...

    def descriptions(self) -> Mapping[str, Mapping[str, str]]:
        """One line per choice, by control then name (``{"routing": {"cache_aware": ...}}``)."""
        ...

    def defaults(self) -> LabControls:
        """The controls the page opens with."""
        ...

    def missions(self) -> Mapping[str, Mission]:
        """The guided presets by id, in display order."""
        ...

    def run(self, controls: LabControls, cancel: threading.Event | None = None) -> LabResult:
        """Simulate ``controls`` and return what the page draws. Pure: equal controls give an
        equal result. Raises :class:`InputFormatError` naming the control for a combination
        that cannot run, :class:`ConfigError` for one the simulator rejects, and
        :class:`RunCancelled` soon after ``cancel`` is set (its client left)."""
        ...


class _BodyTooLarge(Exception):
    def __init__(self, seen: int) -> None:
        super().__init__(seen)
        self.seen = seen


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or :class:`_BodyTooLarge` as soon as its declared or received size passes
    ``limit``: an oversized body is never held whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise _BodyTooLarge(int(declared))
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge(size)
        chunks.append(chunk)
    return b"".join(chunks)


async def _client_left(receive: Any) -> None:
    """Return once the client has disconnected (ASGI ``http.disconnect``); the request body
    must already have been read."""
    while (await receive())["type"] != "http.disconnect":
        pass


class RunSlots:
    """At most ``size`` simulations at once; at most ``waiting`` more wait, each up to
    ``timeout_s``. :meth:`acquire` returns False (backpressure) when no slot came."""

    def __init__(self, size: int, waiting: int, timeout_s: float) -> None:
        require_at_least("max_concurrent_runs", size, 1)
        self.size = size
        self.waiting_limit = waiting
        self.timeout_s = timeout_s
        self._semaphore = asyncio.Semaphore(size)
        self.running = 0
        self.waiting = 0

    async def acquire(self) -> bool:
        if self._semaphore.locked() and self.waiting >= self.waiting_limit:
            return False
        self.waiting += 1
        try:
            async with asyncio.timeout(self.timeout_s):  # not wait_for: gateway/tasks.py
                await self._semaphore.acquire()
        except TimeoutError:
            return False
        finally:
            self.waiting -= 1
        self.running += 1
        return True

    def release(self) -> None:
        self.running -= 1
        self._semaphore.release()


class _ResultCache:
    """A small LRU of finished runs, shared by the server's worker threads."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[LabControls, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: LabControls) -> dict[str, Any] | None:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def put(self, key: LabControls, value: dict[str, Any]) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)


def create_app(
    runner: LabRunner | None = None,
    *,
    max_concurrent_runs: int = MAX_CONCURRENT_RUNS,
    max_waiting_runs: int = MAX_WAITING_RUNS,
    queue_timeout_s: float = QUEUE_TIMEOUT_S,
) -> Starlette:
    """The ASGI app. ``runner`` defaults to the real simulator (:class:`SimLab`); at most
    ``max_concurrent_runs`` simulations run at once (see the module docstring)."""
    if runner is None:
        from kvreuse.web.adapter import SimLab

        runner = SimLab()
    lab: LabRunner = runner
    cache = _ResultCache(RESULT_CACHE_SIZE)
    slots = RunSlots(max_concurrent_runs, max_waiting_runs, queue_timeout_s)
    # One budget per app: refusals are logged, but a flood of them costs a few lines a second.
    refusals = ThrottledLog(log)

    def error(message: str, field: str | None, status: int = 400,
              headers: dict[str, str] | None = None) -> JSONResponse:
        refusals.warning("lab: %s answered %d: %s", field or "request", status, ascii(message))
        return JSONResponse({"error": message, "field": field}, status_code=status,
                            headers=headers)

    async def page(request: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    async def config(request: Request) -> Response:
        choices = lab.choices()
        return JSONResponse(
            {
                "defaults": lab.defaults().as_dict(),
                "choices": {
                    "scenario": list(choices.scenarios),
                    "routing": list(choices.routing),
                    "scheduling": list(choices.scheduling),
                },
                "descriptions": {k: dict(v) for k, v in lab.descriptions().items()},
                "limits": {
                    "replicas": [1, LIMITS.max_replicas],
                    "cache_tokens": [0, LIMITS.max_cache_tokens],
                    "arrival_rate": [0, LIMITS.max_arrival_rate],
                    "duration_s": [1, LIMITS.max_duration_s],
                    "spill_threshold_s": [0, LIMITS.max_spill_threshold_s],
                    "seed": [0, LIMITS.max_seed],
                    "requests_per_run": [1, LIMITS.max_requests],
                },
                "max_concurrent_runs": slots.size,
                "segment_kinds": list(SEGMENT_KINDS),
                "missions": [mission_to_json(m) for m in lab.missions().values()],
            }
        )

    async def simulate_for(controls: LabControls, cancel: threading.Event) -> Response:
        if not await slots.acquire():
            return error(
                f"the lab is already running {slots.size} simulation(s) and has "
                f"{slots.waiting} waiting; try again in a moment",
                None, 503, {"Retry-After": "2"},
            )
        # The slot is the thread's until the thread stops. A cancelled await of
        # run_in_threadpool returns at once while the simulation runs on in its thread, and the
        # next waiter would start beside it: seen as six largest runs at once on a lab
        # allowing two, before this shield.
        thread = asyncio.ensure_future(run_in_threadpool(lab.run, controls, cancel))
        try:
            try:
                result = await asyncio.shield(thread)
            except asyncio.CancelledError:
                cancel.set()
                await asyncio.wait((thread,))
                if not thread.cancelled():
                    thread.exception()  # its RunCancelled is expected: mark it seen
                raise
        except InputFormatError as exc:
            return error(str(exc), exc.where)
        except ConfigError as exc:
            return error(str(exc), None)
        finally:
            slots.release()
        body = result_to_json(result)
        cache.put(controls, body)
        return JSONResponse(body)

    async def simulate(request: Request, controls: LabControls) -> Response:
        cached = cache.get(controls)
        if cached is not None:
            return JSONResponse(cached)
        # The run races the client's disconnect (see the module docstring). Cancelling the
        # task leaves the slot queue at once; a run already in its thread is told by `cancel`
        # and the task ends (releasing the slot) when the thread has stopped.
        cancel = threading.Event()
        work = asyncio.ensure_future(simulate_for(controls, cancel))
        gone = asyncio.ensure_future(_client_left(request.receive))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                cancel.set()
                work.cancel()
            gone.cancel()
        try:
            return await work
        except (asyncio.CancelledError, RunCancelled):
            this = asyncio.current_task()
            if this is not None and this.cancelling():  # the server is stopping: not ours
                raise
            log.info("lab: a run was cancelled, its client left")
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    async def run_post(request: Request) -> Response:
        try:
            raw = await _read_body(request, MAX_BODY_BYTES)
        except _BodyTooLarge as exc:
            return error(
                f"the body is over the limit of {MAX_BODY_BYTES:,} bytes (at least "
                f"{exc.seen:,} sent); the controls fit in a few hundred",
                "body", 413,
            )
        try:
            body = parse_json(raw, max_depth=MAX_BODY_DEPTH) if raw.strip() else {}
        except InputFormatError as exc:
            return error(f"the body: {exc}", "body")
        try:
            controls = parse_controls(body, lab.choices(), lab.defaults())
        except InputFormatError as exc:
            return error(str(exc), exc.where)
        return await simulate(request, controls)

    async def run_get(request: Request) -> Response:
        try:
            controls = parse_query(dict(request.query_params), lab.choices(), lab.defaults())
        except InputFormatError as exc:
            return error(str(exc), exc.where)
        return await simulate(request, controls)

    return Starlette(
        routes=[
            Route("/", page),
            Route("/api/config", config),
            Route("/api/run", run_post, methods=["POST"]),
            Route("/api/run", run_get, methods=["GET"]),
            Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
        ]
    )
