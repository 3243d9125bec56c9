"""Recorded files' names, and several recordings put on one clock."""

from __future__ import annotations

import random

from kvreuse.trace.format import TraceRecord
from kvreuse.trace.recording import RecordingFile, merge_recordings, recording_file_name


def at(ms: float, line: int = 1) -> TraceRecord:
    return TraceRecord(line, ms, 512, 1, (line,))


def test_a_name_gives_back_its_start_to_the_millisecond() -> None:
    """The start (UTC), process and part of a name made by the recorder read back exactly."""
    name = recording_file_name(1_796_654_712.3456, 4242, 7)
    assert name == "trace-20261207T144512.345Z-4242-00007.jsonl"
    parsed = RecordingFile.parse(name)
    assert parsed == RecordingFile(1_796_654_712_345, 4242, 7, to_the_second=False)
    assert parsed.recording == (1_796_654_712_345, 4242)


def test_names_from_before_the_milliseconds_still_read() -> None:
    """A name of an earlier recorder gives its start to the second, and says so."""
    parsed = RecordingFile.parse("trace-20261207T144512-99-00001.jsonl")
    assert parsed == RecordingFile(1_796_654_712_000, 99, 1, to_the_second=True)


def test_other_names_are_not_recordings() -> None:
    """Names the recorder never makes, or with an impossible date, are not read as recordings."""
    for name in ("trace.jsonl", "trace-1-1-00001.jsonl", "trace-20261307T144512-1-1.jsonl",
                 "trace-20261207T144512.12Z-1-1.jsonl", "trace-20261207T144512-1-1.jsonl.gz"):
        assert RecordingFile.parse(name) is None, name


def test_one_recordings_names_sort_by_part_and_recordings_by_start() -> None:
    """Zero-padded parts sort in order; a later start sorts after, at any millisecond."""
    names = [recording_file_name(1000.5, 1, part) for part in (10, 2, 1)]
    assert sorted(names) == [recording_file_name(1000.5, 1, part) for part in (1, 2, 10)]
    assert recording_file_name(1000.999, 1, 1) < recording_file_name(1001.0, 1, 1)


def test_recordings_interleave_on_the_earliest_start() -> None:
    """A recording started 1.5 s later has its requests moved 1,500 ms on, between the first
    recording's; at equal times the first recording's request comes first."""
    first = [at(0.0, 1), at(1000.0, 2), at(2500.0, 3)]
    second = [at(0.0, 11), at(1000.0, 12)]
    merged = list(merge_recordings([(10_000, first), (11_500, second)]))
    assert [(r.line, r.timestamp_ms) for r in merged] == [
        (1, 0.0), (2, 1000.0), (11, 1500.0), (3, 2500.0), (12, 2500.0)]


def test_one_recording_comes_out_as_it_went_in() -> None:
    """Merging a single recording changes nothing."""
    records = [at(0.0, 1), at(12.345, 2), at(12.345, 3), at(99.5, 4)]
    assert list(merge_recordings([(5_000, records)])) == records
    assert list(merge_recordings([])) == []


def test_seeded_recordings_merge_sorted_and_whole() -> None:
    """Random recordings: the merge is in time order and holds each request once, moved by its
    recording's start."""
    rng = random.Random(7)
    for _ in range(50):
        recordings = []
        expected = []
        for k in range(rng.randint(1, 5)):
            start = rng.randint(0, 5000)
            stamps = sorted(round(rng.uniform(0, 3000), 3) for _ in range(rng.randint(0, 30)))
            records = [at(ms, 1000 * k + i) for i, ms in enumerate(stamps)]
            recordings.append((start, records))
            expected += [(r.line, r.timestamp_ms + start) for r in records]
        zero = min(start for start, _ in recordings)
        merged = list(merge_recordings(recordings))
        times = [r.timestamp_ms for r in merged]
        assert times == sorted(times)
        assert sorted((r.line, round(r.timestamp_ms + zero, 3)) for r in merged) == sorted(
            (line, round(ms, 3)) for line, ms in expected)
