"""A small byte-level BPE tokenizer directory with a chat template, built locally and seeded.

Used by the gateway's fast tests, its benchmark and (with random weights beside it) by the
real-vLLM tests, so no test ever downloads a tokenizer. Needs only the ``tokenizers`` package.
The directory holds ``tokenizer.json`` and a ``tokenizer_config.json`` in the form transformers
saves (``PreTrainedTokenizerFast``, named special tokens, ``chat_template``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID, PAD_ID = 1, 4, 2

# Every message ends with <|im_end|>, a special token, like the templates of real chat models:
# the gateway memoizes tokenization at these boundaries.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def generated_corpus(seed: int, lines: int) -> list[str]:
    """Deterministic pseudo-English: made-up words, digits and punctuation, so BPE learns real
    merges and test prompts tokenize into realistic numbers of tokens."""
    rng = random.Random(seed)
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    lexicon = [
        "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(1, 4)))
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


def corpus_words(seed: int = 1234) -> list[str]:
    """Words of the training corpus, to build test prompts that tokenize like real text."""
    return sorted({w for line in generated_corpus(seed, 200) for w in line[:-1].split()})


def build_tokenizer_dir(
    out: Path, *, vocab_size: int = 8000, seed: int = 1234, corpus_lines: int = 20_000,
    max_length: int = 4096,
) -> Path:
    """Train and save the tokenizer into ``out`` (created); returns ``out``. ~5 s."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(generated_corpus(seed, corpus_lines), trainer)
    assert tok.token_to_id("<s>") == BOS_ID and tok.token_to_id("<|im_end|>") == EOS_ID
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out
