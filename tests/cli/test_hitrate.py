"""`kvreuse hitrate` against real HTTP servers on 127.0.0.1 whose /metrics change per scrape."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvreuse.cli.hitrate import Monitor, read_fingerprint
from kvreuse.cli.main import main
from kvreuse.hitrate.prometheus import fetch_page
from kvreuse.hitrate.window import FingerprintChange
from kvreuse.testing.prometheus import MetricsServer, sglang_page, vllm_page


def rising(rates: list[float], per_scrape: float = 1000.0) -> list[str]:
    """vLLM pages whose counters grow by per_scrape queried tokens at the given hit rates."""
    pages, hits, queries = [], 0.0, 0.0
    for rate in rates:
        queries += per_scrape
        hits += per_scrape * rate
        pages.append(vllm_page(hits, queries, engines=2))
    return pages


def args(**overrides: object) -> argparse.Namespace:
    defaults: dict[str, object] = {
        "window": 60.0, "drop": 10.0, "min_queried": 1.0, "model": None, "timeout": 5.0,
        "fingerprint_file": None,
    }
    defaults.update(overrides)
    return argparse.Namespace(**defaults)


def test_json_lines_report_windowed_rate_per_instance(capsys: pytest.CaptureFixture[str]) -> None:
    """Two instances (vLLM and SGLang) scraped three times: one JSON line per instance and round."""
    with MetricsServer(rising([0.5, 0.5, 0.5])) as vllm, MetricsServer(
        page_for=lambda i: sglang_page(cached=300.0 * (i + 1), prompt=1000.0 * (i + 1))
    ) as sglang:
        code = main(["hitrate", vllm.url, sglang.url, "--json", "--count", "3",
                     "--interval", "0.01"])
        assert vllm.scrapes == 3 and sglang.scrapes == 3
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0
    assert [r["instance"] for r in records] == [vllm.url, sglang.url] * 3
    last_vllm, last_sglang = records[-2], records[-1]
    assert last_vllm["source"] == "vllm" and last_vllm["window_hit_rate"] == pytest.approx(0.5)
    assert last_sglang["source"] == "sglang"
    assert last_sglang["window_hit_rate"] == pytest.approx(0.3)
    assert last_vllm["window_queried_tokens"] == pytest.approx(2000.0)


def test_step_drop_alert_over_real_http() -> None:
    """A template change that halves the hit rate raises one alert naming the fingerprint change."""
    with MetricsServer(rising([0.75] * 8 + [0.30] * 8)) as server:
        monitor = Monitor([server.url], args(window=60.0), fetch=fetch_page)
        monitor.fingerprint = "old-fingerprint"
        records = []
        for step in range(16):
            if step == 8:
                for detector in monitor.detectors.values():
                    detector.note_fingerprint_change(
                        FingerprintChange(step * 30.0, "old-fingerprint", "new-fingerprint")
                    )
            records.extend(monitor.round(step * 30.0))
    alerts = [r for r in records if r.get("alert")]
    assert len(alerts) == 1
    assert alerts[0]["baseline_hit_rate"] == pytest.approx(0.75)
    assert alerts[0]["fingerprint_change"]["new"] == "new-fingerprint"
    assert "cold-cache" in alerts[0]["message"]


def test_fingerprint_file_change_is_an_event(tmp_path: Path) -> None:
    """Rewriting the fingerprint file between rounds records a fingerprint_change event."""
    fingerprint_file = tmp_path / "deployed.jsonl"
    fingerprint_file.write_text(json.dumps({"fingerprint": "aaa"}) + "\n")
    with MetricsServer(rising([0.5] * 3)) as server:
        monitor = Monitor([server.url], args(fingerprint_file=str(fingerprint_file)))
        monitor.round(0.0)
        fingerprint_file.write_text(json.dumps({"fingerprint": "bbb"}) + "\n")
        records = monitor.round(10.0)
    assert records[0] == {"t": 10.0, "event": "fingerprint_change", "old": "aaa", "new": "bbb"}
    assert read_fingerprint(fingerprint_file) == "bbb"


def test_a_fingerprint_file_not_in_utf8_reads_as_no_fingerprint(tmp_path: Path) -> None:
    """A fingerprint file being rewritten with other bytes is unreadable, not a traceback."""
    fingerprint_file = tmp_path / "deployed.jsonl"
    fingerprint_file.write_bytes(b"\xff\xfe garbage")
    assert read_fingerprint(fingerprint_file) is None


@pytest.mark.parametrize("line", ["[" * 5000 + "]" * 5000, '{"fingerprint": 1' + "0" * 5000 + "}"],
                         ids=["deep", "long-integer"])
def test_a_fingerprint_line_json_cannot_hold_counts_as_a_bare_fingerprint(
    tmp_path: Path, line: str
) -> None:
    """A line nested too deeply or with an integer too long for Python's json is kept as the
    line itself (as any other non-JSON line), not a RecursionError or ValueError."""
    fingerprint_file = tmp_path / "deployed.jsonl"
    fingerprint_file.write_text(json.dumps({"fingerprint": "aaa"}) + "\n" + line + "\n")
    assert read_fingerprint(fingerprint_file) == ",".join(sorted(["aaa", line]))


def test_unreachable_and_foreign_pages_are_reported_not_fatal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A dead URL and a page without cache metrics produce error records; the command goes on
    through every round, then exits 1 naming both."""
    with MetricsServer(["process_cpu_seconds_total 1\n"]) as server:
        dead = "http://127.0.0.1:9/metrics"
        assert main(["hitrate", dead, server.url, "--json", "--count", "1",
                     "--timeout", "1"]) == 1
    captured = capsys.readouterr()
    assert dead in captured.err and server.url in captured.err
    records = [json.loads(line) for line in captured.out.splitlines()]
    assert records[0]["instance"] == dead and "error" in records[0]
    assert "no prefix-cache metrics" in records[1]["error"]


def test_live_table_mode_renders(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --json a rich table with the instance and its rate is printed."""
    with MetricsServer(rising([0.25, 0.25])) as server:
        assert main(["hitrate", server.url, "--count", "2", "--interval", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "token hit rate" in out and "25.0%" in out
    assert out.endswith("\n")  # piped: the table's last line is closed


@pytest.mark.parametrize("columns", ["80", "100"])
def test_instance_urls_are_never_cut(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, columns: str
) -> None:
    """Two instances whose URLs share a long prefix are both shown whole, with their rates, at
    80 and 100 columns, so they never look alike."""
    monkeypatch.setenv("COLUMNS", columns)
    with MetricsServer(rising([0.25, 0.25])) as one, MetricsServer(rising([0.75, 0.75])) as two:
        tail = "?instance=replica-in-the-eu-west-pool-"
        urls = [one.url + tail + "a", two.url + tail + "b"]
        assert main(["hitrate", *urls, "--count", "2", "--interval", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    lines = out.splitlines()
    assert all(len(line) <= int(columns) for line in lines)
    for url, rate in zip(urls, ("25.0%", "75.0%"), strict=True):
        row = next(i for i, line in enumerate(lines) if url in line)
        assert rate in " ".join(lines[row: row + 3])


@pytest.mark.parametrize("url", ["127.0.0.1:9/metrics", "http://127.0.0.1:abc/metrics",
                                 "http://[::1/metrics", "http://127.0.0.1:9/me trics"])
def test_a_malformed_url_is_refused_up_front(
    capsys: pytest.CaptureFixture[str], url: str
) -> None:
    """A URL without scheme, with a bad port or host, or with a space: one error line naming it
    before any scrape, never a traceback."""
    assert main(["hitrate", url, "--json", "--count", "1"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("kvreuse hitrate: error: metrics URL ")
    assert repr(url) in captured.err and len(captured.err.splitlines()) == 1


@pytest.mark.timeout(60)
def test_a_trickling_instance_does_not_hold_up_the_others(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An instance that sends a byte every 0.1 s is cut at --timeout and reported as such, and
    the healthy one is reported in every round."""
    import time

    from kvreuse.testing.servers import answering_server, trickle

    with answering_server(trickle) as base, MetricsServer(rising([0.5, 0.5])) as good:
        slow = base + "/metrics"
        started = time.monotonic()
        code = main(["hitrate", slow, good.url, "--json", "--count", "2", "--interval", "0.01",
                     "--timeout", "1"])
        elapsed = time.monotonic() - started
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 1 and elapsed < 6.0
    assert [r["error"] for r in records if r["instance"] == slow] == [
        "no whole answer within 1 s"] * 2
    assert [r["window_hit_rate"] for r in records if r["instance"] == good.url][-1] == 0.5
