"""``kvreuse hitrate``: scrape engines' /metrics and show each one's windowed token hit rate.

A live table by default, JSON lines with ``--json``. A step-change alert fires when an
instance's windowed rate falls more than ``--drop`` points below the previous window; with
``--fingerprint-file`` (the JSON that ``kvreuse fingerprint`` prints for the deployed template,
re-read every scrape) an alert says whether the prompt fingerprint changed just before.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console, RenderableType

from kvreuse.cli.args import non_negative_float, positive_float, positive_int
from kvreuse.cli.tables import make_console, table_renderable
from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.hitrate.prometheus import (
    cache_counters,
    fetch_page,
    metric_names,
    parse_exposition,
)
from kvreuse.hitrate.window import (
    FingerprintChange,
    RateReading,
    StepAlert,
    StepDetector,
    WindowedHitRate,
)
from kvreuse.json_input import parse_json


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "hitrate",
        help="live per-instance token hit rate from vLLM/SGLang /metrics, with step alerts",
        description=(
            "Scrape each URL (an engine's /metrics) every --interval seconds and report the "
            "token hit rate (cached / queried prompt tokens) over --window seconds."
        ),
    )
    parser.add_argument("urls", nargs="+", help="metrics URLs, e.g. http://127.0.0.1:8000/metrics")
    parser.add_argument(
        "--interval", type=positive_float, default=5.0, help="seconds between scrapes"
    )
    parser.add_argument(
        "--window", type=positive_float, default=300.0, help="rate window in seconds"
    )
    parser.add_argument(
        "--drop", type=non_negative_float, default=10.0,
        help="alert when the rate falls this many points",
    )
    parser.add_argument(
        "--min-queried",
        type=non_negative_float,
        default=1.0,
        help="ignore windows with fewer queried tokens than this (noise)",
    )
    parser.add_argument("--model", help="only count series with this model_name label")
    parser.add_argument(
        "--count", type=positive_int,
        help="stop after this many scrape rounds; exit 1 if an instance's last scrape failed",
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=5.0, help="HTTP timeout per scrape"
    )
    parser.add_argument("--json", action="store_true", help="print JSON lines, no table")
    parser.add_argument(
        "--fingerprint-file",
        help="file with the deployed prompt fingerprint(s) (kvreuse fingerprint output)",
    )
    parser.set_defaults(func=run)


def read_fingerprint(path: Path) -> str | None:
    """The fingerprints in a ``kvreuse fingerprint`` output file, joined; None if unreadable."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    prints = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            value = parse_json(line)
        except InputFormatError:  # not JSON (a bare fingerprint), or JSON too deep or too long
            prints.append(line)
            continue
        if isinstance(value, dict) and isinstance(value.get("fingerprint"), str):
            prints.append(value["fingerprint"])
    return ",".join(sorted(prints)) or None


class Monitor:
    """All instances' trackers and detectors; one :meth:`round` per scrape interval."""

    def __init__(
        self,
        urls: list[str],
        args: argparse.Namespace,
        fetch: Callable[[str, float], str] = fetch_page,
    ) -> None:
        self.urls = urls
        self.args = args
        self.fetch = fetch
        self.trackers = {url: WindowedHitRate(url, args.window) for url in urls}
        self.detectors = {
            url: StepDetector(args.drop, args.window, args.min_queried) for url in urls
        }
        self.fingerprint: str | None = None
        self.latest: dict[str, RateReading | str] = {}
        self.alerts: list[StepAlert] = []

    def _check_fingerprint(self, t: float) -> FingerprintChange | None:
        if self.args.fingerprint_file is None:
            return None
        current = read_fingerprint(Path(self.args.fingerprint_file))
        if current is None or current == self.fingerprint:
            return None
        previous, self.fingerprint = self.fingerprint, current
        if previous is None:
            return None
        change = FingerprintChange(t, previous, current)
        for detector in self.detectors.values():
            detector.note_fingerprint_change(change)
        return change

    def _fetch_all(self) -> list[str | OSError]:
        """Every instance's page (or why not), fetched at once: a slow instance costs the round
        one ``--timeout``, not one per instance, and does not delay the others' readings."""

        def fetch(url: str) -> str | OSError:
            try:
                return self.fetch(url, self.args.timeout)
            except OSError as exc:
                return exc

        if len(self.urls) == 1:
            return [fetch(self.urls[0])]
        with ThreadPoolExecutor(max_workers=min(len(self.urls), 32)) as pool:
            return list(pool.map(fetch, self.urls))

    def round(self, t: float) -> list[dict[str, Any]]:
        """Scrape every instance once; returns the JSON records of this round."""
        records: list[dict[str, Any]] = []
        change = self._check_fingerprint(t)
        if change is not None:
            records.append(
                {"t": t, "event": "fingerprint_change", "old": change.old, "new": change.new}
            )
        for url, page in zip(self.urls, self._fetch_all(), strict=True):
            try:
                if isinstance(page, OSError):
                    raise page
                samples = parse_exposition(page, url)
                counters = cache_counters(samples, self.args.model)
            except (OSError, InputFormatError) as exc:
                message = " ".join(str(exc).split())
                self.latest[url] = f"error: {message}"
                records.append({"t": t, "instance": url, "error": message})
                continue
            if counters is None:
                names = ", ".join(sorted(metric_names(samples))[:8])
                message = f"no prefix-cache metrics on this page (saw: {names or 'nothing'})"
                self.latest[url] = message
                records.append({"t": t, "instance": url, "error": message})
                continue
            reading = self.trackers[url].observe(t, counters)
            self.latest[url] = reading
            records.append(_reading_json(reading))
            alert = self.detectors[url].observe(reading)
            if alert is not None:
                self.alerts.append(alert)
                records.append(_alert_json(alert))
        return records


def _reading_json(reading: RateReading) -> dict[str, Any]:
    return {
        "t": reading.t,
        "instance": reading.instance,
        "source": reading.family,
        "window_hit_rate": reading.window_rate,
        "lifetime_hit_rate": reading.lifetime_rate,
        "window_queried_tokens": reading.window_queries,
        "window_cached_tokens": reading.window_hits,
        "window_seconds": reading.covered_seconds,
        "counter_reset": reading.reset,
        "counters_inconsistent": reading.inconsistent,
    }


def _alert_json(alert: StepAlert) -> dict[str, Any]:
    change = alert.fingerprint_change
    return {
        "t": alert.t,
        "instance": alert.instance,
        "alert": "hit_rate_step_drop",
        "baseline_hit_rate": alert.baseline_rate,
        "current_hit_rate": alert.current_rate,
        "drop_points": alert.drop_points,
        "fingerprint_change": None if change is None else asdict(change),  # t, old, new
        "message": alert.describe(),
    }


HEADERS = ("instance", "source", "window", "lifetime", "queried tok/s", "status")


def _table(monitor: Monitor, console: Console) -> RenderableType:
    """One row per instance. URLs and errors are never cut (two URLs that differ only in the
    port must not look alike), and neither are figures: see :mod:`kvreuse.cli.tables`."""
    rows = []
    for url in monitor.urls:
        state = monitor.latest.get(url)
        if not isinstance(state, RateReading):
            rows.append([url, "", "", "", "", state or "waiting"])
            continue
        window = "-" if state.window_rate is None else f"{state.window_rate:.1%}"
        lifetime = "-" if state.lifetime_rate is None else f"{state.lifetime_rate:.1%}"
        per_second = (
            f"{state.window_queries / state.covered_seconds:,.0f}" if state.covered_seconds else "-"
        )
        alerts = [a for a in monitor.alerts if a.instance == url]
        status = f"ALERT: fell {alerts[-1].drop_points:.1f} pts" if alerts else "ok"
        if state.inconsistent:
            status = "counters inconsistent: more cached than queried tokens"
        rows.append([url, state.family, window, lifetime, per_second, status])
    title = f"token hit rate, {monitor.args.window:.0f} s window"
    return table_renderable(console, title, HEADERS, rows, text_columns=(0, 5))


def check_url(url: str) -> str:
    """``url`` if it is an ``http://`` or ``https://`` URL with a host and a valid port; else
    :class:`ConfigError` saying what is wrong (:func:`~kvreuse.gateway.config.http_url_problem`)."""
    from kvreuse.gateway.config import http_url_problem

    problem = http_url_problem(url)
    if problem is None:
        return url
    if problem.startswith("it needs http"):
        problem += f", e.g. http://{url.split('://')[-1]}"
    raise ConfigError(f"metrics URL {url!r}: {problem}")


def run(args: argparse.Namespace) -> int:
    monitor = Monitor([check_url(url) for url in args.urls], args)
    rounds = 0
    live = None
    if not args.json:
        from rich.live import Live

        console = make_console()
        live = Live(_table(monitor, console), console=console, refresh_per_second=4,
                    transient=False)
        live.start()
    try:
        while args.count is None or rounds < args.count:
            started = time.monotonic()
            records = monitor.round(time.time())
            rounds += 1
            if args.json:
                for record in records:
                    print(json.dumps(record), flush=True)
            else:
                assert live is not None
                live.update(_table(monitor, live.console))
                for record in records:
                    if "alert" in record:
                        live.console.print(f"[bold red]{record['message']}[/]")
            if args.count is not None and rounds >= args.count:
                break
            time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()
            if not live.console.is_terminal:  # Live leaves a piped table's last line open
                live.console.line()
    sys.stdout.flush()
    failing = [url for url in monitor.urls if not isinstance(monitor.latest.get(url), RateReading)]
    if failing:
        for url in failing:
            print(f"kvreuse hitrate: {url}: {monitor.latest.get(url, 'not scraped')}",
                  file=sys.stderr)
        return 1
    return 0
