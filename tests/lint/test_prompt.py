"""Requests to prompts: rendering options and where the variable tail starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.lint.prompt import build_prompt, render_request
from kvreuse.tokenizers import load_tokenizer
from kvreuse.tokenizers.chat_template import ChatTemplate

TEMPLATES = Path(__file__).parents[1] / "data" / "templates"
QWEN = ChatTemplate((TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text())
TOKENIZER = load_tokenizer("cl100k_base").tokenizer


def test_stable_end_is_the_last_user_contents_start_even_for_short_text() -> None:
    """A one-letter question is located by a marker render, not by searching for 'a'."""
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "a"}]}
    prompt = build_prompt(body, tokenizer=TOKENIZER, template=QWEN, label="x")
    assert prompt.stable_end is not None
    assert prompt.text[: prompt.stable_end].endswith("<|im_start|>user\n")
    assert prompt.text[prompt.stable_end :].startswith("a<|im_end|>")


def test_content_parts_are_marked_in_their_text_part() -> None:
    """Multimodal-style content lists: the first text part marks the tail."""
    template = ChatTemplate(
        "{% for m in messages %}[{{ m.role }}]{% for p in m.content %}{{ p.text }}{% endfor %}"
        "{% endfor %}"
    )
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    prompt = build_prompt(body, tokenizer=TOKENIZER, template=template, label="x")
    assert prompt.stable_end == len("[user]")


def test_generation_prompt_defaults_on_and_can_be_switched_off() -> None:
    """add_generation_prompt defaults to true as on vLLM's chat endpoint."""
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert render_request(body, QWEN, "x").endswith("<|im_start|>assistant\n")
    off = render_request({**body, "add_generation_prompt": False}, QWEN, "x")
    assert not off.endswith("<|im_start|>assistant\n")


def test_chat_template_kwargs_reach_the_template() -> None:
    """chat_template_kwargs become template variables."""
    template = ChatTemplate("{{ greeting }} {{ messages[0].content }}")
    body = {"messages": [{"role": "user", "content": "x"}],
            "chat_template_kwargs": {"greeting": "hello"}}
    assert render_request(body, template, "r") == "hello x"


def test_raw_prompts_and_bad_requests() -> None:
    """A 'prompt' string is used as is; a request with neither field names what it needs."""
    assert render_request({"prompt": "text"}, None, "r") == "text"
    with pytest.raises(InputFormatError, match="'messages'"):
        render_request({"model": "m"}, QWEN, "r")
    with pytest.raises(ConfigError, match="--template"):
        render_request({"messages": [{"role": "user", "content": "x"}]}, None, "r")
