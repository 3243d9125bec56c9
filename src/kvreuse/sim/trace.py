"""Trace replay: Mooncake-format JSONL, and the two bounds every trace run reports.

Format (one JSON object per line): ``timestamp`` (ms since the trace start), ``input_length``
and ``output_length`` (tokens), ``hash_ids`` (one id per ``block_size``-token block of the prompt,
chained: equal ids at equal positions mean equal prefixes, the last block may be partial) and an
optional ``session_id``. Each block id becomes ``block_size`` copies of one token id, so two
prompts share exactly the blocks whose ids agree from the first one; the prompt is cut to
``input_length``. Parsing reads lines from any iterable (the CLI opens the file); a bad line
raises :class:`InputFormatError` naming the line and the field, and nothing is half-read.

Bounds. ``infinite_hit_rate``: one cache that never forgets, seeing every prompt in arrival
order. ``pooled_lru_hit_rate``: one LRU radix cache of N × C tokens, the most N replicas of C
could hold between them with a perfect router and no running requests; neither can be beaten by
any routing policy over N replicas of C.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvreuse.errors import InputFormatError
from kvreuse.index import RadixIndex
from kvreuse.sim.requests import SimRequest
from kvreuse.tokens import TOKEN_BYTES, TokenBuffer

_BLOCK_TOKEN = struct.Struct("<I")


def _int_field(record: dict[str, Any], name: str, where: str, minimum: int) -> int:
    value = record.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputFormatError(f"field {name!r} must be an integer, got {value!r}", where)
    if value < minimum:
        raise InputFormatError(f"field {name!r} must be >= {minimum}, got {value}", where)
    return value


def parse_trace(
    lines: Iterable[str], block_size: int = 512, source: str = "trace"
) -> list[SimRequest]:
    """Requests of a Mooncake JSONL trace, sorted by arrival. Blank lines are skipped."""
    if block_size < 1:
        raise InputFormatError(f"--trace-block-size must be >= 1, got {block_size}")
    pending: list[tuple[float, int, SimRequest]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputFormatError(
                f"not valid JSON ({exc.msg} at column {exc.colno})", where
            ) from None
        if not isinstance(record, dict):
            raise InputFormatError("each line must be a JSON object", where)
        stamp = record.get("timestamp")
        if isinstance(stamp, bool) or not isinstance(stamp, int | float) or stamp < 0:
            raise InputFormatError(
                f"field 'timestamp' must be a number of ms >= 0, got {stamp!r}", where
            )
        input_length = _int_field(record, "input_length", where, 1)
        output_length = _int_field(record, "output_length", where, 0)
        hash_ids = record.get("hash_ids")
        if not isinstance(hash_ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 2**32 for h in hash_ids
        ):
            raise InputFormatError(
                "field 'hash_ids' must be a list of integers in [0, 2**32)", where
            )
        blocks = -(-input_length // block_size)
        if len(hash_ids) != blocks:
            raise InputFormatError(
                f"field 'hash_ids' has {len(hash_ids)} ids but input_length {input_length} "
                f"needs {blocks} blocks of {block_size}; check --trace-block-size",
                where,
            )
        session = record.get("session_id")
        if session is not None and not isinstance(session, str | int):
            raise InputFormatError(
                f"field 'session_id' must be a string or integer, got {session!r}", where
            )
        body = b"".join(_BLOCK_TOKEN.pack(h) * block_size for h in hash_ids)
        tokens = TokenBuffer(body[: input_length * TOKEN_BYTES])
        request = SimRequest(
            request_id=number,
            arrival_s=float(stamp) / 1000.0,
            tokens=tokens,
            prompt_len=input_length,
            output_len=output_length,
            session_id=None if session is None else str(session),
        )
        pending.append((request.arrival_s, number, request))
    pending.sort(key=lambda item: (item[0], item[1]))
    return [item[2] for item in pending]


@dataclass(frozen=True, slots=True)
class Bounds:
    """Upper bounds on the token hit rate of any routing over ``replicas`` × ``cache_tokens``."""

    infinite_hit_rate: float
    pooled_lru_hit_rate: float
    replicas: int
    cache_tokens: int

    def as_dict(self) -> dict[str, float | int]:
        return {
            "infinite_hit_rate": self.infinite_hit_rate,
            "pooled_lru_hit_rate": self.pooled_lru_hit_rate,
            "replicas": self.replicas,
            "cache_tokens": self.cache_tokens,
        }


def _replay_hit_rate(requests: Sequence[SimRequest], cache: RadixIndex) -> float:
    cached = prompt = 0
    for request in requests:
        if not request.measured:
            cache.insert(request.tokens, request.identity, request.arrival_s)
            continue
        cached += cache.match(request.tokens, request.identity, request.arrival_s).length
        prompt += request.prompt_len
        full = request.tokens if request.output is None else request.tokens + request.output
        cache.insert(full, request.identity, request.arrival_s)
    return cached / prompt if prompt else 0.0


def compute_bounds(requests: Sequence[SimRequest], replicas: int, cache_tokens: int) -> Bounds:
    """Both bounds, replaying ``requests`` in arrival order. O(total tokens)."""
    return Bounds(
        infinite_hit_rate=_replay_hit_rate(requests, RadixIndex()),
        pooled_lru_hit_rate=_replay_hit_rate(
            requests, RadixIndex(capacity_tokens=replicas * cache_tokens)
        ),
        replicas=replicas,
        cache_tokens=cache_tokens,
    )
