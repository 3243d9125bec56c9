"""Build a tiny random-weight Llama and its BPE tokenizer, locally, for the real-vLLM tests.

Nothing is downloaded: the weights are drawn from a seeded generator and the tokenizer is a
byte-level BPE trained with ``tokenizers`` on a generated corpus. The output directory is what
``vllm serve`` and ``kvreuse route --tokenizer`` both read: ``config.json``,
``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json`` (with a chat template
whose messages end in a special token, like the templates of real chat models; see
:mod:`kvreuse.testing.tiny_tokenizer`).

Run it with the vLLM environment's Python (it needs ``torch`` and ``transformers``)::

    .venv-vllm/bin/python tests/vllm/build_tiny_model.py build/tiny-llama

A stamp file (``kvreuse-tiny.json``) records the recipe and the tokenizer builder's hash; a
second run with the same recipe does nothing (and imports neither torch nor transformers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

RECIPE = {
    "version": 3,
    "seed": 1234,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 8192,
    "max_position_embeddings": 4096,
    "corpus_lines": 20_000,
}

STAMP = "kvreuse-tiny.json"
SRC = Path(__file__).resolve().parents[2] / "src"
TOKENIZER_SOURCE = SRC / "kvreuse" / "testing" / "tiny_tokenizer.py"


def build_tokenizer(out: Path) -> None:
    # The tokenizer half needs only `tokenizers`; it lives in kvreuse.testing so the gateway's
    # fast tests build the very same one without torch. This script runs in the vLLM
    # environment, where kvreuse is not installed, hence the path.
    sys.path.insert(0, str(SRC))
    from kvreuse.testing.tiny_tokenizer import build_tokenizer_dir

    build_tokenizer_dir(
        out,
        vocab_size=RECIPE["vocab_size"] - 192,  # headroom: the model's vocab is a round 8192
        seed=RECIPE["seed"],
        corpus_lines=RECIPE["corpus_lines"],
        max_length=RECIPE["max_position_embeddings"],
    )


def build_model(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(RECIPE["seed"])
    config = LlamaConfig(
        hidden_size=RECIPE["hidden_size"],
        intermediate_size=RECIPE["intermediate_size"],
        num_hidden_layers=RECIPE["num_hidden_layers"],
        num_attention_heads=RECIPE["num_attention_heads"],
        num_key_value_heads=RECIPE["num_key_value_heads"],
        vocab_size=RECIPE["vocab_size"],
        max_position_embeddings=RECIPE["max_position_embeddings"],
        bos_token_id=1,
        eos_token_id=4,
        pad_token_id=2,
        torch_dtype="float32",
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output directory, e.g. build/tiny-llama")
    args = parser.parse_args(argv)
    out: Path = args.out
    stamp = out / STAMP
    source_hash = hashlib.sha256(TOKENIZER_SOURCE.read_bytes()).hexdigest()
    recipe = {**RECIPE, "tokenizer_source": source_hash}
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        print(f"{out}: up to date")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    build_model(out)
    stamp.write_text(json.dumps(recipe))
    print(f"{out}: built tiny Llama ({RECIPE['num_hidden_layers']} layers, "
          f"hidden {RECIPE['hidden_size']}, vocab {RECIPE['vocab_size']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
