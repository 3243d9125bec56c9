"""Traces: the format and its one parser (:mod:`.format`), traces as simulator traffic
(:mod:`.workload`)."""

from kvreuse.trace.format import (
    DEFAULT_BLOCK_TOKENS,
    TraceRecord,
    parse_record,
    parse_trace_lines,
    record_json,
)
from kvreuse.trace.workload import GRANULARITIES, trace_requests

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "GRANULARITIES",
    "TraceRecord",
    "parse_record",
    "parse_trace_lines",
    "record_json",
    "trace_requests",
]
