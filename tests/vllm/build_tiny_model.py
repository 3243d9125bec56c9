"""Build a tiny random-weight Llama and its BPE tokenizer, locally, for the real-vLLM tests.

Nothing is downloaded: the weights are drawn from a seeded generator and the tokenizer is a
byte-level BPE trained with ``tokenizers`` on a generated corpus. The output directory is what
``vllm serve`` and ``kvreuse route --tokenizer`` both read: ``config.json``,
``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json`` (with a chat template
whose messages end in a special token, like the templates of real chat models).

Run it with the vLLM environment's Python (it needs ``torch`` and ``transformers``)::

    .venv-vllm/bin/python tests/vllm/build_tiny_model.py build/tiny-llama

A stamp file (``kvreuse-tiny.json``) records the recipe version; a second run with the same
recipe does nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

RECIPE = {
    "version": 2,
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

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

# Every message ends with <|im_end|>, a special token: the gateway memoizes tokenization at
# these boundaries, exactly as it would with a real chat model's template.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

STAMP = "kvreuse-tiny.json"


def generated_corpus(seed: int, lines: int) -> list[str]:
    """Deterministic pseudo-English: a fixed lexicon of made-up words, digits and punctuation,
    so BPE learns real merges and any test prompt tokenizes into a realistic number of tokens."""
    rng = random.Random(seed)
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    lexicon = [
        "".join(
            rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(1, 4))
        )
        for _ in range(3000)
    ]
    lexicon += ["the", "a", "of", "to", "and", "is", "user", "assistant", "system", "contract"]
    corpus = []
    for _ in range(lines):
        words = [rng.choice(lexicon) for _ in range(rng.randint(4, 24))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        corpus.append(" ".join(words) + rng.choice([".", "?", "!", ",", ":"]))
    return corpus


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=RECIPE["vocab_size"] - 192,  # headroom: the model's vocab is a round 8192
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(generated_corpus(RECIPE["seed"], RECIPE["corpus_lines"]), trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        pad_token="</s>",
        model_max_length=RECIPE["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    # save_pretrained may keep the template in a side file; tokenizer_config.json must hold it.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    (out / "chat_template.jinja").unlink(missing_ok=True)


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
    if stamp.exists() and json.loads(stamp.read_text()) == RECIPE:
        print(f"{out}: up to date")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    build_model(out)
    stamp.write_text(json.dumps(RECIPE))
    print(f"{out}: built tiny Llama ({RECIPE['num_hidden_layers']} layers, "
          f"hidden {RECIPE['hidden_size']}, vocab {RECIPE['vocab_size']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
