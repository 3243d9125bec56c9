"""Record a random request flow through vLLM's own ``BlockPool`` (run by
``generate_vllm_vectors.py`` under the vLLM venv; see its docstring for the command).

Each step mirrors what vLLM's scheduler and ``KVCacheManager`` do for one request: admission
(``get_computed_blocks`` with the ``num_tokens - 1`` cap, then ``allocate_slots``: touch the hit
blocks, take new ones, ``cache_full_blocks``), a decode token (one more slot, cache the block it
fills), finish (``free_blocks`` tail first), connector eviction (``evict_blocks``) and
``reset_prefix_cache``. After every step the trace holds the free queue (block ids, head first)
and the KV events vLLM queued, with hashes in the 64-bit form vLLM publishes by default.
"""

from __future__ import annotations

import random
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.request import Request

NUM_BLOCKS = 16
BLOCK_SIZE = 4
LORA_PATHS = {"sql": "/adapters/sql"}
IDENTITIES: list[dict[str, Any]] = [{}, {}, {}, {"cache_salt": "tenant-a"}, {"lora": "sql"}]


def event_json(event: Any) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "stored",
            "hashes": list(event.block_hashes),
            "parent": event.parent_block_hash,
            "tokens": list(event.token_ids),
            "block_size": event.block_size,
            "lora_name": event.lora_name,
            "extra_keys": [None if k is None else list(k) for k in event.extra_keys or []],
        }
    if isinstance(event, BlockRemoved):
        return {"type": "removed", "hashes": list(event.block_hashes)}
    assert isinstance(event, AllBlocksCleared)
    return {"type": "cleared"}


def record_trace(seed: int, steps: int) -> dict[str, Any]:
    """Run ``steps`` random operations with sha256 (fixed NONE_HASH seed) and record them."""
    hash_fn = get_hash_fn_by_name("sha256")
    kcu.init_none_hash(hash_fn)
    hasher = kcu.get_request_block_hasher(BLOCK_SIZE, hash_fn)
    pool = BlockPool(
        NUM_BLOCKS, enable_caching=True, hash_block_size=BLOCK_SIZE, enable_kv_cache_events=True
    )
    rng = random.Random(seed)
    stems = [[rng.randrange(5) for _ in range(rng.randint(8, 16))] for _ in range(3)]
    running: dict[int, tuple[Request, list[Any]]] = {}
    trace: list[dict[str, Any]] = []
    for rid in range(steps):
        roll = rng.random()
        step: dict[str, Any]
        if roll < 0.35:
            stem = rng.choice(stems)
            cut = len(stem) if rng.random() < 0.7 else rng.randint(0, len(stem))
            tokens = [*stem[:cut], *(rng.randrange(5) for _ in range(rng.randint(1, 9)))]
            ident = rng.choice(IDENTITIES)
            lora = ident.get("lora")
            request = Request(
                request_id=str(rid),
                prompt_token_ids=tokens,
                sampling_params=SamplingParams(max_tokens=1),
                pooling_params=None,
                lora_request=LoRARequest(lora, 1, LORA_PATHS[lora]) if lora else None,
                cache_salt=ident.get("cache_salt"),
                block_hasher=hasher,
            )
            computed = []
            for block_hash in request.block_hashes[: (len(tokens) - 1) // BLOCK_SIZE]:
                cached = pool.get_cached_block(block_hash, [0])
                if not cached:
                    break
                computed.append(cached[0])
            need = -(-len(tokens) // BLOCK_SIZE) - len(computed)
            taken_by_hit = sum(1 for block in computed if block.ref_cnt == 0)
            step = {
                "op": "admit",
                "rid": rid,
                "tokens": tokens,
                "identity": ident,
                "hit_blocks": [b.block_id for b in computed],
            }
            if need + taken_by_hit > pool.get_num_free_blocks():
                step["new_blocks"] = None
            else:
                pool.touch(computed)
                new = pool.get_new_blocks(need)
                blocks = computed + new
                pool.cache_full_blocks(
                    request, blocks, len(computed), len(tokens) // BLOCK_SIZE, BLOCK_SIZE, 0
                )
                running[rid] = (request, blocks)
                step["new_blocks"] = [b.block_id for b in new]
        elif roll < 0.55 and running:
            target = rng.choice(sorted(running))
            request, blocks = running[target]
            token = rng.randrange(5)
            step = {"op": "append", "rid": target, "token": token}
            grows = -(-(request.num_tokens + 1) // BLOCK_SIZE) > len(blocks)
            if grows and pool.get_num_free_blocks() == 0:
                step["new_blocks"] = None
            else:
                num_cached = request.num_tokens // BLOCK_SIZE
                request.append_output_token_ids(token)
                new = pool.get_new_blocks(1) if grows else []
                blocks.extend(new)
                pool.cache_full_blocks(
                    request, blocks, num_cached, request.num_tokens // BLOCK_SIZE, BLOCK_SIZE, 0
                )
                step["new_blocks"] = [b.block_id for b in new]
        elif roll < 0.93 and running:
            target = rng.choice(sorted(running))
            _, blocks = running.pop(target)
            pool.free_blocks(reversed(blocks))
            step = {"op": "free", "rid": target}
        elif roll < 0.97:
            victim = rng.randrange(1, NUM_BLOCKS)
            pool.evict_blocks({victim})
            step = {"op": "evict_blocks", "block_id": victim}
        else:
            step = {"op": "reset", "ok": pool.reset_prefix_cache()}
        step["queue"] = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        step["events"] = [event_json(e) for e in pool.take_events()]
        trace.append(step)
    return {
        "seed": seed,
        "num_blocks": NUM_BLOCKS,
        "block_size": BLOCK_SIZE,
        "lora_paths": LORA_PATHS,
        "steps": trace,
    }
