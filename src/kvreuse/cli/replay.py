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
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvreuse.cli.args import positive_float, positive_int
from kvreuse.cli.tables import make_console
from kvreuse.errors import ConfigError
from kvreuse.sim.summary import percentile
from kvreuse.trace.format import DEFAULT_BLOCK_TOKENS, TraceRecord, parse_trace_lines
from kvreuse.trace.replay import (
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
    parser.add_argument("--json", type=Path, help="write the figures as JSON")
    parser.add_argument("--report", type=Path, help="write an HTML report")
    parser.set_defaults(func=run)


def build_calls(records: Sequence[TraceRecord], args: argparse.Namespace,
                default_model: Callable[[], str] = lambda: "") -> list[Any]:
    """One loadgen :class:`Call` per record within ``--duration``; a record names its model by
    ``--model``, else its own ``model`` field, else ``default_model()`` (called when first
    needed, after the lines before have been checked)."""
    from kvreuse.testing.loadgen import Call

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
    origin = records[0].timestamp_ms
    calls = []
    for record in records:
        if record.input_length > args.max_prompt_tokens:
            raise ConfigError(
                f"{args.trace}:{record.line}: field 'input_length' is {record.input_length:,} "
                f"tokens, over --max-prompt-tokens {args.max_prompt_tokens:,}"
            )
        at_s = (record.timestamp_ms - origin) / 1000.0 / args.speed
        if args.duration is not None and at_s > args.duration:
            break
        tokens = synth.prompt(record)
        prompt: str | list[int] = table.render(tokens) if table is not None else tokens
        body = {"model": args.model or record.model or default_model(), "prompt": prompt,
                "max_tokens": max(1, min(record.output_length, args.max_tokens)),
                "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
        calls.append(Call(at_s, "/v1/completions", json.dumps(body).encode(),
                          session=record.session_id or "", prompt_tokens=len(tokens)))
    return calls


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


def replay(calls: Sequence[Any], target: str, engines: Sequence[str],
           timeout_s: float) -> tuple[ReplaySummary, list[Any]]:
    """Send ``calls``; read engine counters around it. Returns the summary and the results."""
    from kvreuse.testing.loadgen import fleet_hits, run_calls, scrape

    before = scrape(engines) if engines else {}
    started = time.perf_counter()
    results = asyncio.run(run_calls(calls, lambda i, call: target, timeout_s=timeout_s))
    duration = time.perf_counter() - started
    hits = fleet_hits(before, scrape(engines)) if engines else None
    # No queried tokens counted: the pages could not be read (scrape gives zeros), not 0 %.
    engine_rate = hits.hit_rate if hits is not None and hits.queries > 0 else None
    ok = [r for r in results if r.status == 200 and not r.error and r.ttft_s is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    # A target's usage is believed only within [0, prompt]: 1e400, -5 or true is not a count.
    usage = [(r.call.prompt_tokens, r.cached_tokens) for r in ok
             if type(r.cached_tokens) is int and 0 <= r.cached_tokens <= r.call.prompt_tokens]
    prompt = sum(p for p, _ in usage)
    cached = sum(c for _, c in usage) if usage else None

    def pick(fraction: float) -> float | None:
        return percentile(ttfts, fraction) if ttfts else None

    summary = ReplaySummary(
        sent=len(results), ok=len(ok), errors=len(results) - len(ok),
        ttft_p50_s=pick(0.5), ttft_p90_s=pick(0.9), ttft_p95_s=pick(0.95),
        ttft_p99_s=pick(0.99), prompt_tokens=sum(r.call.prompt_tokens for r in results),
        usage_cached_tokens=cached,
        usage_hit_rate=(cached / prompt) if cached is not None and prompt else None,
        engine_hit_rate=engine_rate, duration_s=duration,
    )
    return summary, list(results)


def run(args: argparse.Namespace) -> int:
    if not args.target.startswith("http://"):
        raise ConfigError(f"--target must be an http:// URL, got {args.target!r}")
    try:
        with args.trace.open("rb") as lines:
            records = parse_trace_lines(lines, str(args.trace), args.block_size)
    except OSError as exc:
        raise ConfigError(f"cannot read --trace {args.trace}: {exc.strerror}") from None
    calls = build_calls(records, args, functools.cache(
        lambda: served_model(args.target.rstrip("/"), args.timeout)))
    engines = [u.strip() for u in (args.engine_metrics or "").split(",") if u.strip()]
    console = make_console()
    console.print(f"replaying {len(calls):,} requests over "
                  f"{calls[-1].at_s if calls else 0:,.1f} s to {args.target}")
    summary, results = replay(calls, args.target.rstrip("/"), engines, args.timeout)
    _print(console, summary, engines)
    errors = [failure(r, args.timeout) for r in results
              if not (r.status == 200 and not r.error and r.ttft_s is not None)]
    if errors:
        kinds = Counter(e.split(":")[0] for e in errors).most_common(5)
        console.print("errors: " + ", ".join(f"{n:,} × {kind}" for kind, n in kinds),
                      markup=False, highlight=False)
        console.print(f"first error: {errors[0]}", markup=False, highlight=False)
    if args.json is not None:
        payload = {"trace": str(args.trace), "target": args.target, "speed": args.speed,
                   **summary.as_dict(), "errors_sample": errors[:5]}
        args.json.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        console.print(f"wrote {args.json}")
    if args.report is not None:
        _report(args.report, str(args.trace), args.target, summary, results)
        console.print(f"report: {args.report}")
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
            results: Sequence[Any]) -> None:
    import html

    from kvreuse.cli.simreport import _png, _pyplot, report_page

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4))
    ok = [r for r in results if r.ttft_s is not None and not r.error]
    ax.scatter([r.call.at_s for r in ok], [r.ttft_s for r in ok], s=6)
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
    path.write_text(report_page(f"kvreuse replay: {trace}", body, cells="td"), encoding="utf-8")
