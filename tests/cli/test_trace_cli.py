"""`kvreuse trace import` and `kvreuse trace stats`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvreuse.cli.main import main
from kvreuse.testing.mooncake import synthetic_mooncake
from kvreuse.testing.tiny_tokenizer import build_tokenizer_dir
from kvreuse.trace.format import parse_trace_lines

SECRET = "0123456789abcdef-import-secret"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"), vocab_size=2000, corpus_lines=3000)


def chat(stamp: object, question: str, **extra: object) -> str:
    system = "You are a careful assistant for CANARYCORP. " * 40
    body = {"model": "tiny", "max_tokens": 8,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}]}
    return json.dumps({"timestamp": stamp, "body": body, **extra})


def test_import_tokenizes_with_the_chat_template_and_writes_no_text(
    tokenizer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chats sharing a long system prompt share leading ids; no text or tenant reaches the
    trace; ISO timestamps become ms from the first line."""
    monkeypatch.setenv("KVREUSE_RECORD_SECRET", SECRET)
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join([
        chat("2026-01-01T00:00:00Z", "What is CANARYQUESTION one?", tenant="CANARYTENANT"),
        chat("2026-01-01T00:00:01.5Z", "And two?", session_id="CANARYSESSION",
             output_tokens=30),
    ]) + "\n")
    out = tmp_path / "trace.jsonl"
    args = ["trace", "import", str(log), "--out", str(out), "--tokenizer", str(tokenizer),
            "--block-size", "32"]
    assert main(args) == 0
    text = out.read_text()
    assert "CANARY" not in text and "assistant" not in text
    first, second = parse_trace_lines(text.splitlines(), block=32)
    assert (first.timestamp_ms, second.timestamp_ms) == (0.0, 1500.0)
    assert first.hash_ids[:5] == second.hash_ids[:5] and first.hash_ids != second.hash_ids
    assert (first.output_length, second.output_length) == (8, 30)
    assert first.tenant is not None and second.session_id is not None and first.model == "tiny"
    assert main([*args[:-2], "--block-size", "32", "--out", str(tmp_path / "again.jsonl")]) == 0
    assert (tmp_path / "again.jsonl").read_text() == text  # same secret, same ids


def test_import_reads_a_time_without_offset_as_utc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A naive ISO time is UTC whatever the machine's zone: beside a UTC one, 1 s apart."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        log = tmp_path / "log.jsonl"
        log.write_text(
            '{"timestamp": "2026-01-01T00:00:00Z", "body": {"model": "m", "prompt": "a"}}\n'
            '{"timestamp": "2026-01-01T00:00:01", "body": {"model": "m", "prompt": "b"}}\n')
        out = tmp_path / "trace.jsonl"
        assert main(["trace", "import", str(log), "--out", str(out)]) == 0
    finally:
        monkeypatch.undo()
        time.tzset()
    assert [r.timestamp_ms for r in parse_trace_lines(out.read_text().splitlines())] == [
        0.0, 1000.0]


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"body": {"model": "m", "prompt": "x"}}', "'timestamp'"),
        ('{"timestamp": NaN, "body": {"model": "m", "prompt": "x"}}', "'timestamp'"),
        ('{"timestamp": "yesterday", "body": {"model": "m", "prompt": "x"}}', "'timestamp'"),
        ('{"timestamp": 1, "body": {"prompt": "x"}}', "body.model"),
        ('{"timestamp": 1, "body": [1]}', "'body'"),
        ('{"timestamp": 1, "body": {"model": "m", "prompt": "x"}, "output_tokens": -2}',
         "'output_tokens'"),
        ('{"timestamp": 0.5, "body": {"model": "m", "prompt": "x"}}', "goes back"),
        ('{"timestamp": 1e300, "body": {"model": "m", "prompt": "x"}}', "at most 1e+13 ms"),
        ('{"timestamp": "1969-12-31T23:59:59Z", "body": {"model": "m", "prompt": "x"}}',
         "1970 or later"),
        ("{oops", "not valid JSON"),
    ],
)
def test_import_bad_lines_name_file_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, field: str
) -> None:
    """Each bad log line exits 1 with file:line and the field, never a traceback."""
    log = tmp_path / "log.jsonl"
    log.write_text('{"timestamp": 1, "body": {"model": "m", "prompt": "hello"}}\n' + line + "\n")
    assert main(["trace", "import", str(log), "--out", str(tmp_path / "t.jsonl")]) == 1
    err = capsys.readouterr().err
    assert "log.jsonl:2" in err and field in err and "Traceback" not in err


def test_a_log_failing_late_leaves_no_half_trace_and_the_old_one_intact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lines are imported as they are read, but a bad line after 2,000 good ones writes nothing:
    an earlier --out keeps its content and no partial file is left beside it."""
    good = ('{"timestamp": %d, "body": {"model": "m", "prompt": "hello there"}}\n')
    log = tmp_path / "log.jsonl"
    log.write_text("".join(good % n for n in range(2000)) + "{oops\n")
    out = tmp_path / "t.jsonl"
    out.write_text("the trace of yesterday\n")
    assert main(["trace", "import", str(log), "--out", str(out)]) == 1
    assert "log.jsonl:2001" in capsys.readouterr().err
    assert out.read_text() == "the trace of yesterday\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl", "t.jsonl"]
    log.write_text("".join(good % n for n in range(2000)))
    assert main(["trace", "import", str(log), "--out", str(out)]) == 0
    assert len(parse_trace_lines(out.read_text().splitlines())) == 2000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl", "t.jsonl"]


def test_import_errors_name_its_own_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A short secret names --secret-file (not the gateway's flag); an --out in a missing
    directory is a one-line error naming --out."""
    log = tmp_path / "log.jsonl"
    log.write_text('{"timestamp": 1, "body": {"model": "m", "prompt": "hello"}}\n')
    short = tmp_path / "secret.txt"
    short.write_text("too short")
    assert main(["trace", "import", str(log), "--out", str(tmp_path / "t.jsonl"),
                 "--secret-file", str(short)]) == 1
    err = capsys.readouterr().err
    assert "--secret-file" in err and "--record-secret-file" not in err
    with pytest.raises(SystemExit) as usage:  # refused as the flag is read, before any work
        main(["trace", "import", str(log), "--out", str(tmp_path / "no" / "t.jsonl")])
    assert usage.value.code == 2
    err = capsys.readouterr().err
    assert "argument --out" in err and "does not exist" in err and "Traceback" not in err


def test_stats_prints_ceiling_bounds_hot_set_and_depth(tmp_path: Path) -> None:
    """stats: the ceiling dominates every pooled bound, bounds grow with the pool, the JSON
    and the report carry the hot set over time and reuse depth."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(synthetic_mooncake(requests=300, documents=8)) + "\n")
    out, report = tmp_path / "s.json", tmp_path / "s.html"
    args = ["trace", "stats", str(trace), "--replicas", "1,2", "--cache-tokens", "20000,80000",
            "--window", "30", "--json", str(out), "--report", str(report)]
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert data["requests"] == 300
    bounds = {(p["replicas"], p["cache_tokens"]): p["hit_rate"] for p in data["pooled"]}
    assert all(b <= data["infinite_hit_rate"] + 1e-9 for b in bounds.values())
    assert bounds[(1, 20000)] <= bounds[(2, 20000)] <= bounds[(2, 80000)]
    assert data["infinite_hit_rate"] > 0.8  # 8 documents of 12 blocks, one private block each
    assert len(data["hot_over_time"]) >= 2 and data["reuse_depth_blocks"]["p50"] == 12
    assert data["requests_with_reuse"] > 250
    assert report.read_text().count("data:image/png;base64,") == 3


def test_stats_takes_the_trace_as_the_other_commands_name_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--trace FILE` works as the positional does; none, or two different ones, is an error
    that says what to do."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(synthetic_mooncake(requests=30, documents=2)) + "\n")
    assert main(["trace", "stats", "--trace", str(trace), "--replicas", "1"]) == 0
    assert "30 requests" in capsys.readouterr().out
    assert main(["trace", "stats", str(trace), "--trace", str(trace)]) == 0
    capsys.readouterr()
    assert main(["trace", "stats"]) == 1
    assert "name the trace" in capsys.readouterr().err
    assert main(["trace", "stats", str(trace), "--trace", str(tmp_path / "other.jsonl")]) == 1
    assert "two traces named" in capsys.readouterr().err
