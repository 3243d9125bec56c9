"""The chat-template renderer's own behaviour: clock injection, filters, sandbox, errors."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.tokenizers.chat_template import (
    ChatTemplate,
    TemplateRaised,
    select_template,
    template_revision,
)

TEMPLATES = Path(__file__).parents[1] / "data" / "templates"
USER = [{"role": "user", "content": "hi"}]


def test_strftime_now_reads_the_injected_clock() -> None:
    """strftime_now formats whatever the clock returns."""
    template = ChatTemplate(
        "{{ strftime_now('%Y-%m-%d %H:%M') }}", clock=lambda: datetime(2031, 2, 3, 4, 5)
    )
    assert template.render(USER) == "2031-02-03 04:05"


def test_clockless_template_that_reads_the_time_says_what_to_pass() -> None:
    """Without a clock, a template calling strftime_now fails with a message naming the fix."""
    template = ChatTemplate("{{ strftime_now('%Y') }}")
    with pytest.raises(ConfigError, match="pass a clock"):
        template.render(USER)


def test_reads_clock_detects_strftime_now_even_behind_is_defined() -> None:
    """Llama 3.2's template reads the clock; Qwen 2.5's does not."""
    llama = (TEMPLATES / "meta-llama-Llama-3.2-3B-Instruct.jinja").read_text()
    qwen = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    assert ChatTemplate(llama).reads_clock
    assert not ChatTemplate(qwen).reads_clock


def test_tojson_keeps_key_order_and_does_not_escape_html() -> None:
    """tojson is json.dumps(ensure_ascii=False) without sorting, as in transformers."""
    value = {"z": "<b>&</b>", "a": "Zürich"}
    template = ChatTemplate("{{ messages[0].content | tojson }}")
    rendered = template.render([{"role": "user", "content": value}])
    assert rendered == json.dumps(value, ensure_ascii=False)
    assert rendered.index('"z"') < rendered.index('"a"')


def test_tojson_indent_and_separators_options() -> None:
    """indent and separators pass through to json.dumps."""
    template = ChatTemplate(
        "{{ messages[0].content | tojson(indent=2) }}|"
        "{{ messages[0].content | tojson(separators=(',', ':')) }}"
    )
    value = {"b": [1, 2], "a": None}
    rendered = template.render([{"role": "user", "content": value}])
    assert rendered == json.dumps(value, indent=2) + "|" + json.dumps(value, separators=(",", ":"))


def test_loop_controls_are_enabled() -> None:
    """{% break %} and {% continue %} work (the loopcontrols extension)."""
    template = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% if m.role == 'stop' %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    )
    messages = [
        {"role": "user", "content": "a"},
        {"role": "skip", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "stop", "content": "d"},
        {"role": "user", "content": "e"},
    ]
    assert template.render(messages) == "ac"


def test_generation_tag_renders_its_body() -> None:
    """{% generation %} blocks (training masks in transformers) render their content."""
    template = ChatTemplate("[{% generation %}{{ messages[0].content }}{% endgeneration %}]")
    assert template.render(USER) == "[hi]"


def test_trim_and_lstrip_blocks_are_on() -> None:
    """Block tags swallow the newline after them and the indentation before them."""
    template = ChatTemplate("{% if true %}\n    x\n{% endif %}\n  {% if true %}y{% endif %}")
    assert template.render(USER) == "    x\ny"


def test_raise_exception_becomes_template_raised() -> None:
    """A template's raise_exception is reported as the template refusing the request."""
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TemplateRaised, match="roles must alternate"):
        template.render(USER)


@pytest.mark.parametrize(
    ("source", "cause"),
    [("{{ range(10**12) | list | length }}", "OverflowError"),
     ("{{ 1 / (messages | length - 1) }}", "ZeroDivisionError")],
)
def test_a_template_failing_on_arithmetic_is_template_raised(source: str, cause: str) -> None:
    """The sandbox's too-large range or a division by zero fails this request, readably."""
    with pytest.raises(TemplateRaised, match=cause):
        ChatTemplate(source).render(USER)


def test_a_chat_template_file_not_in_utf8_names_the_file(tmp_path: Path) -> None:
    """chat_template.jinja holding other bytes is an InputFormatError naming it."""
    from kvreuse.tokenizers.hf import chat_templates_of

    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(InputFormatError, match=r"chat_template\.jinja"):
        chat_templates_of(tmp_path, {})


def test_sandbox_forbids_mutating_inputs() -> None:
    """The immutable sandbox refuses messages.append (a template cannot change the request)."""
    template = ChatTemplate("{% set _ = messages.append(1) %}x")
    with pytest.raises(TemplateRaised):
        template.render(USER)


def test_syntax_errors_name_the_line() -> None:
    """A broken template is a ConfigError naming the line."""
    with pytest.raises(ConfigError, match="line 2"):
        ChatTemplate("ok\n{% if %}")


def test_empty_conversation_is_refused() -> None:
    """transformers refuses an empty conversation; so does kvreuse."""
    with pytest.raises(InputFormatError):
        ChatTemplate("x").render([])


def test_kwargs_override_special_tokens() -> None:
    """Extra render variables win over the tokenizer's special tokens, as in transformers."""
    template = ChatTemplate("{{ bos_token }}", special_tokens={"bos_token": "<s>"})
    assert template.render(USER) == "<s>"
    assert template.render(USER, bos_token="<B>") == "<B>"


def test_template_revision_is_sha256_of_source() -> None:
    """The template revision changes with any byte of the source."""
    assert ChatTemplate("a").revision == template_revision("a")
    assert template_revision("a") != template_revision("a ")


def test_select_template_follows_transformers() -> None:
    """tool_use when tools are given and it exists, else default; a named one on request."""
    templates = {"default": "D", "tool_use": "T", "rag": "R"}
    assert select_template(templates) == "D"
    assert select_template(templates, tools=[{}]) == "T"
    assert select_template(templates, name="rag") == "R"
    with pytest.raises(ConfigError, match="no chat template named"):
        select_template(templates, name="missing")
    with pytest.raises(ConfigError, match="--template"):
        select_template({})
