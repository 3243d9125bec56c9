"""``kvreuse route --record DIR``: the traffic the gateway routes, written as a trace.

Each answered request (status 200) becomes one line of Mooncake JSONL
(:mod:`kvreuse.trace.format`):
``timestamp`` (ms since recording started, at the request's arrival), ``input_length`` (the
prompt tokens the gateway routed on), ``output_length`` (the engine's ``completion_tokens``, else
the request's ``max_tokens``, else 0), ``hash_ids`` (keyed, chained ids per
``--record-block-size`` tokens, :mod:`kvreuse.trace.keyed`), ``model`` (the served name,
as sent), ``tenant`` and ``session_id`` as keyed hashes, ``cached_tokens`` as the engine
reported them, ``upstream`` and the measured ``ttft_s``. No prompt text, token id, tenant
name, API key or cache salt is written.

Off the request path. The request path only puts a tuple on a bounded queue (:meth:`submit`);
when the queue is full the request is dropped from the trace and counted (:attr:`dropped`),
never waited for. A writer thread hashes and writes. Requests finish out of arrival order, so
the writer holds each one for ``reorder_s`` seconds and writes in arrival order; one that
finishes later than that is written with the last timestamp written (counted in :attr:`late`),
so a trace never goes back in time. What the writer holds is bounded as the queue is: at most
``queue_size`` requests and :data:`MAX_HELD_BYTES` of their prompts' tokens; past either, the
earliest arrival is written before its window ends (a request arriving earlier than it later
on is then late). Without that bound the queue's limit meant nothing (the writer empties it
every 0.25 s into the held set), and a flood of long prompts held every one of the last
``reorder_s`` seconds: 1,500 prompts of 100k tokens grew the gateway by 600 MB with a queue of
100. Files rotate at ``max_bytes`` and every ``rotate_s``
seconds: ``DIR/trace-<start>-<pid>-<n>.jsonl`` (:mod:`kvreuse.trace.recording`: ``<start>`` to
the millisecond, so ``kvreuse trace merge`` can put several recordings on one clock; ``n``
zero-padded, so names sort in order), timestamps continuing across files.

A write that fails (a full disk, a quota) loses only what it must and leaves a readable trace:
the lines handed to the file since its last successful flush are counted in :attr:`failed`
(they may be half on disk), the file is cut back to that flush so it ends on a whole line, and
for ``RETRY_S`` every record is counted as failed; then a new file is tried. One warning per
failure. Before, the writer thread died on the full disk with a traceback (its ``close``
flushed the same buffer again), every later request went unrecorded and uncounted, and the file
ended in half a line its own reader refused.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from prometheus_client.core import CounterMetricFamily, Metric

from kvreuse.errors import ConfigError, require_at_least
from kvreuse.gateway.config import read_secret_file
from kvreuse.gateway.telemetry import RequestRecord
from kvreuse.tokens import TOKEN_BYTES
from kvreuse.trace.format import DEFAULT_BLOCK_TOKENS, MAX_TEXT_FIELD, TraceRecord, record_json
from kvreuse.trace.keyed import KeyedIds
from kvreuse.trace.recording import recording_file_name

log = logging.getLogger("kvreuse.gateway.recorder")

SECRET_ENV = "KVREUSE_RECORD_SECRET"
RETRY_S = 10.0
"""After a failed write, records are counted as failed this long before a new file is tried."""
MAX_HELD_BYTES = 128 << 20  # of prompt tokens held for reordering (see the module docstring)


@dataclass(frozen=True, slots=True)
class RecorderSettings:
    directory: Path
    secret: bytes
    block: int = DEFAULT_BLOCK_TOKENS
    max_bytes: int = 256 * 1024 * 1024
    rotate_s: float = 3600.0
    queue_size: int = 10_000
    reorder_s: float = 30.0

    def __post_init__(self) -> None:
        require_at_least("record_max_bytes", self.max_bytes, 1024)
        if not self.rotate_s > 0 or not self.reorder_s >= 0:
            raise ConfigError("record_rotate_s must be > 0 and record_reorder_s >= 0")
        require_at_least("record_queue", self.queue_size, 1)


def load_secret(path: str | None, flag: str) -> tuple[bytes, bool]:
    """The recording secret: from ``path`` (named by ``flag`` in errors), else
    ``$KVREUSE_RECORD_SECRET``, else random. Returns ``(secret, shared)``; ``shared`` is False
    for a random one (its ids match no other gateway's and no other run's)."""
    if path is not None:
        return read_secret_file(path, flag), True
    env = os.environ.get(SECRET_ENV)
    if env:
        if len(env.encode()) < 16:
            raise ConfigError(f"${SECRET_ENV} must be at least 16 bytes")
        return env.encode(), True
    return os.urandom(32), False


# What the request path hands over: arrival (wall s), seq, tokens, namespace, tenant, session,
# model, cached, upstream, ttft, output tokens.
_Pending = tuple[float, int, bytes, str | None, str | None, str | None, str | None, int | None,
                 str | None, float | None, int]


class TraceRecorder:
    """See the module docstring. :meth:`start` once, :meth:`submit` per request,
    :meth:`close` once (flushes everything held)."""

    def __init__(self, settings: RecorderSettings,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.ids = KeyedIds(settings.secret, settings.block)
        self._wall = wall_clock
        self._queue: queue.Queue[_Pending | None] = queue.Queue(settings.queue_size)
        self._seq = itertools.count()
        self._thread = threading.Thread(target=self._run, name="kvreuse-recorder", daemon=True)
        self.origin = wall_clock()
        self.dropped = 0
        self.written = 0
        self.late = 0
        self.failed = 0
        self.write_error: str | None = None  # the last write that failed, if any
        self._flushed_bytes = 0  # of the current file, on disk at its last successful flush
        self._flushed_written = 0  # ``written`` at that flush
        self._retry_at = 0.0
        self.files: list[Path] = []
        self._file: IO[str] | None = None
        self._file_bytes = 0
        self._file_opened = 0.0
        self._last_ms = 0.0
        self._dropped_logged = 0.0
        self.error: str | None = None
        # Made here, when the gateway is built: a directory that cannot be written is a
        # start-up error naming the flag, not a failure once serving.
        directory = settings.directory
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"--record {directory}: cannot write there: {exc.strerror}"
                              ) from None

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------------ request path

    def submit(self, record: RequestRecord) -> bool:
        """Queue a finished request (O(1), no hashing, no I/O); False when it is not recorded:
        not answered with 200, not routed, or the queue is full (counted in ``dropped``)."""
        view = record.view
        if view is None or record.status != 200 or self.error is not None:
            return False
        arrival = self._wall() - (time.perf_counter() - record.started)
        output = record.completion_tokens
        if output is None:
            output = record.max_tokens or 0
        item: _Pending = (
            arrival, next(self._seq), view.tokens, view.identity.cache_salt, view.tenant,
            view.session_id, record.model, record.cached_tokens, record.upstream,
            record.ttft_s, output,
        )
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            now = time.monotonic()
            if now - self._dropped_logged > 60.0:
                self._dropped_logged = now
                log.warning("trace recorder queue full: %d requests dropped from the trace so "
                            "far", self.dropped)
            return False
        return True

    # ------------------------------------------------------------------ writer thread

    def close(self, timeout_s: float = 30.0) -> None:
        """Write everything held and close the file. Idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)

    def _run(self) -> None:
        held: list[_Pending] = []
        held_bytes = 0
        limit = self.settings.queue_size
        reorder = self.settings.reorder_s
        try:
            while True:
                got: list[_Pending | None] = []
                with contextlib.suppress(queue.Empty):
                    got.append(self._queue.get(timeout=0.25))
                while True:  # take what else is queued before writing
                    try:
                        got.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                for item in got:
                    if item is not None:
                        heapq.heappush(held, item)
                        held_bytes += len(item[2])
                if None in got:
                    break
                due = self._wall() - reorder
                while held and (held[0][0] <= due or len(held) > limit
                                or held_bytes > MAX_HELD_BYTES):
                    item = heapq.heappop(held)
                    held_bytes -= len(item[2])
                    self._write_or_count(item)
                self._flush_or_count(rotate=True)
            while held:
                self._write_or_count(heapq.heappop(held))
            self._flush_or_count(rotate=False)
        except Exception as exc:  # a bug, not the disk (that is handled): stop recording
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("trace recorder stopped: %s", self.error)
        finally:
            self._close_file()

    def _write_or_count(self, item: _Pending) -> None:
        if time.monotonic() < self._retry_at:
            self.failed += 1
            return
        try:
            self._write(item)
        except OSError as exc:
            self.failed += 1  # this one, not yet counted written
            self._write_failed(exc)

    def _flush_or_count(self, rotate: bool) -> None:
        if self._file is None:
            return
        try:
            self._file.flush()
        except OSError as exc:
            self._write_failed(exc)
            return
        self._flushed_bytes = self._file_bytes
        self._flushed_written = self.written
        if rotate:
            self._rotate_if_old()

    def _write_failed(self, exc: OSError) -> None:
        """Count the lines since the last good flush as failed, cut the file back to that
        flush (whole lines only) and pause writing for ``RETRY_S``."""
        lost = self.written - self._flushed_written
        self.written -= lost
        self.failed += lost
        path = self.files[-1] if self._file is not None and self.files else None
        with contextlib.suppress(OSError):  # closing flushes the same buffer: it fails again
            if self._file is not None:
                self._file.close()
        self._file = None
        if path is not None:
            with contextlib.suppress(OSError):  # cutting frees space, needs none
                os.truncate(path, self._flushed_bytes)
        self._retry_at = time.monotonic() + RETRY_S
        self.write_error = f"{type(exc).__name__}: {exc}"
        log.warning("trace recorder cannot write (%s): %d records lost so far; a new file in "
                    "%g s", self.write_error, self.failed, RETRY_S)

    def _close_file(self) -> None:
        if self._file is None:
            return
        try:
            self._file.close()
        except OSError as exc:  # the file is closed even so; what it held is lost
            self._write_failed(exc)
        self._file = None

    def _write(self, item: _Pending) -> None:
        (arrival, _seq, tokens, namespace, tenant, session, model, cached, upstream, ttft,
         output) = item
        stamp = round(max(0.0, arrival - self.origin) * 1000.0, 3)
        if stamp < self._last_ms:
            self.late += 1
            stamp = self._last_ms
        self._last_ms = stamp
        prompt = len(tokens) // TOKEN_BYTES
        if prompt < 1:
            return
        ids = self.ids
        record = TraceRecord(
            line=0,
            timestamp_ms=stamp,
            input_length=prompt,
            output_length=max(0, output),
            hash_ids=tuple(ids.block_ids(tokens, namespace)),
            session_id=None if session is None else ids.session(session),
            model=None if not model else model[:MAX_TEXT_FIELD],
            tenant=None if tenant is None else ids.tenant(tenant),
            cached_tokens=None if cached is None else min(max(cached, 0), prompt),
            upstream=upstream[:MAX_TEXT_FIELD] if upstream else None,
            ttft_s=None if ttft is None else round(max(ttft, 0.0), 6),
        )
        line = record_json(record) + "\n"  # ASCII: json.dumps escapes the rest
        out = self._open(len(line))
        out.write(line)
        self._file_bytes += len(line)
        self.written += 1

    def _open(self, need: int) -> IO[str]:
        if self._file is not None and self._file_bytes + need > self.settings.max_bytes:
            self._file.close()  # an OSError here is the caller's failed write
            self._file = None
        if self._file is None:
            # Made again if it went (an operator moved the traces away): recording goes on.
            self.settings.directory.mkdir(parents=True, exist_ok=True)
            path = self.settings.directory / recording_file_name(
                self.origin, os.getpid(), len(self.files) + 1)
            self._file = path.open("w", encoding="utf-8")
            self._file_bytes = self._flushed_bytes = 0
            self._flushed_written = self.written
            self._file_opened = time.monotonic()
            self.files.append(path)
        return self._file

    def _rotate_if_old(self) -> None:
        if (self._file is not None
                and time.monotonic() - self._file_opened >= self.settings.rotate_s):
            self._close_file()


class RecorderCollector:
    """``/metrics``: ``kvreuse_gateway_trace_records_total{outcome}`` — written, dropped (queue
    full), late (finished after the reorder window; written with the last timestamp), failed
    (a write failed: full disk, quota)."""

    def __init__(self, recorder: TraceRecorder) -> None:
        self._recorder = recorder

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            "kvreuse_gateway_trace_records",
            "requests handed to the --record trace, by outcome", labels=["outcome"])
        recorder = self._recorder
        for outcome, value in (("written", recorder.written), ("dropped", recorder.dropped),
                               ("late", recorder.late), ("failed", recorder.failed)):
            family.add_metric([outcome], value)
        yield family
