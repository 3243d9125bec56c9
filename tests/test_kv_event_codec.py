"""The KV-event codec: both event shapes, both hash forms, malformed input reported."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.index.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvreuse.index.hashing import BlockHash
from kvreuse.kv_event_codec import (
    decode_event,
    decode_message,
    encode_event,
    encode_message,
    encode_payload,
    normalize_hash,
)

H1 = BlockHash(bytes(range(32)))
H2 = BlockHash(bytes(range(1, 33)))


def stored(**overrides: object) -> BlockStored:
    fields: dict[str, object] = {
        "block_hashes": (BlockHash((7).to_bytes(8, "big")), BlockHash((9).to_bytes(8, "big"))),
        "parent_block_hash": None,
        "token_ids": tuple(range(8)),
        "block_size": 4,
        "extra_keys": (("salt-a",), None),
    }
    fields.update(overrides)
    return BlockStored(**fields)  # type: ignore[arg-type]


def pack(batch: list[object]) -> bytes:
    return msgspec.msgpack.encode(batch)


def test_map_shape_round_trips() -> None:
    """An event encoded in vLLM >= 0.25's map shape decodes to the same dataclass."""
    event = stored()
    payload = encode_payload([event, BlockRemoved(event.block_hashes[1:]), AllBlocksCleared()],
                             ts=12.5, shape="map")
    batch = decode_message(encode_message("kv", 3, payload))
    assert batch.seq == 3 and batch.ts == 12.5 and batch.dp_rank == 0
    assert batch.events == (event, BlockRemoved(event.block_hashes[1:]), AllBlocksCleared())
    assert batch.malformed == ()


def test_array_shape_round_trips() -> None:
    """The same events in vLLM <= 0.15's tagged-array shape decode identically."""
    event = stored()
    payload = encode_payload([event, AllBlocksCleared()], ts=1.0, shape="array")
    assert decode_message(encode_message("", 0, payload)).events == (event, AllBlocksCleared())


def test_array_shape_drops_only_defaulted_trailing_fields() -> None:
    """omit_defaults keeps vLLM's required fields (lora_id, medium, lora_name) in arrays."""
    encoded = encode_event(stored(extra_keys=None), shape="array")
    assert isinstance(encoded, list)
    assert encoded[0] == "BlockStored" and len(encoded) == 8 and encoded[-1] is None


def test_legacy_five_field_array_decodes() -> None:
    """vLLM 0.9's BlockStored (no medium, no lora_name) still decodes, as GPU blocks."""
    raw = ["BlockStored", [1, 2], None, [5, 6, 7, 8], 2, None]
    event = decode_event(raw)
    assert isinstance(event, BlockStored)
    assert event.block_hashes == (normalize_hash(1, ""), normalize_hash(2, ""))
    assert event.medium == "GPU" and event.token_ids == (5, 6, 7, 8)


def test_bytes_hashes_are_kept_whole() -> None:
    """Full-hash bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) survive encode and decode."""
    event = stored(block_hashes=(H1, H2), parent_block_hash=None)
    payload = encode_payload([event], ts=0.0, int_hashes=False)
    decoded = decode_message(encode_message("", 0, payload)).events[0]
    assert isinstance(decoded, BlockStored) and decoded.block_hashes == (H1, H2)


def test_int_hashes_are_the_low_64_bits_big_endian() -> None:
    """An integer hash becomes its 8 big-endian bytes; negative (signed) ints wrap."""
    assert normalize_hash(2**64 - 1, "") == b"\xff" * 8
    assert normalize_hash(-1, "") == b"\xff" * 8
    assert normalize_hash(258, "") == (258).to_bytes(8, "big")


@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=6), st.sampled_from(["map",
                                                                                     "array"]))
def test_any_int_hash_chain_round_trips(hashes: list[int], shape: str) -> None:
    """Property: any 64-bit hash chain survives the wire in either shape."""
    event = stored(block_hashes=tuple(normalize_hash(h, "") for h in hashes),
                   token_ids=tuple(range(4 * len(hashes))), extra_keys=None)
    payload = encode_payload([event], ts=0.0, shape=shape)
    assert decode_message(encode_message("", 1, payload)).events == (event,)


def test_malformed_events_are_reported_and_the_rest_kept() -> None:
    """Bad events are described (naming the field) while good ones in the batch decode."""
    good = encode_event(AllBlocksCleared())
    payload = pack([0.0, [
        {"type": "BlockStored", "block_hashes": [], "parent_block_hash": None,
         "token_ids": [1], "block_size": 1},
        {"type": "Mystery"},
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [-3], "block_size": 1},
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
         "token_ids": [1, 2, 3], "block_size": 2},
        {"type": "BlockRemoved", "block_hashes": ["x"]},
        42,
        good,
    ], 0])
    batch = decode_message([b"t", (5).to_bytes(8, "big"), payload])
    assert batch.events == (AllBlocksCleared(),)
    assert len(batch.malformed) == 6
    joined = "\n".join(batch.malformed)
    for needle in ("block_hashes", "Mystery", "token_ids", "do not fill", "block hash",
                   "tagged array"):
        assert needle in joined, needle


@pytest.mark.parametrize(
    ("frames", "needle"),
    [
        ([b"t", b"\0" * 8], "3 frames"),
        ([b"t", b"\0" * 4, b""], "8 bytes"),
        ([b"t", b"\0" * 8, b"\xc1"], "msgpack"),
        ([b"t", b"\0" * 8, msgspec.msgpack.encode({"a": 1})], "payload must be an array"),
        ([b"t", b"\0" * 8, msgspec.msgpack.encode(["x", []])], "ts must be a number"),
        ([b"t", b"\0" * 8, msgspec.msgpack.encode([1.0, {}])], "events must be an array"),
    ],
)
def test_malformed_frames_raise_input_format_error(frames: list[bytes], needle: str) -> None:
    """A message that cannot be a batch raises InputFormatError saying why."""
    with pytest.raises(InputFormatError, match=needle):
        decode_message(frames)


def test_unknown_shape_is_a_config_error() -> None:
    """Encoding in a shape vLLM never used is refused by name."""
    with pytest.raises(ConfigError, match="shape"):
        encode_event(AllBlocksCleared(), shape="json")
