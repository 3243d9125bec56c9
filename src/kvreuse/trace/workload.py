"""A parsed trace as simulator traffic, at token or block granularity.

``token`` granularity (what ``kvreuse simulate --trace`` did before block replay) expands each
id into ``block`` copies of one token id, cut to ``input_length``: exact lengths, but every
prompt of a Mooncake trace is tens of thousands of tokens, which the parser packs and every
cache lookup walks.

``block`` granularity (the default) simulates one id as one unit of ``block`` tokens
(:mod:`kvreuse.sim.units`): a request costs O(its ids). Only lengths lose precision: a prompt
becomes its id count rounded to the nearest whole block (at least one), an answer its length
rounded likewise; results report each prompt's exact length (and cap its cached tokens at it),
so hit rates and prefill costs have exact denominators and only timing sees the rounding. The
partial last block of a trace's prompt is almost always private (its hash
covers a partial block no other prompt shares), so the rounding moves prompt sizes both ways by
at most half a block and leaves what is shared exact; ``tests/trace/test_workload.py`` holds the
two granularities' figures to each other on the real trace.

At block granularity a trace whose ids do not all fit the simulator's 32-bit token ids (recorded
traces use 63-bit keyed hashes) has them renumbered densely in order of first appearance:
equality is all that matters.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from kvreuse.bulk import collector_paused
from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.sim.requests import SimRequest
from kvreuse.sim.units import TraceUnits
from kvreuse.tokens import MAX_TOKEN_ID, TOKEN_BYTES, TokenBuffer, pack
from kvreuse.trace.format import TraceRecord

GRANULARITIES = ("block", "token")

_BLOCK_TOKEN = struct.Struct("<I")


def _token_request(record: TraceRecord, block: int, source: str) -> SimRequest:
    ids = record.hash_ids
    if ids and max(ids) > MAX_TOKEN_ID:
        raise InputFormatError(
            "field 'hash_ids' holds an id >= 2**32, which token granularity cannot replay; "
            "use block granularity",
            f"{source}:{record.line}",
        )
    body = b"".join(_BLOCK_TOKEN.pack(h) * block for h in ids)
    return SimRequest(
        request_id=record.line,
        arrival_s=record.arrival_s,
        tokens=TokenBuffer(body[: record.input_length * TOKEN_BYTES]),
        prompt_len=record.input_length,
        output_len=record.output_length,
        session_id=record.session_id,
    )


def trace_requests(
    records: Sequence[TraceRecord],
    block: int,
    granularity: str = "block",
    source: str = "trace",
) -> tuple[list[SimRequest], TraceUnits]:
    """The simulator's requests for ``records`` and the units they are counted in.
    O(total ids) at block granularity, O(total tokens) at token granularity."""
    if granularity not in GRANULARITIES:
        raise ConfigError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "token":
        return [_token_request(r, block, source) for r in records], TraceUnits(1)
    dense: dict[int, int] | None = None
    if any(max(r.hash_ids) > MAX_TOKEN_ID for r in records):
        dense = {}
    half = block // 2
    out = []
    with collector_paused():  # a million requests, no cycles (kvreuse.bulk)
        for record in records:
            units = max(1, (record.input_length + half) // block)
            ids = record.hash_ids[:units]
            if dense is not None:
                ids = tuple([dense.setdefault(h, len(dense)) for h in ids])
            out.append(
                SimRequest(
                    request_id=record.line,
                    arrival_s=record.arrival_s,
                    tokens=pack(ids),
                    prompt_len=units,
                    output_len=(record.output_length + half) // block,
                    session_id=record.session_id,
                )
            )
        exact = {r.line: r.input_length for r in records}
    return out, TraceUnits(block, exact)
