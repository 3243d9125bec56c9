"""The one trace parser: valid lines, and bad ones named by file, line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvreuse.cli.main import main
from kvreuse.errors import InputFormatError
from kvreuse.trace.format import TraceRecord, parse_trace_lines, record_json

GOOD = '{"timestamp": 5, "input_length": 1000, "output_length": 3, "hash_ids": [7, 8]}'


def test_good_line_parses_with_optional_fields() -> None:
    """A recorded line keeps its optional fields; file order is kept."""
    recorded = json.dumps({"timestamp": 9.5, "input_length": 600, "output_length": 2,
                           "hash_ids": [2**62, 1], "session_id": 42, "model": "m",
                           "tenant": "ab12", "cached_tokens": 512, "upstream": "u1",
                           "ttft_s": 0.25})
    a, b = parse_trace_lines([GOOD, "", recorded])
    assert (a.line, a.timestamp_ms, a.input_length, a.hash_ids) == (1, 5.0, 1000, (7, 8))
    assert a.session_id is None and a.cached_tokens is None
    assert b.session_id == "42" and b.hash_ids[0] == 2**62 and b.cached_tokens == 512
    assert (b.model, b.tenant, b.upstream, b.ttft_s) == ("m", "ab12", "u1", 0.25)


def test_record_json_round_trips() -> None:
    """record_json writes a line that parses back to an equal record."""
    record = TraceRecord(1, 12.0, 513, 4, (1, 2), "s", "m", "t", 0, "u", 0.5)
    assert parse_trace_lines([record_json(record)]) == [record]


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("{not json", "not valid JSON"),
        (b'{"timestamp": 1, "x": "\xff"}', "UTF-8"),
        ("[1, 2]", "JSON object"),
        ('{"input_length": 1000, "output_length": 3, "hash_ids": [7, 8]}', "'timestamp'"),
        (GOOD.replace('"output_length": 3, ', ""), "'output_length'"),
        (GOOD.replace(', "hash_ids": [7, 8]', ""), "'hash_ids'"),
        (GOOD.replace('"timestamp": 5', '"timestamp": NaN'), "'timestamp'"),
        (GOOD.replace('"timestamp": 5', '"timestamp": Infinity'), "'timestamp'"),
        (GOOD.replace('"timestamp": 5', '"timestamp": -1'), "'timestamp'"),
        (GOOD.replace('"timestamp": 5', '"timestamp": 1e400'), "'timestamp'"),
        (GOOD.replace('"input_length": 1000', '"input_length": NaN'), "'input_length'"),
        (GOOD.replace('"input_length": 1000', '"input_length": "1000"'), "'input_length'"),
        (GOOD.replace('"input_length": 1000', '"input_length": 99999999999'), "'input_length'"),
        (GOOD.replace('"input_length": 1000', '"input_length": 0'), "'input_length'"),
        (GOOD.replace('"output_length": 3', '"output_length": -1'), "'output_length'"),
        (GOOD.replace("[7, 8]", "[7]"), "'hash_ids'"),
        (GOOD.replace("[7, 8]", '[7, "x"]'), "'hash_ids'"),
        (GOOD.replace("[7, 8]", "[7, Infinity]"), "'hash_ids'"),
        (GOOD.replace("[7, 8]", "[7, -8]"), "'hash_ids'"),
        (GOOD.replace("[7, 8]", "[7, true]"), "'hash_ids'"),
        (GOOD.replace("[7, 8]", "[7, " + "9" * 5000 + "]"), "not valid JSON"),
        (GOOD.replace("}", ', "ttft_s": NaN}'), "'ttft_s'"),
        (GOOD.replace("}", ', "cached_tokens": 5000}'), "'cached_tokens'"),
        (GOOD.replace("}", ', "session_id": [1]}'), "'session_id'"),
        ("[" * 100_000, "not valid JSON"),
    ],
)
def test_bad_line_names_file_line_and_field(line: str | bytes, field: str) -> None:
    """Each malformed line raises InputFormatError naming source:line and the field."""
    with pytest.raises(InputFormatError) as err:
        parse_trace_lines([GOOD, "", line], source="t.jsonl")
    assert "t.jsonl:3" in str(err.value) and field in str(err.value)


def test_timestamps_going_back_are_an_error() -> None:
    """A timestamp smaller than an earlier line's is refused, naming the line."""
    with pytest.raises(InputFormatError, match=r"t.jsonl:2: field 'timestamp' goes back"):
        parse_trace_lines([GOOD, GOOD.replace('"timestamp": 5', '"timestamp": 4')], "t.jsonl")


def test_empty_trace_is_an_error() -> None:
    """A trace without requests says so instead of producing empty (nan) figures."""
    with pytest.raises(InputFormatError, match="no requests"):
        parse_trace_lines(["", "  "], "t.jsonl")


def test_block_size_decides_the_id_count() -> None:
    """With 256-token blocks a 1000-token prompt needs 4 ids, and 2 is an error."""
    assert parse_trace_lines([GOOD.replace("[7, 8]", "[1, 2, 3, 4]")], block=256)
    with pytest.raises(InputFormatError, match="needs 4 blocks of 256"):
        parse_trace_lines([GOOD], block=256)


@pytest.mark.parametrize(
    "bad",
    ['"timestamp": NaN', '"timestamp": Infinity', '"timestamp": -Infinity'],
)
def test_simulate_trace_refuses_non_finite_timestamps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    """`simulate --trace` exits 1 naming line and field, never a traceback or nan (issue 18)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD + "\n" + GOOD.replace('"timestamp": 5', bad) + "\n")
    assert main(["simulate", "--trace", str(trace), "--cache-tokens", "5000"]) == 1
    err = capsys.readouterr().err
    assert "t.jsonl:2" in err and "'timestamp'" in err and "Traceback" not in err


def test_simulate_trace_refuses_non_finite_rates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--prefill-rate nan is refused by name."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD + "\n")
    args = ["simulate", "--trace", str(trace), "--cache-tokens", "5000", "--prefill-rate", "nan"]
    assert main(args) == 1
    assert "--prefill-rate" in capsys.readouterr().err


def test_fast_and_full_parsers_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """msgspec's fast path and the full parser give equal records for valid lines."""
    from kvreuse.testing.mooncake import synthetic_mooncake
    from kvreuse.trace import format as trace_format

    lines = [*synthetic_mooncake(requests=200), GOOD.replace('"timestamp": 5', '"timestamp": 1e9')]
    fast = parse_trace_lines(lines)
    monkeypatch.setattr(trace_format, "_FAST", None)
    assert parse_trace_lines(lines) == fast
