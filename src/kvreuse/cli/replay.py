"""``kvreuse replay``: send a trace to an OpenAI-compatible endpoint at the trace's own times.

    kvreuse replay --trace FILE --target URL [--speed 1] [--duration S] [--model NAME]
                   [--block-size 512] [--tokenizer DIR | --vocab-size N --first-token K]
                   [--max-tokens N] [--engine-metrics URL,...] [--json FILE] [--report FILE]

Open loop (:mod:`kvreuse.testing.loadgen`): each request leaves at its timestamp divided by
``--speed`` whatever the target does, streamed with usage, and TTFT is the time to the first
chunk. Prompts are synthesized (:mod:`kvreuse.trace.replay`) so that equal ids become equal
token runs: token-id prompts for ``/v1/completions``, or, with ``--tokenizer DIR``, text that
tokenizes back to exactly those runs. Answers are as long as the trace says (capped by
``--max-tokens``). The token hit rate comes from the engines' ``/metrics`` counters
(``--engine-metrics``, read before and after) or else from ``usage`` cached tokens. Prints a
table; ``--json`` and ``--report`` (HTML, TTFT over time) too. Targets are plain ``http://``.

Each body is built when its request falls due and dropped once sent (:class:`ReplayCalls`), and
of each finished request only its figures are kept (:class:`ReplayTally`): the Mooncake trace
replays in 85 MB at peak, where building every body first took 424 MB and 24 s before the first
request left (``benchmarks/replay_client.py``). A request that leaves ``LATE_S`` or more after
its time is counted as sent late and the run says so. Ctrl-C ends the run with the figures of
the requests that finished and exit 130.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvreuse.cli.args import output_file, positive_float, positive_int, trace_file
from kvreuse.cli.files import write_whole
from kvreuse.cli.tables import make_console, progress_bar
from kvreuse.errors import ConfigError
from kvreuse.sim.summary import percentile
from kvreuse.trace.format import DEFAULT_BLOCK_TOKENS, TraceRecord, parse_trace_lines
from kvreuse.trace.replay import (
    LATE_S,
    PromptSynthesizer,
    ReplaySummary,
    WordTable,
    vocabulary_alphabet,
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "replay", help="send a trace to an OpenAI-compatible endpoint at its own timestamps")
    parser.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL")
    parser.add_argument("--target", required=True, help="base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--speed", type=positive_float, default=1.0,
                        help="time compression: 2 sends twice as fast (1)")
    parser.add_argument("--duration", type=positive_float,
                        help="replay only the first SECONDS of the trace (after --speed)")
    parser.add_argument("--model", help="model name to send (default: each line's recorded "
                                         "model, else the first model the target lists)")
    parser.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_TOKENS,
                        help=f"tokens per hash id ({DEFAULT_BLOCK_TOKENS})")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="send text prompts that this tokenizer turns back into the runs")
    parser.add_argument("--vocab-size", type=positive_int, default=8192,
                        help="token-id prompts: ids drawn below this (8192)")
    parser.add_argument("--first-token", type=int, default=100,
                        help="token-id prompts: ids drawn from here up (100, past specials)")
    parser.add_argument("--max-tokens", type=positive_int, default=256,
                        help="cap on each answer's length (256)")
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=131_072,
                        help="refuse a trace whose prompts are longer (131072)")
    parser.add_argument("--engine-metrics", help="comma-separated engine URLs whose /metrics "
                                                 "give the token hit rate")
    parser.add_argument("--timeout", type=positive_float, default=120.0,
                        help="seconds before a request counts as failed (120)")
    parser.add_argument("--json", type=output_file, help="write the figures as JSON")
    parser.add_argument("--report", type=output_file, help="write an HTML report")
    parser.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class ReplayCalls:
    """The requests a replay sends, in order: each one's send time (seconds from the start) and
    record, checked before anything is sent. Iterating builds each call's prompt and body only
    when the sender asks for it, so a replay holds the bodies in flight, not the whole trace's
    (the Mooncake trace's 3,993 bodies are 361 MB)."""

    schedule: tuple[tuple[float, TraceRecord], ...]
    make_call: Callable[[float, TraceRecord], Any]

    def __len__(self) -> int:
        return len(self.schedule)

    @property
    def span_s(self) -> float:
        """When the last request is due, in seconds from the first."""
        return self.schedule[-1][0] if self.schedule else 0.0

    def __iter__(self) -> Iterator[Any]:
        for at_s, record in self.schedule:
            yield self.make_call(at_s, record)


MAX_REPLAY_S = 30 * 86_400.0
"""The longest replay `replay` starts: a month of a trace's requests at ``--speed``. Longer is
a mistaken ``--speed``, and past about 1e308 s the schedule is not even a number."""


def build_calls(records: Sequence[TraceRecord], args: argparse.Namespace,
                default_model: Callable[[], str] = lambda: "") -> ReplayCalls:
    """The records due within ``--duration``, each a loadgen :class:`Call` when iterated; a
    record names its model by ``--model``, else its own ``model`` field, else
    ``default_model()``. Everything that can fail is done here, before a request is sent:
    prompt lengths against ``--max-prompt-tokens``, the tokenizer, and ``default_model()``
    (called once, only if some record needs it). O(records)."""
    from kvreuse.testing.loadgen import Call

    origin = records[0].timestamp_ms
    schedule: list[tuple[float, TraceRecord]] = []
    for record in records:
        if record.input_length > args.max_prompt_tokens:
            raise ConfigError(
                f"{args.trace}:{record.line}: field 'input_length' is {record.input_length:,} "
                f"tokens, over --max-prompt-tokens {args.max_prompt_tokens:,}"
            )
        at_s = (record.timestamp_ms - origin) / 1000.0 / args.speed
        if args.duration is not None and at_s > args.duration:
            break
        if at_s > MAX_REPLAY_S:  # a speed such as 1e-300 (a typo): a replay never to end
            raise ConfigError(
                f"at --speed {args.speed:g} the request on {args.trace}:{record.line} would be "
                f"sent {at_s:.3g} s after the first, over {MAX_REPLAY_S / 86_400:g} days; give "
                f"a larger --speed, or --duration"
            )
        schedule.append((at_s, record))
    fallback = ""
    if not args.model and any(not record.model for _, record in schedule):
        fallback = default_model()
    table: WordTable | None = None
    if args.tokenizer:
        from kvreuse.gateway.prompts import HFPromptTokenizer
        from kvreuse.tokens import unpack

        tokenizer = HFPromptTokenizer(args.tokenizer)
        table = WordTable.build(tokenizer.vocab_size, tokenizer.decode,
                                lambda text: unpack(tokenizer.encode(text)))
        synth = PromptSynthesizer(args.block_size, table.tokens)
    else:
        synth = PromptSynthesizer(args.block_size,
                                  vocabulary_alphabet(args.vocab_size, args.first_token))

    def make_call(at_s: float, record: TraceRecord) -> Call:
        tokens = synth.prompt(record)
        prompt: str | list[int] = table.render(tokens) if table is not None else tokens
        body = {"model": args.model or record.model or fallback, "prompt": prompt,
                "max_tokens": max(1, min(record.output_length, args.max_tokens)),
                "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
        return Call(at_s, "/v1/completions", json.dumps(body).encode(),
                    session=record.session_id or "", prompt_tokens=len(tokens))

    return ReplayCalls(tuple(schedule), make_call)


def served_model(target: str, timeout_s: float) -> str:
    """The first model the target's ``GET /v1/models`` lists: what to send when neither
    ``--model`` nor the trace names one. Raises :class:`ConfigError` saying what to change."""
    import urllib.error

    from kvreuse.errors import InputFormatError
    from kvreuse.gateway.upstreams import MAX_MODEL_LIST_BYTES, parse_model_list
    from kvreuse.hitrate.prometheus import fetch_bytes

    hint = "; name the model with --model"
    try:  # bounded in time and size: a target that trickles or floods must not hang the run
        cards = parse_model_list(
            fetch_bytes(target + "/v1/models", timeout_s, MAX_MODEL_LIST_BYTES))
    except urllib.error.HTTPError as exc:
        raise ConfigError(f"{target}/v1/models answered HTTP {exc.code}{hint}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {target}/v1/models: {exc}{hint}") from None
    except InputFormatError as exc:
        raise ConfigError(f"{target}/v1/models: {exc}{hint}") from None
    if not cards:
        raise ConfigError(f"{target}/v1/models lists no model{hint}")
    return str(cards[0]["id"])


class ReplayTally:
    """What a replay keeps of each finished request: its send time and TTFT when answered, its
    usage counts, its failure's kind, and the first :data:`SAMPLES` failures in full. O(1) per
    request and no body or result is kept, so a trace of any length replays in the memory of
    its records."""

    SAMPLES = 5

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.finished = 0
        self.cut_off = 0  # in flight when the run was stopped (Ctrl-C): neither answer nor error
        self.prompt_tokens = 0
        self.answered_at_s = array("d")
        self.ttft_s = array("d")
        self.usage_prompt = 0
        self.usage_cached: int | None = None
        self.sent_late = 0
        self.worst_late_s = 0.0
        self.failures: Counter[str] = Counter()
        self.samples: list[str] = []

    def add(self, result: Any) -> None:
        """Count one finished request (a loadgen ``Result``)."""
        from kvreuse.testing.loadgen import CANCELLED

        self.finished += 1
        if result.error.startswith(CANCELLED):
            self.cut_off += 1
            return
        self.prompt_tokens += result.call.prompt_tokens
        if result.late_s >= LATE_S:
            self.sent_late += 1
        self.worst_late_s = max(self.worst_late_s, result.late_s)
        if result.status == 200 and not result.error and result.ttft_s is not None:
            self.answered_at_s.append(result.call.at_s)
            self.ttft_s.append(result.ttft_s)
            cached = result.cached_tokens
            # A target's usage is believed only within [0, prompt]: 1e400, -5 or true is not
            # a count.
            if type(cached) is int and 0 <= cached <= result.call.prompt_tokens:
                self.usage_prompt += result.call.prompt_tokens
                self.usage_cached = (self.usage_cached or 0) + cached
            return
        text = failure(result, self.timeout_s)
        self.failures[text.split(":")[0]] += 1
        if len(self.samples) < self.SAMPLES:
            self.samples.append(text)

    @property
    def answered(self) -> int:
        return len(self.ttft_s)

    def summary(self, engine_rate: float | None, duration_s: float) -> ReplaySummary:
        ttfts = self.ttft_s

        def pick(fraction: float) -> float | None:
            return percentile(ttfts, fraction) if ttfts else None

        cached = self.usage_cached
        return ReplaySummary(
            sent=self.finished - self.cut_off, ok=self.answered,
            errors=self.finished - self.cut_off - self.answered,
            ttft_p50_s=pick(0.5), ttft_p90_s=pick(0.9), ttft_p95_s=pick(0.95),
            ttft_p99_s=pick(0.99), prompt_tokens=self.prompt_tokens,
            usage_cached_tokens=cached,
            usage_hit_rate=(cached / self.usage_prompt)
            if cached is not None and self.usage_prompt else None,
            engine_hit_rate=engine_rate, duration_s=duration_s,
            sent_late=self.sent_late, worst_late_s=self.worst_late_s,
        )


def replay(calls: ReplayCalls, target: str, engines: Sequence[str], timeout_s: float,
           console: Any = None) -> tuple[ReplaySummary, ReplayTally, bool]:
    """Send ``calls`` at their times, reading engine counters before and after. Returns the
    summary, the tally and whether the run was interrupted (Ctrl-C: the requests in flight are
    cut off, and the figures are of those that finished)."""
    from kvreuse.testing.loadgen import fleet_hits, run_stream, scrape

    tally = ReplayTally(timeout_s)
    before = scrape(engines) if engines else {}
    started = time.perf_counter()
    interrupted = False
    with progress_bar(console, counted="{task.completed:,.0f}/{task.total:,.0f} s") as progress:
        task = progress.add_task("replaying", total=max(calls.span_s, 1e-9))

        def tick(elapsed: float) -> None:
            progress.update(task, completed=min(elapsed, calls.span_s), description=(
                f"answered {tally.answered:,} of {len(calls):,}, failed "
                f"{tally.finished - tally.cut_off - tally.answered:,}"))

        try:
            asyncio.run(run_stream(calls, lambda i, call: target, tally.add,
                                   timeout_s=timeout_s, on_tick=tick))
        except KeyboardInterrupt:
            interrupted = True
    duration = time.perf_counter() - started
    hits = fleet_hits(before, scrape(engines)) if engines else None
    # No queried tokens counted: the pages could not be read (scrape gives zeros), not 0 %.
    engine_rate = hits.hit_rate if hits is not None and hits.queries > 0 else None
    return tally.summary(engine_rate, duration), tally, interrupted


def run(args: argparse.Namespace) -> int:
    if not args.target.startswith("http://"):
        raise ConfigError(f"--target must be an http:// URL, got {args.target!r}")
    try:
        with trace_file(args.trace, "--trace").open("rb") as lines:
            records = parse_trace_lines(lines, str(args.trace), args.block_size)
    except OSError as exc:
        raise ConfigError(f"cannot read --trace {args.trace}: {exc.strerror}") from None
    calls = build_calls(records, args, lambda: served_model(args.target.rstrip("/"),
                                                            args.timeout))
    engines = [u.strip() for u in (args.engine_metrics or "").split(",") if u.strip()]
    console = make_console()
    console.print(f"replaying {len(calls):,} requests over {calls.span_s:,.1f} s to "
                  f"{args.target}", highlight=False)
    summary, tally, interrupted = replay(calls, args.target.rstrip("/"), engines,
                                         args.timeout, console)
    if interrupted:
        console.print(f"[yellow]interrupted[/yellow]: {summary.sent:,} of {len(calls):,} "
                      f"requests were sent and finished, {tally.cut_off:,} more were cut off; "
                      f"the figures below are of the {summary.sent:,}", highlight=False)
    _print(console, summary, engines)
    if summary.sent_late:
        console.print(
            f"[yellow]sent late[/yellow]: {summary.sent_late:,} of {summary.sent:,} requests "
            f"left {LATE_S * 1000:.0f} ms or more after their time (worst "
            f"{summary.worst_late_s:.2f} s): this client could not keep up, so the target saw "
            f"a gentler load than the trace's; a lower --speed replays it faithfully",
            highlight=False)
    if tally.failures:
        kinds = tally.failures.most_common(5)
        console.print("errors: " + ", ".join(f"{n:,} × {kind}" for kind, n in kinds),
                      markup=False, highlight=False)
        console.print(f"first error: {tally.samples[0]}", markup=False, highlight=False)
    if args.json is not None:
        payload = {"trace": str(args.trace), "target": args.target, "speed": args.speed,
                   **summary.as_dict(), "interrupted": interrupted, "cut_off": tally.cut_off,
                   "errors_sample": tally.samples}
        write_whole(args.json, json.dumps(payload, indent=2) + "\n", "--json")
        console.print(f"wrote {args.json}")
    if args.report is not None:
        _report(args.report, str(args.trace), args.target, summary, tally)
        console.print(f"report: {args.report}")
    if interrupted:
        return 130
    return 0 if summary.ok else 1


def failure(result: Any, timeout_s: float) -> str:
    """Why one request failed, on one line of at most 200 characters (the target's own words
    included): its time ran out, the HTTP status and body, or how the stream broke."""
    if result.error.startswith("TimeoutError"):
        text = f"no whole answer within --timeout {timeout_s:g} s"
    elif result.status not in (0, 200):
        text = f"HTTP {result.status}: {result.error}"
    elif result.error:
        text = result.error
    else:
        text = f"HTTP {result.status} without a body"
    text = " ".join(text.split())
    return text if len(text) <= 200 else text[:199] + "…"


def _fmt(value: float | None, unit: str = "s") -> str:
    return "-" if value is None else f"{value:.3f}{unit}"


def _print(console: Any, summary: ReplaySummary, engines: Sequence[str]) -> None:
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD)
    for name in ("sent", "ok", "errors", "TTFT p50", "TTFT p90", "TTFT p95", "TTFT p99",
                 "token hit", "source"):
        table.add_column(name, justify="right", overflow="fold")
    rate = summary.token_hit_rate
    source = ("engine /metrics" if summary.engine_hit_rate is not None
              else "usage cached_tokens" if summary.usage_hit_rate is not None else "-")
    table.add_row(
        f"{summary.sent:,}", f"{summary.ok:,}", f"{summary.errors:,}",
        _fmt(summary.ttft_p50_s), _fmt(summary.ttft_p90_s), _fmt(summary.ttft_p95_s),
        _fmt(summary.ttft_p99_s), "-" if rate is None else f"{rate:.1%}", source,
    )
    console.print(table)


def _report(path: Path, trace: str, target: str, summary: ReplaySummary,
            tally: ReplayTally) -> None:
    import html

    from kvreuse.cli.simreport import _png, _pyplot, report_page

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.scatter(tally.answered_at_s, tally.ttft_s, s=6)
    ax.set_xlabel("seconds into the replay (scheduled)")
    ax.set_ylabel("TTFT (s)")
    image = _png(fig)
    plt.close("all")
    esc = html.escape
    rows = "".join(f"<tr><td>{esc(k)}</td><td>{esc(json.dumps(v))}</td></tr>"
                   for k, v in summary.as_dict().items())
    body = f"""<h1>{esc(trace)} to {esc(target)}</h1>
<table>{rows}</table><h2>TTFT over time</h2>
<img alt="TTFT over time" src="data:image/png;base64,{image}">"""
    write_whole(path, report_page(f"kvreuse replay: {trace}", body, cells="td"), "--report")
