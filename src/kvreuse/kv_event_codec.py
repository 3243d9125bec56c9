"""vLLM's KV-event wire format: decode what an engine publishes, encode what ``kvreuse engine``
publishes.

A ZeroMQ PUB message has three frames: the topic, an 8-byte big-endian sequence number, and a
msgpack payload ``[ts, events, data_parallel_rank]`` (vLLM's ``EventBatch`` is ``array_like``;
``data_parallel_rank`` may be omitted). Each event comes in one of two shapes:

* **map** (vLLM >= 0.25): ``{"type": "BlockStored", "block_hashes": [...], ...}``;
* **array** (vLLM <= 0.15, ``array_like`` tagged structs): ``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys, ...]``,
  ``["BlockRemoved", block_hashes, medium, ...]``, ``["AllBlocksCleared"]``; trailing fields with
  default values are left out.

Hashes are 64-bit integers (vLLM's default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or the full
hash bytes. Both are normalised to :data:`~kvreuse.index.hashing.BlockHash` bytes (an integer
becomes its 8 big-endian bytes), the form :mod:`kvreuse.index.events` uses, so the decoded events
are the very dataclasses a :class:`~kvreuse.index.BlockIndex` emits.

A malformed event never raises out of :func:`decode_message`: it is skipped and described in
``EventBatch.malformed`` (the caller counts and reports it); the other events of the batch are
kept. A malformed frame or payload raises :class:`~kvreuse.errors.InputFormatError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.index.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvreuse.index.hashing import BlockHash, block_hash_to_int

SHAPES = ("map", "array")
"""Event encodings: ``map`` is vLLM >= 0.25, ``array`` is vLLM <= 0.15."""

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame vLLM's replay socket sends after the last replayed batch."""

_U64 = (1 << 64) - 1
_STORED_FIELDS: tuple[str, ...] = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
)
_REMOVED_FIELDS: tuple[str, ...] = ("block_hashes", "medium")
_REQUIRED_FIELDS = {"BlockStored": 7, "BlockRemoved": 2}
_decoder = msgspec.msgpack.Decoder()
_encoder = msgspec.msgpack.Encoder()


class MalformedBatch(InputFormatError):
    """A frame or payload that cannot be a batch; ``reason`` is its metric label."""

    def __init__(self, reason: str, message: str, where: str | None = None) -> None:
        self.reason = reason
        super().__init__(message, where)


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message: its sequence number, the engine's timestamp, the events that
    decoded, and a description of each event that did not."""

    seq: int
    ts: float
    events: tuple[KVCacheEvent, ...]
    dp_rank: int | None = None
    malformed: tuple[str, ...] = ()


def normalize_hash(value: object, where: str) -> BlockHash:
    """A wire hash (int or bytes) as :data:`BlockHash` bytes. Negative ints (a signed-i64
    producer) are taken modulo 2**64."""
    if isinstance(value, bool):
        raise InputFormatError(
            f"a block hash must be an integer or bytes, got {value!r:.80}", where
        )
    if isinstance(value, int):
        return BlockHash((value & _U64).to_bytes(8, "big"))
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        if not raw:
            raise InputFormatError("a block hash must not be empty", where)
        return BlockHash(raw)
    raise InputFormatError(
        f"a block hash must be an integer or bytes, got {type(value).__name__}", where
    )


def decode_message(frames: Sequence[bytes]) -> EventBatch:
    """Decode ``[topic, seq, payload]``. Raises :class:`InputFormatError` when the frames or the
    payload are unusable; bad events inside a good payload are reported, not raised. O(events)."""
    if len(frames) != 3:
        raise MalformedBatch("bad_frames",
                             f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    _, seq_frame, payload = frames
    if len(seq_frame) != 8:
        raise MalformedBatch("bad_frames",
                             f"the sequence frame must be 8 bytes, got {len(seq_frame)}")
    seq = int.from_bytes(seq_frame, "big", signed=True)
    return decode_payload(payload, seq)


def decode_payload(payload: bytes, seq: int) -> EventBatch:
    """Decode one msgpack ``EventBatch`` payload published with sequence number ``seq``."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise MalformedBatch("not_msgpack", f"payload is not msgpack: {exc}", f"seq {seq}"
                             ) from None
    except RecursionError:
        # msgspec recurses once per nesting level: [[[...]]] 100,000 deep exhausts the stack.
        raise MalformedBatch("too_deep", "payload nests deeper than the decoder allows",
                             f"seq {seq}") from None
    if not isinstance(raw, list) or len(raw) not in (2, 3):
        raise MalformedBatch(
            "bad_payload", "payload must be an array [ts, events, data_parallel_rank]",
            f"seq {seq}"
        )
    ts, events = raw[0], raw[1]
    dp_rank = raw[2] if len(raw) == 3 else None
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise MalformedBatch("bad_payload", f"ts must be a number, got {ts!r:.80}", f"seq {seq}")
    if not isinstance(events, list):
        raise MalformedBatch("bad_payload", "events must be an array", f"seq {seq}")
    if dp_rank is not None and not isinstance(dp_rank, int):
        raise MalformedBatch("bad_payload",
                             f"data_parallel_rank must be an integer, got {dp_rank!r:.80}")
    decoded: list[KVCacheEvent] = []
    malformed: list[str] = []
    for index, event in enumerate(events):
        where = f"seq {seq} event {index}"
        try:
            decoded.append(decode_event(event, where))
        except InputFormatError as exc:
            malformed.append(str(exc))
    return EventBatch(seq, float(ts), tuple(decoded), dp_rank, tuple(malformed))


def decode_event(raw: object, where: str = "event") -> KVCacheEvent:
    """One event in either shape. Raises :class:`InputFormatError` naming the bad field."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        names = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(
            kind if isinstance(kind, str) else "", ()
        )
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise InputFormatError("an event must be a map with 'type' or a tagged array", where)
    parser = _PARSERS.get(kind) if isinstance(kind, str) else None
    if parser is None:
        raise InputFormatError(f"unknown event type {kind!r:.80}", where)
    return parser(fields, f"{where} ({kind})")


def _hashes(fields: dict[str, Any], where: str) -> tuple[BlockHash, ...]:
    hashes = fields.get("block_hashes")
    if not isinstance(hashes, list) or not hashes:
        raise InputFormatError("block_hashes must be a non-empty array", where)
    return tuple(normalize_hash(h, f"{where} block_hashes[{i}]") for i, h in enumerate(hashes))


def _optional_str(fields: dict[str, Any], name: str, where: str) -> str | None:
    value = fields.get(name)
    if value is not None and not isinstance(value, str):
        raise InputFormatError(f"{name} must be a string or null, got {value!r:.80}", where)
    return value


def _parse_stored(fields: dict[str, Any], where: str) -> BlockStored:
    hashes = _hashes(fields, where)
    parent_raw = fields.get("parent_block_hash")
    parent = None if parent_raw is None else normalize_hash(parent_raw, f"{where} parent")
    tokens = fields.get("token_ids")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in tokens
    ):
        raise InputFormatError("token_ids must be an array of token ids (uint32)", where)
    block_size = fields.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise InputFormatError(
            f"block_size must be a positive integer, got {block_size!r:.80}", where
        )
    if len(tokens) != len(hashes) * block_size and len(hashes) != 1:
        raise InputFormatError(
            f"{len(tokens)} token_ids do not fill {len(hashes)} blocks of {block_size}", where
        )
    extra = fields.get("extra_keys")
    if extra is not None and (
        not isinstance(extra, list)
        or len(extra) != len(hashes)
        or not all(e is None or isinstance(e, list | tuple) for e in extra)
    ):
        raise InputFormatError("extra_keys must be null or one array/null per block", where)
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tuple(tokens),
        block_size=block_size,
        lora_name=_optional_str(fields, "lora_name", where),
        extra_keys=None if extra is None else tuple(None if e is None else tuple(e) for e in extra),
        medium=_optional_str(fields, "medium", where) or "GPU",
    )


def _parse_removed(fields: dict[str, Any], where: str) -> BlockRemoved:
    return BlockRemoved(
        _hashes(fields, where), medium=_optional_str(fields, "medium", where) or "GPU"
    )


def _parse_cleared(fields: dict[str, Any], where: str) -> AllBlocksCleared:
    return AllBlocksCleared()


_PARSERS: dict[str, Callable[[dict[str, Any], str], KVCacheEvent]] = {
    "BlockStored": _parse_stored,
    "BlockRemoved": _parse_removed,
    "AllBlocksCleared": _parse_cleared,
}


# ---------------------------------------------------------------------------------- encoding


def _wire_hash(block_hash: BlockHash, int_hashes: bool) -> int | bytes:
    return block_hash_to_int(block_hash) if int_hashes else bytes(block_hash)


def encode_event(event: KVCacheEvent, *, shape: str = "map", int_hashes: bool = True) -> object:
    """One event as vLLM would serialise it, before msgpack. ``shape`` is ``map`` or ``array``."""
    if shape not in SHAPES:
        raise ConfigError(f"event shape must be one of {SHAPES}, got {shape!r}")
    if isinstance(event, BlockStored):
        kind = "BlockStored"
        parent = event.parent_block_hash
        values: list[object] = [
            [_wire_hash(h, int_hashes) for h in event.block_hashes],
            None if parent is None else _wire_hash(parent, int_hashes),
            list(event.token_ids),
            event.block_size,
            None,
            event.medium,
            event.lora_name,
            None if event.extra_keys is None else [
                None if e is None else list(e) for e in event.extra_keys
            ],
        ]
        names = _STORED_FIELDS
    elif isinstance(event, BlockRemoved):
        kind = "BlockRemoved"
        values = [[_wire_hash(h, int_hashes) for h in event.block_hashes], event.medium]
        names = _REMOVED_FIELDS
    else:
        assert isinstance(event, AllBlocksCleared), f"unknown event {event!r}"
        kind, values, names = "AllBlocksCleared", [], ()
    if shape == "array":
        # omit_defaults: vLLM drops trailing fields declared with a default (extra_keys=None).
        while len(values) > _REQUIRED_FIELDS.get(kind, 0) and values[-1] is None:
            values.pop()
        return [kind, *values]
    return {"type": kind, **dict(zip(names, values, strict=True))}


def encode_payload(
    events: Sequence[KVCacheEvent],
    *,
    ts: float,
    dp_rank: int | None = 0,
    shape: str = "map",
    int_hashes: bool = True,
) -> bytes:
    """An ``EventBatch`` payload (msgpack) as vLLM's publisher sends it."""
    body = [encode_event(e, shape=shape, int_hashes=int_hashes) for e in events]
    batch: list[object] = [ts, body] if dp_rank is None else [ts, body, dp_rank]
    return _encoder.encode(batch)


def encode_message(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """The three frames of one published batch."""
    return [topic.encode(), seq.to_bytes(8, "big"), payload]
