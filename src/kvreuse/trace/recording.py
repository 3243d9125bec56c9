"""What ``kvreuse route --record`` names its files, and several recordings as one trace.

A recording's timestamps count from its own start: a gateway restarted, or the several gateways
of one fleet, each write their own clock's zero. Their files are named
``trace-<start>-<pid>-<part>.jsonl``, ``<start>`` the recording's start in UTC to the
millisecond (``20261207T144512.123Z``; recordings of earlier versions name it to the second
only, ``20261207T144512``), ``<part>`` zero-padded so one recording's files sort in order.
:func:`merge_recordings` puts each recording's requests back on one clock by its start and
interleaves them in arrival order (``kvreuse trace merge``). Pure: names and records in, records
out.
"""

from __future__ import annotations

import dataclasses
import heapq
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from kvreuse.trace.format import TraceRecord

_NAME = re.compile(r"trace-(\d{8}T\d{6})(?:\.(\d{3})Z)?-(\d+)-(\d+)\.jsonl")


def recording_file_name(start_s: float, pid: int, part: int) -> str:
    """The name of part ``part`` (from 1) of the recording that process ``pid`` started at
    ``start_s`` (seconds since the epoch). :meth:`RecordingFile.parse` reads it back."""
    seconds, millis = divmod(int(start_s * 1000), 1000)
    stamp = datetime.fromtimestamp(seconds, UTC).strftime("%Y%m%dT%H%M%S")
    return f"trace-{stamp}.{millis:03d}Z-{pid}-{part:05d}.jsonl"


@dataclass(frozen=True, slots=True, order=True)
class RecordingFile:
    """What a recorded file's name says: the recording (its start and process) and the part."""

    start_ms: int
    """The recording's start, milliseconds since the epoch (to the second in old names)."""
    pid: int
    part: int
    to_the_second: bool
    """The name gives the start to the second only (recorded before names carried ms)."""

    @classmethod
    def parse(cls, name: str) -> RecordingFile | None:
        """The parts of a file name :func:`recording_file_name` made, else None."""
        found = _NAME.fullmatch(name)
        if found is None:
            return None
        try:
            start = datetime.strptime(found[1], "%Y%m%dT%H%M%S").replace(tzinfo=UTC)
        except ValueError:  # month 13, second 61: not a name the recorder wrote
            return None
        millis = int(found[2]) if found[2] is not None else 0
        return cls(int(start.timestamp()) * 1000 + millis, int(found[3]), int(found[4]),
                   found[2] is None)

    @property
    def recording(self) -> tuple[int, int]:
        """Which recording the file is a part of: its start and process."""
        return self.start_ms, self.pid


def merge_recordings(
    recordings: Sequence[tuple[int, Iterable[TraceRecord]]],
) -> Iterator[TraceRecord]:
    """The requests of ``recordings`` (each its start in ms since the epoch and its records in
    arrival order) in one arrival order, timestamped from the earliest start. Requests at the
    same moment keep the order of ``recordings``. A single recording comes out as it went in.
    O(log recordings) per request, holding one request per recording."""
    if not recordings:
        return
    zero = min(start for start, _ in recordings)

    def shifted(start: int, records: Iterable[TraceRecord]) -> Iterator[TraceRecord]:
        offset = start - zero
        for record in records:
            yield dataclasses.replace(record, timestamp_ms=round(record.timestamp_ms + offset, 3))

    yield from heapq.merge(*(shifted(start, records) for start, records in recordings),
                           key=lambda record: record.timestamp_ms)
