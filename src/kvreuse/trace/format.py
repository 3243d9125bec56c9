"""The trace format, and its one parser.

A trace is JSONL in Mooncake's format, one request per line, in arrival order:

* ``timestamp`` — ms since the trace start, a finite number >= 0, never smaller than the line
  before's (a recorder writes in arrival order; a shuffled file is a mistake to fix, not to guess
  around);
* ``input_length``, ``output_length`` — prompt and answer tokens (integers; the prompt >= 1);
* ``hash_ids`` — one id per ``block``-token block of the prompt (the last may be partial), chained
  like vLLM's block hashes, so equal ids at equal positions mean equal prefixes;
* optional: ``session_id`` (string or integer), and what ``kvreuse route --record`` adds:
  ``model``, ``tenant`` (a keyed hash, never the name), ``cached_tokens`` (what the engine
  reported), ``upstream`` and ``ttft_s`` (measured).

:func:`parse_trace_lines` reads lines (``str`` or ``bytes``, from any iterable: the caller opens
the file) and raises :class:`~kvreuse.errors.InputFormatError` naming ``source:line`` and the
field for anything else: bad JSON or UTF-8, missing fields, wrong types, NaN or Infinity,
timestamps going back, absurd lengths, ids that do not cover the prompt. Nothing is half-read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kvreuse.bulk import collector_paused
from kvreuse.errors import InputFormatError
from kvreuse.frozen import fast_init

DEFAULT_BLOCK_TOKENS = 512
"""Tokens per hash id in Mooncake's published traces and ``kvreuse route --record``'s default."""

MAX_LENGTH_TOKENS = 10_000_000
"""Longest prompt or answer a line may claim; beyond it the line is a mistake (no model has
such a context), and accepting it would let one line allocate without bound."""

MAX_HASH_ID = 2**63 - 1
MAX_TIMESTAMP_MS = 10**13
"""About 317 years: larger timestamps are corrupt (or in the wrong unit)."""

MAX_TEXT_FIELD = 256
_INT_ONLY = {int}


@fast_init
@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace, validated. Optional fields are ``None`` when absent."""

    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str | None = None
    model: str | None = None
    tenant: str | None = None
    cached_tokens: int | None = None
    upstream: str | None = None
    ttft_s: float | None = None

    @property
    def arrival_s(self) -> float:
        return self.timestamp_ms / 1000.0


def blocks_for(input_length: int, block: int) -> int:
    """Ids a prompt of ``input_length`` tokens has with ``block``-token blocks."""
    return -(-input_length // block)


def _int(record: dict[str, object], name: str, where: str, low: int, high: int) -> int:
    value = record.get(name)
    if value is None:
        raise InputFormatError(f"missing field {name!r}", where)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputFormatError(f"field {name!r} must be an integer, got {value!r}", where)
    if not low <= value <= high:
        raise InputFormatError(f"field {name!r} must be in [{low}, {high:,}], got {value}", where)
    return value


def _text(record: dict[str, object], name: str, where: str) -> str | None:
    value = record.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise InputFormatError(f"field {name!r} must be a string, got {value!r}", where)
    text = str(value)
    if not text or len(text) > MAX_TEXT_FIELD:
        raise InputFormatError(
            f"field {name!r} must be 1 to {MAX_TEXT_FIELD} characters, got {len(text)}", where
        )
    return text


def _seconds(record: dict[str, object], name: str, where: str) -> float | None:
    value = record.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InputFormatError(f"field {name!r} must be a finite number, got {value!r}", where)
    if value < 0:
        raise InputFormatError(f"field {name!r} must be >= 0, got {value}", where)
    return float(value)


def _fast_decoder() -> Callable[[str | bytes], Any] | None:
    """msgspec's typed decoder of a plain Mooncake line (the gateway extra installs msgspec):
    about three times faster than ``json.loads`` plus the checks. Anything it refuses goes to
    the full parser, which names the problem; without msgspec everything does."""
    try:
        import msgspec
    except ImportError:
        return None

    class MooncakeLine(msgspec.Struct, forbid_unknown_fields=True):
        timestamp: float
        input_length: int
        output_length: int
        hash_ids: list[int]

    return msgspec.json.Decoder(MooncakeLine).decode


_FAST = _fast_decoder()


def _fast_record(
    line: str | bytes, number: int, block: int
) -> TraceRecord | None:
    """The record of a plain, valid Mooncake line; ``None`` for anything else (the full parser
    then decides)."""
    assert _FAST is not None
    try:
        row = _FAST(line)
    except Exception:  # msgspec's DecodeError and ValidationError: the full parser explains
        return None
    stamp, length, output, ids = row.timestamp, row.input_length, row.output_length, row.hash_ids
    if (
        not 0 <= stamp <= MAX_TIMESTAMP_MS  # also refuses NaN
        or not 1 <= length <= MAX_LENGTH_TOKENS
        or not 0 <= output <= MAX_LENGTH_TOKENS
        or len(ids) != -(-length // block)
        or min(ids) < 0
        or max(ids) > MAX_HASH_ID
    ):
        return None
    return TraceRecord(number, stamp, length, output, tuple(ids))


def parse_record(
    line: str | bytes, number: int, source: str, block: int = DEFAULT_BLOCK_TOKENS
) -> TraceRecord | None:
    """One line; ``None`` for a blank line. Does not check the order against other lines."""
    if _FAST is not None:
        fast = _fast_record(line, number, block)
        if fast is not None:
            return fast
    where = f"{source}:{number}"
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputFormatError(f"not valid UTF-8 (byte {exc.start})", where) from None
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputFormatError(f"not valid JSON ({exc.msg} at column {exc.colno})", where) from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer of over 4,300 digits
        raise InputFormatError(f"not valid JSON ({exc})", where) from None
    if not isinstance(record, dict):
        raise InputFormatError("each line must be a JSON object", where)
    stamp = record.get("timestamp")
    if stamp is None:
        raise InputFormatError("missing field 'timestamp'", where)
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not math.isfinite(stamp):
        raise InputFormatError(
            f"field 'timestamp' must be a finite number of ms, got {stamp!r}", where
        )
    if not 0 <= stamp <= MAX_TIMESTAMP_MS:
        raise InputFormatError(
            f"field 'timestamp' must be in [0, {MAX_TIMESTAMP_MS:.0e}] ms, got {stamp}", where
        )
    input_length = _int(record, "input_length", where, 1, MAX_LENGTH_TOKENS)
    output_length = _int(record, "output_length", where, 0, MAX_LENGTH_TOKENS)
    ids = record.get("hash_ids")
    if ids is None:
        raise InputFormatError("missing field 'hash_ids'", where)
    # set(map(type, ...)) and min/max run in C: this check is most of a line's parse time.
    if (
        not isinstance(ids, list)
        or not ids
        or set(map(type, ids)) != _INT_ONLY
        or min(ids) < 0
        or max(ids) > MAX_HASH_ID
    ):
        raise InputFormatError(
            f"field 'hash_ids' must be a list of integers in [0, 2**63), got {ids!r:.80}", where
        )
    blocks = blocks_for(input_length, block)
    if len(ids) != blocks:
        raise InputFormatError(
            f"field 'hash_ids' has {len(ids)} ids but input_length {input_length} needs "
            f"{blocks} blocks of {block} tokens; check the block size (--trace-block-size)",
            where,
        )
    if len(record) == 4:  # the four Mooncake fields only: nothing optional to check
        return TraceRecord(number, float(stamp), input_length, output_length, tuple(ids))
    cached = record.get("cached_tokens")
    if cached is not None:
        cached = _int(record, "cached_tokens", where, 0, input_length)
    return TraceRecord(
        line=number,
        timestamp_ms=float(stamp),
        input_length=input_length,
        output_length=output_length,
        hash_ids=tuple(ids),
        session_id=_text(record, "session_id", where),
        model=_text(record, "model", where),
        tenant=_text(record, "tenant", where),
        cached_tokens=cached,
        upstream=_text(record, "upstream", where),
        ttft_s=_seconds(record, "ttft_s", where),
    )


def iter_trace_records(
    lines: Iterable[str | bytes],
    source: str = "trace",
    block: int = DEFAULT_BLOCK_TOKENS,
    after_ms: float = 0.0,
) -> Iterator[TraceRecord]:
    """The requests of a trace one at a time, in file order (which is arrival order, none
    before ``after_ms``: where an earlier file of the same recording ended). Errors name
    ``source:line``. O(ids) per record."""
    if block < 1:
        raise InputFormatError(f"the trace block size must be >= 1, got {block}")
    previous = after_ms
    for number, line in enumerate(lines, start=1):
        record = parse_record(line, number, source, block)
        if record is None:
            continue
        if record.timestamp_ms < previous:
            raise InputFormatError(
                f"field 'timestamp' goes back in time: {record.timestamp_ms:g} ms after "
                f"{previous:g} ms on an earlier line (a trace is in arrival order; sort it "
                f"by timestamp)",
                f"{source}:{number}",
            )
        previous = record.timestamp_ms
        yield record


def parse_trace_lines(
    lines: Iterable[str | bytes],
    source: str = "trace",
    block: int = DEFAULT_BLOCK_TOKENS,
    *,
    allow_empty: bool = False,
) -> list[TraceRecord]:
    """Every request of a trace, in file order (which is arrival order). O(total ids)."""
    with collector_paused():  # a million records, no cycles (kvreuse.bulk)
        out = list(iter_trace_records(lines, source, block))
    if not out and not allow_empty:
        raise InputFormatError("the trace holds no requests", source)
    return out


def record_json(record: TraceRecord) -> str:
    """The JSONL line of ``record`` (optional fields only when set); parses back equal."""
    row: dict[str, object] = {
        "timestamp": int(record.timestamp_ms)
        if record.timestamp_ms.is_integer()
        else record.timestamp_ms,
        "input_length": record.input_length,
        "output_length": record.output_length,
        "hash_ids": list(record.hash_ids),
    }
    for name in ("session_id", "model", "tenant", "cached_tokens", "upstream", "ttft_s"):
        value = getattr(record, name)
        if value is not None:
            row[name] = value
    return json.dumps(row, separators=(",", ":"), allow_nan=False)
