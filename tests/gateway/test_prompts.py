"""Prompt tokens as the engine sees them: template rendering, memoization, approximation."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from kvreuse.errors import InputFormatError
from kvreuse.gateway.prompts import (
    GIL_FREE_CHARS,
    HFPromptTokenizer,
    TextApproximation,
    approximate_tokens,
)
from kvreuse.testing.tiny_tokenizer import corpus_words
from kvreuse.tokens import num_tokens, pack, unpack

WORDS = corpus_words()


def chat(rng: random.Random, turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": " ".join(rng.choices(WORDS, k=40))}]
    for turn in range(turns):
        role = "user" if turn % 2 == 0 else "assistant"
        messages.append({"role": role, "content": " ".join(rng.choices(WORDS, k=20))})
    return messages


@pytest.fixture(scope="module")
def hf(tokenizer_dir: Path) -> HFPromptTokenizer:
    return HFPromptTokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def backend(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def test_chat_renders_like_the_template(hf: HFPromptTokenizer) -> None:
    """The rendering is the template's, generation prompt included by default."""
    text = hf.render([{"role": "user", "content": "hi"}])
    assert text == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_tokens_have_one_bos_completion_gets_the_post_processor_bos(
    hf: HFPromptTokenizer, backend: Tokenizer
) -> None:
    """vLLM: chats are encoded without special tokens (the template has BOS), completions with."""
    ids = unpack(hf.chat([{"role": "user", "content": "hi"}]))
    assert ids[0] == 1 and ids.count(1) == 1
    assert unpack(hf.completion("hello")) == backend.encode("hello", add_special_tokens=True).ids


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 12))
def test_memoized_encoding_equals_whole_text_encoding(seed: int, turns: int) -> None:
    """Property: encoding piecewise at special tokens, through the memo, gives the very ids
    tokenizers gives for the whole rendered text."""
    hf, backend = _HF, _BACKEND
    rng = random.Random(seed)
    messages = chat(rng, turns)
    if rng.random() < 0.3:  # special-token text inside a message must still split the same way
        messages[-1]["content"] += " <|im_end|>tail"
    text = hf.render(messages)
    assert unpack(hf.chat(messages)) == backend.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("turns", [0, 3])
def test_texts_past_the_gil_free_length_encode_to_the_same_ids(
        hf: HFPromptTokenizer, backend: Tokenizer, turns: int) -> None:
    """A chat whose message (a memo piece) or a completion longer than GIL_FREE_CHARS, encoded
    without the GIL, gives the ids of tokenizers' plain encode of the whole text."""
    rng = random.Random(turns)
    long_text = " ".join(rng.choices(WORDS, k=GIL_FREE_CHARS // 3))
    assert len(long_text) > GIL_FREE_CHARS
    messages = [*chat(rng, turns), {"role": "user", "content": long_text}]
    assert unpack(hf.chat(messages)) == backend.encode(hf.render(messages),
                                                       add_special_tokens=False).ids
    assert unpack(hf.completion(long_text)) == backend.encode(long_text,
                                                              add_special_tokens=True).ids


def test_seen_history_is_served_from_the_memo(hf: HFPromptTokenizer) -> None:
    """The next turn of a seen chat encodes only the new message's pieces."""
    rng = random.Random(5)
    messages = chat(rng, 6)
    hf.chat(messages)
    misses = hf.memo_misses
    messages.append({"role": "user", "content": "a brand new question"})
    hf.chat(messages)
    assert hf.memo_misses - misses <= 3  # the new content and the generation prompt's tail


def test_continue_final_message_cuts_after_its_text(hf: HFPromptTokenizer) -> None:
    """continue_final_message renders the last message open-ended, as transformers does."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    text = hf.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHel")


def test_content_parts_are_joined_with_newlines(hf: HFPromptTokenizer) -> None:
    """Text parts of a content array render as one string joined by newlines (vLLM)."""
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}},
             {"type": "text", "text": "b"}]
    assert "a\nb<|im_end|>" in hf.render([{"role": "user", "content": parts}])


def test_template_kwargs_override_the_request_fields_as_vllm(hf: HFPromptTokenizer) -> None:
    """chat_template_kwargs may set add_generation_prompt, tools or documents (vLLM merges them
    over the request's); they used to collide with the gateway's own and raise a TypeError."""
    messages = [{"role": "user", "content": "hi"}]
    text = hf.render(messages, template_kwargs={"add_generation_prompt": False})
    assert text == hf.render(messages, add_generation_prompt=False)
    hf.render(messages, template_kwargs={"tools": [], "documents": []})


@pytest.mark.parametrize("kwargs", [{"messages": []}, {"tools": 5}, {"documents": "text"}])
def test_template_kwargs_that_cannot_render_are_input_errors(
        hf: HFPromptTokenizer, kwargs: dict[str, object]) -> None:
    """messages in chat_template_kwargs, tools or documents that are not arrays: an input error
    naming the field (a 400), not a TypeError (a 500)."""
    with pytest.raises(InputFormatError, match=r"chat_template_kwargs|tools|documents"):
        hf.render([{"role": "user", "content": "hi"}], template_kwargs=kwargs)


def test_bad_content_names_the_field(hf: HFPromptTokenizer) -> None:
    """A content part that is not an object is refused with its path."""
    with pytest.raises(InputFormatError, match=r"messages\[0\]\.content\[0\]"):
        hf.chat([{"role": "user", "content": ["oops"]}])


def test_approximation_is_four_bytes_per_token() -> None:
    """The documented approximation: ceil(bytes / 4) tokens, ids are the bytes themselves."""
    assert num_tokens(approximate_tokens("abcdefghi")) == 3
    assert unpack(approximate_tokens("abcd")) == [int.from_bytes(b"abcd", "little")]
    assert num_tokens(approximate_tokens("é" * 4)) == 2


@given(st.text(max_size=60), st.text(max_size=60))
def test_approximation_keeps_text_prefixes_as_token_prefixes(a: str, b: str) -> None:
    """Property: a text prefix gives a token prefix, except its last partial token."""
    whole, head = approximate_tokens(a + b), approximate_tokens(a)
    full_head = len(a.encode()) // 4 * 4
    assert whole[:full_head] == head[:full_head]


def test_approximate_chats_share_their_history() -> None:
    """Turn n+1's approximate tokens start with turn n's prompt and answer."""
    approx = TextApproximation()
    first = [{"role": "user", "content": "hello there"}]
    second = [*first, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]
    one = approx.chat(first, add_generation_prompt=False)
    two = approx.chat(second)
    assert two.startswith(one[: len(one) - len(one) % 16])


_HF: HFPromptTokenizer
_BACKEND: Tokenizer


@pytest.fixture(autouse=True, scope="module")
def _bind_module_tokenizers(hf: HFPromptTokenizer, backend: Tokenizer) -> None:
    # hypothesis tests cannot take function-scoped fixtures; module globals carry them.
    global _HF, _BACKEND
    _HF, _BACKEND = hf, backend


def test_memo_turns_itself_off_when_pieces_would_differ(tmp_path: Path) -> None:
    """A Metaspace tokenizer that prepends only at the text's start cannot be encoded
    piecewise: the memo is disabled and encoding stays exact."""
    import json

    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "<|im_end|>"],
                                  show_progress=False)
    tok.train_from_iterator([" ".join(WORDS[:200])] * 3, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    metaspace = HFPromptTokenizer(tmp_path)
    text = "hello<|im_end|> world"
    assert not metaspace.memoized
    assert unpack(metaspace.completion(text)) == tok.encode(text).ids


def test_memo_is_bounded_in_bytes(tokenizer_dir: Path) -> None:
    """Unique long prompts cannot grow the memo past its byte budget; encoding stays exact."""
    hf = HFPromptTokenizer(tokenizer_dir, memo_bytes=200_000)
    for i in range(200):
        text = f"document {i} " + "lorem ipsum dolor sit amet " * 40
        assert hf.encode(text) == pack(hf._backend.encode(text, add_special_tokens=False).ids)
        hf.check_invariants()
    assert len(hf._memo) < 200


def test_threads_sharing_the_memo_get_exact_ids(tokenizer_dir: Path) -> None:
    """Seeded stress: four threads encoding chats that share messages through one small memo
    (evicting as they go) each get tokenizers' ids for the whole text; the memo stays whole."""
    import threading

    hf = HFPromptTokenizer(tokenizer_dir, memo_entries=8)
    backend = hf._backend
    shared = [" ".join(random.Random(i).choices(WORDS, k=3)) for i in range(12)]
    failures: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            messages = [{"role": rng.choice(["user", "assistant"]), "content": rng.choice(shared)}
                        for _ in range(rng.randint(1, 6))]
            expected = backend.encode(hf.render(messages), add_special_tokens=False).ids
            try:
                if unpack(hf.chat(messages)) != expected:
                    failures.append(f"seed {seed}: wrong ids for {messages}")
            except Exception as exc:  # a race in the memo shows as KeyError and the like
                failures.append(f"seed {seed}: {exc!r}")

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as CPython allows: races show
    try:
        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert not failures, failures[:2]
    hf.check_invariants()
