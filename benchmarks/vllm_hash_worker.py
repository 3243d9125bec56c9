"""Time vLLM's own ``hash_block_tokens`` on token ids handed over by benchmarks/index_ops.py.

Runs under vLLM's interpreter (``$KVREUSE_VLLM_PYTHON``), never under kvreuse's venv: vLLM needs
torch. Usage::

    python vllm_hash_worker.py TOKENS_FILE LENGTHS_JSON BLOCK_SIZE

``TOKENS_FILE`` holds every prompt's token ids back to back as little-endian uint32,
``LENGTHS_JSON`` the prompt lengths. Once loaded it prints ``{"ready": ..., "vllm": version}``,
then reads one vLLM hash algorithm name per line from stdin and answers each with one JSON line
(the summed ns, the block count, a sha256 over all hashes in order, NONE_HASH) until stdin
closes, so the caller can interleave its own timings with vLLM's under the same machine load.
Every prompt's full blocks are hashed the way vLLM's request block hasher does: a loop of
``hash_block_tokens`` over slices of a plain list, the parent chained from NONE_HASH, which
``init_none_hash`` seeds from PYTHONHASHSEED (the caller sets it).
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import time
from array import array


def main() -> int:
    tokens_file, lengths_file, block_size_arg = sys.argv[1:4]
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    import vllm

    block_size = int(block_size_arg)
    flat = array("I")
    with open(tokens_file, "rb") as src:
        flat.frombytes(src.read())
    if sys.byteorder != "little":
        flat.byteswap()
    prompts = []
    pos = 0
    with open(lengths_file) as src:
        for length in json.load(src):
            prompts.append(flat[pos : pos + length])
            pos += length
    print(json.dumps({"ready": len(prompts), "vllm": vllm.__version__}), flush=True)

    clock = time.perf_counter_ns
    for line in sys.stdin:
        name = line.strip()
        hash_fn = get_hash_fn_by_name(name)
        init_none_hash(hash_fn)
        total_ns = blocks = 0
        digest = hashlib.sha256()
        gc.collect()
        gc.disable()
        for prompt in prompts:
            token_ids = prompt.tolist()  # a request's all_token_ids is a plain list
            end = len(token_ids) - len(token_ids) % block_size
            chain = []
            parent = None
            t0 = clock()
            for start in range(0, end, block_size):
                parent = hash_block_tokens(
                    hash_fn, parent, token_ids[start : start + block_size], None
                )
                chain.append(parent)
            total_ns += clock() - t0
            blocks += len(chain)
            for block_hash in chain:
                digest.update(block_hash)
        gc.enable()
        result = {
            "algorithm": name,
            "ns": total_ns,
            "blocks": blocks,
            "digest": digest.hexdigest(),
            "none_hash": kv_cache_utils.NONE_HASH.hex(),
        }
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
