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

Token granularity holds every prompt's tokens at once (4 bytes each, no prefix shared between
requests' buffers), so it refuses a trace past ``MAX_TOKEN_GRANULARITY_BYTES`` up front with a
message pointing to block granularity, rather than a ``MemoryError`` after minutes of expanding
(a 200-request trace of 10M-token prompts: 8 GB). The Mooncake trace holds 0.23 GiB.

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

MAX_TOKEN_GRANULARITY_BYTES = 4 * 2**30
"""Most prompt bytes token granularity expands a trace into (1 Gi tokens); the simulator's
caches hold copies of those on top."""


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
        tokens = sum(min(len(r.hash_ids) * block, r.input_length) for r in records)
        if tokens * TOKEN_BYTES > MAX_TOKEN_GRANULARITY_BYTES:
            raise ConfigError(
                f"{source}: token granularity would hold {tokens:,} prompt tokens at once "
                f"({tokens * TOKEN_BYTES / 2**30:.1f} GiB, more than "
                f"{MAX_TOKEN_GRANULARITY_BYTES / 2**30:g} GiB); use block granularity (the "
                "default, one unit per hash id) or a shorter trace"
            )
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
