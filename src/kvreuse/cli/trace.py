"""``kvreuse trace``: build a trace from request logs, and say what a trace allows.

    kvreuse trace import LOG.jsonl --out TRACE.jsonl [--tokenizer DIR] [--block-size 512]
                         [--secret-file FILE]
    kvreuse trace stats TRACE.jsonl [--block-size 512] [--replicas 1,2,4,8]
                        [--cache-tokens 100000,200000,400000] [--window 60]
                        [--json FILE] [--report FILE.html]
    kvreuse trace merge PATH... --out TRACE.jsonl [--block-size 512]

``import`` reads JSONL request logs, one request per line: ``timestamp`` (ms, or an ISO 8601
time; one without an offset is UTC, so an import gives the same trace on every machine) and
``body``, the OpenAI request (``/v1/completions`` or ``/v1/chat/completions``; a line
without ``body`` is taken as the body itself); optional ``output_tokens``, ``session_id``,
``tenant``. Each prompt is tokenized as the gateway does (``--tokenizer DIR`` with its chat
template, else one token per 4 bytes; :func:`kvreuse.gateway.prompts.request_tokens`) and
written with keyed block ids exactly as ``kvreuse route --record`` writes them
(:mod:`kvreuse.trace.keyed`; the same secret gives the same ids), with no text. A bad line is
an error naming file, line and field. ``stats`` prints :mod:`kvreuse.trace.stats`. ``merge``
puts the recordings ``kvreuse route --record`` wrote (several gateways, restarts; files or
directories of them) on one clock and in one arrival order (:mod:`kvreuse.trace.recording`).
``import`` and ``merge`` read a line at a time, show their progress, and write beside ``--out``,
renaming at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.progress import Progress

from kvreuse.cli.args import output_file, positive_float, positive_int, trace_file
from kvreuse.cli.files import CannotWrite, write_whole, written_beside
from kvreuse.cli.tables import BYTES, make_console, progress_bar
from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.trace.format import (
    DEFAULT_BLOCK_TOKENS,
    MAX_LENGTH_TOKENS,
    MAX_TEXT_FIELD,
    MAX_TIMESTAMP_MS,
    TraceRecord,
    iter_trace_records,
    parse_trace_lines,
    record_json,
)
from kvreuse.trace.recording import RecordingFile
from kvreuse.trace.stats import TraceStats, trace_stats


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "trace", help="import request logs as a trace; merge recordings; trace stats")
    commands = parser.add_subparsers(dest="trace_command", metavar="SUBCOMMAND", required=True)

    imp = commands.add_parser("import", help="JSONL request logs -> a trace without text")
    imp.add_argument("log", type=Path, help="JSONL: timestamp + OpenAI request body per line")
    imp.add_argument("--out", type=output_file, required=True, help="the trace to write")
    imp.add_argument("--tokenizer", metavar="DIR", help="HF tokenizer dir (chat template)")
    imp.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_TOKENS,
                     help=f"tokens per hash id ({DEFAULT_BLOCK_TOKENS})")
    imp.add_argument("--secret-file", metavar="FILE",
                     help="secret keying the ids (else $KVREUSE_RECORD_SECRET, else random); "
                          "the same as a recording gateway's gives the same ids")
    imp.set_defaults(func=run_import)

    stats = commands.add_parser("stats", help="what a trace allows: ceiling, bounds, hot set")
    stats.add_argument("trace", type=Path, nargs="?", help="the trace (Mooncake JSONL)")
    # simulate, plan and replay take their trace as --trace: accepted here too
    stats.add_argument("--trace", dest="trace_option", type=Path, metavar="TRACE",
                       help="the trace, as the other commands name it")
    stats.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_TOKENS,
                       help=f"tokens per hash id ({DEFAULT_BLOCK_TOKENS})")
    stats.add_argument("--replicas", default="1,2,4,8", help="fleet sizes for the pooled bound")
    stats.add_argument("--cache-tokens", default="100000,200000,400000",
                       help="KV pool sizes per replica for the pooled bound")
    stats.add_argument("--window", type=positive_float, default=60.0,
                       help="hot working set window, seconds (60)")
    stats.add_argument("--json", type=output_file, help="write the figures as JSON")
    stats.add_argument("--report", type=output_file, help="write an HTML report with plots")
    stats.set_defaults(func=run_stats)

    merge = commands.add_parser(
        "merge", help="recordings of several gateways or restarts -> one trace on one clock")
    merge.add_argument("paths", type=Path, nargs="+", metavar="PATH",
                       help="recorded files, or directories of them (kvreuse route --record)")
    merge.add_argument("--out", type=output_file, required=True, help="the trace to write")
    merge.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_TOKENS,
                       help=f"tokens per hash id, as recorded ({DEFAULT_BLOCK_TOKENS})")
    merge.set_defaults(func=run_merge)


def _ints(text: str, flag: str) -> list[int]:
    out = []
    for part in text.split(","):
        if part.strip():
            try:
                value = int(part)
            except ValueError:
                raise ConfigError(f"{flag} takes integers like 1,2,4; got {part!r}") from None
            if value < 1:
                raise ConfigError(f"{flag} values must be >= 1, got {value}")
            out.append(value)
    if not out:
        raise ConfigError(f"{flag} needs at least one value")
    return out


# ---------------------------------------------------------------------------------- stats


def run_stats(args: argparse.Namespace) -> int:
    if args.trace is None or args.trace_option is None:
        args.trace = args.trace or args.trace_option
    elif args.trace != args.trace_option:
        raise ConfigError(f"two traces named: {args.trace} and --trace {args.trace_option}; "
                          f"name one")
    if args.trace is None:
        raise ConfigError("name the trace: kvreuse trace stats TRACE")
    try:
        with trace_file(args.trace, "the trace").open("rb") as lines:
            records = parse_trace_lines(lines, str(args.trace), args.block_size)
    except OSError as exc:
        raise ConfigError(f"cannot read {args.trace}: {exc.strerror}") from None
    replicas = _ints(args.replicas, "--replicas")
    cache_tokens = _ints(args.cache_tokens, "--cache-tokens")
    console = make_console()
    with progress_bar(console) as progress:
        task = progress.add_task("replaying the trace through each cache", total=None)

        def replayed(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        stats = trace_stats(records, args.block_size, replicas, cache_tokens, args.window,
                            replayed)
    _print_stats(console, str(args.trace), stats)
    if args.json is not None:
        write_whole(args.json, json.dumps(stats.as_dict(), indent=2) + "\n", "--json")
        console.print(f"wrote {args.json}")
    if args.report is not None:
        _write_stats_report(args.report, str(args.trace), stats)
        console.print(f"report: {args.report}")
    return 0


def _print_stats(console: Any, name: str, stats: TraceStats) -> None:
    from rich import box
    from rich.table import Table

    console.print(
        f"[bold]{name}[/bold]: {stats.requests:,} requests over {stats.duration_s:,.1f} s; "
        f"{stats.input_tokens:,} prompt tokens, {stats.output_tokens:,} answer tokens; "
        f"{stats.sessions:,} sessions, {stats.tenants:,} tenants; models: "
        f"{', '.join(stats.models) or '-'}"
    )
    console.print(f"infinite-cache ceiling (one cache that never forgets): "
                  f"{stats.infinite_hit_rate:.1%} of prompt tokens")
    replicas = sorted({p.replicas for p in stats.pooled})
    table = Table(title="pooled LRU: one LRU cache of replicas x cache tokens (a reference, "
                  "not a ceiling: routers can beat LRU)", box=box.SIMPLE_HEAD)
    table.add_column("cache tokens per replica", justify="right", overflow="fold")
    for n in replicas:
        table.add_column(f"{n} replicas", justify="right", overflow="fold")
    for cache in sorted({p.cache_tokens for p in stats.pooled}):
        row = [f"{cache:,}"]
        for n in replicas:
            bound = next(p for p in stats.pooled if p.replicas == n and p.cache_tokens == cache)
            row.append(f"{bound.hit_rate:.1%}")
        table.add_row(*row)
    console.print(table)
    hot = stats.hot
    console.print(f"hot working set (blocks used by 2+ requests within {hot.window_seconds:g} s): "
                  f"max {hot.max_hot_tokens:,} tokens, median {hot.median_hot_tokens:,.0f} over "
                  f"{hot.windows:,} windows; {hot.distinct_tokens:,} distinct block tokens")
    console.print(
        f"reuse depth: {stats.requests_with_reuse:,} of {stats.requests:,} requests start with "
        f"blocks seen before; leading blocks seen p50 {stats.depth_percentile(0.5):g}, p90 "
        f"{stats.depth_percentile(0.9):g}, p99 {stats.depth_percentile(0.99):g}, max "
        f"{max(stats.reuse_depth_blocks, default=0):,} (blocks of {stats.block} tokens)"
    )
    if stats.recorded_hit_rate is not None:
        console.print(f"recorded: engines reported {stats.recorded_hit_rate:.1%} of prompt "
                      f"tokens cached; TTFT p50 {stats.recorded_ttft_p50_s or 0:.3f} s, p95 "
                      f"{stats.recorded_ttft_p95_s or 0:.3f} s")


def _write_stats_report(path: Path, name: str, stats: TraceStats) -> None:
    import html

    from kvreuse.cli.simreport import _png, _pyplot, figures_html, report_page

    plt = _pyplot()
    images = []
    fig, ax = plt.subplots(figsize=(10, 4))
    hot = stats.hot
    ax.step([s for s, _ in hot.per_window], [t for _, t in hot.per_window], where="post")
    ax.set_xlabel("seconds from the first request")
    ax.set_ylabel(f"hot tokens per {hot.window_seconds:g} s window")
    images.append(("Hot working set over time", _png(fig)))
    fig, ax = plt.subplots(figsize=(10, 4))
    for n in sorted({p.replicas for p in stats.pooled}):
        bounds = sorted((p.cache_tokens, p.hit_rate) for p in stats.pooled if p.replicas == n)
        ax.plot([c for c, _ in bounds], [h * 100 for _, h in bounds], marker="o",
                label=f"{n} replicas")
    ax.axhline(stats.infinite_hit_rate * 100, color="black", linestyle="--",
               label="infinite cache")
    ax.set_xlabel("cache tokens per replica")
    ax.set_ylabel("token hit rate bound (%)")
    ax.legend()
    images.append(("Pooled bound against cache size", _png(fig)))
    fig, ax = plt.subplots(figsize=(10, 4))
    depths = stats.reuse_depth_blocks
    ax.hist(depths, bins=min(50, max(depths, default=0) + 1))
    ax.set_xlabel(f"leading blocks seen before ({stats.block} tokens each)")
    ax.set_ylabel("requests")
    images.append(("Reuse depth", _png(fig)))
    plt.close("all")
    esc = html.escape
    rows = "".join(f"<tr><td>{esc(k)}</td><td>{esc(json.dumps(v))}</td></tr>"
                   for k, v in stats.as_dict().items() if k != "hot_over_time")
    body = f"<h1>{esc(name)}</h1>\n<table>{rows}</table>{figures_html(images)}"
    write_whole(path, report_page(f"kvreuse trace stats: {name}", body, cells="td"), "--report")


# ---------------------------------------------------------------------------------- import


def _timestamp_ms(value: object, where: str) -> float:
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise InputFormatError(
                f"field 'timestamp' must be ms or an ISO 8601 time, got {value!r:.60}", where
            ) from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        value = moment.timestamp() * 1000.0
        if value < 0:
            raise InputFormatError(f"field 'timestamp' must be 1970 or later, got "
                                   f"{moment.isoformat()}", where)
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InputFormatError(f"field 'timestamp' must be a finite number of ms or an ISO "
                               f"8601 time, got {value!r:.60}", where)
    if value < 0:
        raise InputFormatError(f"field 'timestamp' must be >= 0, got {value}", where)
    return float(value)


def import_records(lines: Iterable[bytes], source: str, tokenizer: Any,
                   ids: Any) -> Iterator[str]:
    """The trace lines for request-log ``lines``, each made as its log line is read (a log holds
    whole prompts: it may be larger than memory); errors name ``source:line`` and the field,
    and a log without a request is an error once its lines run out."""
    from kvreuse.gateway.prompts import request_tokens
    from kvreuse.gateway.validation import parse_request
    from kvreuse.tokens import TOKEN_BYTES

    written = 0
    origin: float | None = None
    previous = 0.0
    for number, raw in enumerate(lines, start=1):
        where = f"{source}:{number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputFormatError(f"not valid UTF-8 (byte {exc.start})", where) from None
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise InputFormatError(f"not valid JSON ({exc})", where) from None
        if not isinstance(row, dict):
            raise InputFormatError("each line must be a JSON object", where)
        if "timestamp" not in row:
            raise InputFormatError("missing field 'timestamp'", where)
        stamp = _timestamp_ms(row["timestamp"], where)
        body = row.get("body")
        if body is None:
            body = {k: v for k, v in row.items()
                    if k not in ("timestamp", "output_tokens", "session_id", "tenant")}
        if not isinstance(body, dict):
            raise InputFormatError("field 'body' must be a JSON object", where)
        kind = "chat" if "messages" in body else "completion"
        try:
            parsed = parse_request(kind, body)
            tokens = request_tokens(tokenizer, parsed)
        except InputFormatError as exc:  # RequestError names the body's field
            raise InputFormatError(f"field 'body.{exc.where or '?'}': {exc.args[0]}",
                                   where) from None
        prompt = len(tokens) // TOKEN_BYTES
        if not 1 <= prompt <= MAX_LENGTH_TOKENS:
            raise InputFormatError(f"the prompt has {prompt} tokens; it must have 1 to "
                                   f"{MAX_LENGTH_TOKENS:,}", where)
        output = row.get("output_tokens", parsed.max_tokens or 0)
        if isinstance(output, bool) or not isinstance(output, int) or not (
                0 <= output <= MAX_LENGTH_TOKENS):
            raise InputFormatError(f"field 'output_tokens' must be an integer in [0, "
                                   f"{MAX_LENGTH_TOKENS:,}], got {output!r:.60}", where)
        if origin is None:
            origin = stamp
        relative = stamp - origin
        if relative < previous:
            raise InputFormatError(f"field 'timestamp' goes back in time ({relative:g} ms after "
                                   f"{previous:g} ms from the first line); sort the log", where)
        if relative > MAX_TIMESTAMP_MS:  # the trace's reader would refuse the line
            raise InputFormatError(f"field 'timestamp' is {relative:g} ms after the first "
                                   f"line's; a trace spans at most {MAX_TIMESTAMP_MS:.0e} ms",
                                   where)
        previous = relative
        session, tenant = row.get("session_id"), row.get("tenant")
        for field_name, value in (("session_id", session), ("tenant", tenant)):
            if value is not None and (not isinstance(value, str | int) or isinstance(value, bool)
                                      or len(str(value)) > MAX_TEXT_FIELD):
                raise InputFormatError(f"field {field_name!r} must be a string of at most "
                                       f"{MAX_TEXT_FIELD} characters", where)
        record = TraceRecord(
            line=number,
            timestamp_ms=round(relative, 3),
            input_length=prompt,
            output_length=output,
            hash_ids=tuple(ids.block_ids(tokens, parsed.cache_salt)),
            session_id=None if session is None else ids.session(str(session)),
            model=parsed.model[:MAX_TEXT_FIELD],
            tenant=None if tenant is None else ids.tenant(str(tenant)),
        )
        written += 1
        yield record_json(record)
    if not written:
        raise InputFormatError("the log holds no requests", source)


def run_import(args: argparse.Namespace) -> int:
    from kvreuse.gateway.prompts import load_prompt_tokenizer
    from kvreuse.gateway.recorder import load_secret
    from kvreuse.trace.keyed import KeyedIds

    secret, shared = load_secret(args.secret_file, "--secret-file")
    tokenizer = load_prompt_tokenizer(args.tokenizer)
    try:
        log = args.log.open("rb", buffering=1 << 20)  # log lines hold whole prompts
        size = os.fstat(log.fileno()).st_size
    except OSError as exc:
        raise ConfigError(f"cannot read {args.log}: {exc.strerror}") from None
    with log, _byte_progress("importing", size) as progress:
        written = _write_trace(args.out, import_records(
            progress.count(log), str(args.log), tokenizer, KeyedIds(secret, args.block_size)))
    note = "" if shared else " (random secret: ids match no other trace's)"
    print(f"wrote {written:,} requests to {args.out}{note}")
    return 0


class _ByteProgress:
    """A progress bar over the bytes of the lines read (:meth:`count`), redrawn every 1,024."""

    def __init__(self, progress: Progress, task: Any) -> None:
        self._progress, self._task, self._done = progress, task, 0

    def count(self, lines: Iterable[bytes]) -> Iterator[bytes]:
        for number, raw in enumerate(lines, start=1):
            self._done += len(raw)
            if number % 1024 == 0:
                self._progress.update(self._task, completed=self._done)
            yield raw


@contextlib.contextmanager
def _byte_progress(what: str, total: int) -> Iterator[_ByteProgress]:
    with progress_bar(make_console(), counted=BYTES) as progress:
        yield _ByteProgress(progress, progress.add_task(what, total=total))


def _write_trace(out: Path, lines: Iterable[str]) -> int:
    """Write ``lines`` (each without its newline) to a file beside ``out``, renamed over it at
    the end: input that fails half-way (or Ctrl-C) leaves no half trace, and an earlier ``out``
    as it was. Returns the number of lines."""
    written = 0
    try:
        with written_beside(out) as sink:
            for line in lines:
                sink.write(line + "\n")
                written += 1
    except CannotWrite as exc:
        raise exc.for_flag("--out") from None
    return written


# ---------------------------------------------------------------------------------- merge


def recorded_files(paths: Sequence[Path]) -> dict[tuple[int, int], list[tuple[RecordingFile,
                                                                              Path]]]:
    """The recorded files ``paths`` name (a directory: its ``trace-*.jsonl``), by recording
    (start, process), each recording's parts in order. A file whose name
    ``kvreuse route --record`` did not give is refused: its clock's zero is unknown."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(path.glob("trace-*.jsonl"))
            if not found:
                raise ConfigError(f"{path}: no recorded files (trace-*.jsonl) in this directory")
            files += found
        elif path.exists():
            files.append(path)
        else:
            raise ConfigError(f"{path}: no such file or directory")
    recordings: dict[tuple[int, int], list[tuple[RecordingFile, Path]]] = {}
    for path in {path.resolve(): path for path in files}.values():  # a file named twice once
        name = RecordingFile.parse(path.name)
        if name is None:
            raise ConfigError(
                f"{path}: not a file `kvreuse route --record` wrote (trace-START-PID-PART.jsonl)"
                f", so where its clock starts is unknown; merge recorded files only")
        recordings.setdefault(name.recording, []).append((name, path))
    for parts in recordings.values():
        parts.sort()
    return dict(sorted(recordings.items()))


def run_merge(args: argparse.Namespace) -> int:
    from kvreuse.trace.recording import merge_recordings

    recordings = recorded_files(args.paths)
    total = sum(path.stat().st_size for parts in recordings.values() for _, path in parts)
    coarse = sum(1 for parts in recordings.values() if parts[0][0].to_the_second)
    span = [0.0]
    unfinished: list[Path] = []

    def whole_lines(lines: Iterable[bytes], path: Path) -> Iterator[bytes]:
        # The recorder ends every line it writes; a last line without its newline is one a
        # running gateway has not finished writing (its buffer flushes mid-line), left out.
        for raw in lines:
            if raw.endswith(b"\n"):
                yield raw
            else:
                unfinished.append(path)

    with contextlib.ExitStack() as stack:
        progress = stack.enter_context(_byte_progress("merging", total))

        def records(parts: list[tuple[RecordingFile, Path]]) -> Iterator[TraceRecord]:
            after = 0.0  # the parts of one recording continue one clock
            for _, path in parts:
                try:
                    handle = stack.enter_context(path.open("rb", buffering=1 << 20))
                except OSError as exc:
                    raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
                for record in iter_trace_records(whole_lines(progress.count(handle), path),
                                                 str(path), args.block_size, after):
                    after = record.timestamp_ms
                    yield record
                handle.close()

        def lines() -> Iterator[str]:
            merged = 0
            for record in merge_recordings([(start, records(parts))
                                            for (start, _), parts in recordings.items()]):
                span[0] = record.timestamp_ms
                merged += 1
                yield record_json(record)
            if not merged:  # raised before the rename: an earlier --out stays
                raise ConfigError("the recorded files hold no requests")

        written = _write_trace(args.out, lines())
    files = sum(len(parts) for parts in recordings.values())
    print(f"merged {written:,} requests of {len(recordings):,} recordings ({files:,} files) "
          f"into {args.out}, over {span[0] / 1000:,.1f} s")
    if coarse:
        print(f"note: {coarse:,} of the recordings name their start to the second only "
              f"(recorded by an earlier kvreuse), so they are aligned within a second")
    for path in unfinished:
        print(f"note: the last line of {path} is not finished (is its gateway still "
              f"recording?); left out")
    for parts in recordings.values():
        have = {name.part for name, _ in parts}
        missing = sorted(set(range(1, max(have) + 1)) - have)
        if missing:
            print(f"note: {parts[0][1].name.rsplit('-', 1)[0]}: part "
                  f"{', '.join(map(str, missing))} of the recording is missing (its requests "
                  f"are not in the trace)")
    return 0
