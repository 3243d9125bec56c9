"""The lab's HTTP side: one page, its static files, and a small JSON API.

Routes:

* ``GET /`` — the page (``static/index.html``); ``GET /static/...`` — its JS and CSS;
* ``GET /api/config`` — defaults, the names each control may take, limits, and the missions;
* ``POST /api/run`` — a JSON object of controls (absent fields keep their defaults) → the run
  (:func:`kvreuse.web.result.result_to_json`); ``GET /api/run?...`` takes the same controls as
  a query string (what :func:`kvreuse.web.links.lab_url` builds).

Bad input answers 400 with ``{"error": ..., "field": ...}`` naming what to fix. Runs are
deterministic for given controls, so recent results are kept and a repeated run (the page's
replay, a mission re-check) is answered without simulating again.
"""

from __future__ import annotations

import json
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

from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.web.controls import LIMITS, ControlChoices, LabControls, parse_controls, parse_query
from kvreuse.web.missions import Mission, mission_to_json
from kvreuse.web.result import SEGMENT_KINDS, LabResult, result_to_json

STATIC_DIR = Path(__file__).parent / "static"
MAX_BODY_BYTES = 64 * 1024
RESULT_CACHE_SIZE = 32


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

    def run(self, controls: LabControls) -> LabResult:
        """Simulate ``controls`` and return what the page draws. Pure: equal controls give an
        equal result. Raises :class:`InputFormatError` naming the control for a combination
        that cannot run, :class:`ConfigError` for one the simulator rejects."""
        ...


def _error(message: str, field: str | None, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": message, "field": field}, status_code=status)


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


def create_app(runner: LabRunner | None = None) -> Starlette:
    """The ASGI app. ``runner`` defaults to the real simulator (:class:`SimLab`)."""
    if runner is None:
        from kvreuse.web.adapter import SimLab

        runner = SimLab()
    lab: LabRunner = runner
    cache = _ResultCache(RESULT_CACHE_SIZE)

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
                },
                "segment_kinds": list(SEGMENT_KINDS),
                "missions": [mission_to_json(m) for m in lab.missions().values()],
            }
        )

    async def simulate(controls: LabControls) -> Response:
        cached = cache.get(controls)
        if cached is not None:
            return JSONResponse(cached)
        try:
            result = await run_in_threadpool(lab.run, controls)
        except InputFormatError as exc:
            return _error(str(exc), exc.where)
        except ConfigError as exc:
            return _error(str(exc), None)
        body = result_to_json(result)
        cache.put(controls, body)
        return JSONResponse(body)

    async def run_post(request: Request) -> Response:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            return _error(f"the body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}", "body")
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(f"the body is not valid JSON: {exc}", "body")
        try:
            controls = parse_controls(body, lab.choices(), lab.defaults())
        except InputFormatError as exc:
            return _error(str(exc), exc.where)
        return await simulate(controls)

    async def run_get(request: Request) -> Response:
        try:
            controls = parse_query(dict(request.query_params), lab.choices(), lab.defaults())
        except InputFormatError as exc:
            return _error(str(exc), exc.where)
        return await simulate(controls)

    return Starlette(
        routes=[
            Route("/", page),
            Route("/api/config", config),
            Route("/api/run", run_post, methods=["POST"]),
            Route("/api/run", run_get, methods=["GET"]),
            Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
        ]
    )
