"""Prompt diffs: first divergent token, character offset, field path, reuse per rule."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from kvreuse.lint.diff import diff_prompts
from kvreuse.lint.paths import FieldPath, differing_paths, splice
from kvreuse.lint.prompt import build_prompt
from kvreuse.tokenizers import load_tokenizer
from kvreuse.tokenizers.chat_template import ChatTemplate

TEMPLATES = Path(__file__).parents[1] / "data" / "templates"
QWEN = ChatTemplate((TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text())
TOKENIZER = load_tokenizer("cl100k_base").tokenizer
SYSTEM = "You are the support assistant for Example Books. " * 30
TOOLS = [
    {"type": "function", "function": {"name": "a", "description": "first",
                                      "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "b", "description": "second",
                                      "parameters": {"type": "object", "properties": {"x": {}}}}},
]


def request(user: str, system: str = SYSTEM, tools: Any = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]
    }
    if tools is not None:
        body["tools"] = tools
    return body


def prompt(body: dict[str, Any], label: str) -> Any:
    return build_prompt(body, tokenizer=TOKENIZER, template=QWEN, label=label)


def test_identical_prompts_have_no_divergence() -> None:
    """Identical requests: no divergent token, every rule reuses its maximum."""
    a, b = prompt(request("hi"), "a"), prompt(request("hi"), "b")
    result = diff_prompts(a, b, tokenizer=TOKENIZER, template=QWEN)
    assert result.identical
    reuse = {r.rule: r.reused for r in result.reuse}
    assert reuse["radix"] == len(b)
    assert reuse["vllm"] == (len(b) - 1) // 16 * 16


def test_user_message_difference_is_attributed_to_the_last_message() -> None:
    """Two questions on one system prompt part inside messages[1].content."""
    a, b = prompt(request("Where is my order?"), "a"), prompt(request("Can I get a refund?"), "b")
    result = diff_prompts(a, b, tokenizer=TOKENIZER, template=QWEN)
    divergence = result.divergence
    assert divergence is not None
    assert divergence.field_path == "messages[1].content"
    assert a.text[: divergence.char_offset_a] == b.text[: divergence.char_offset_b]
    assert divergence.char_offset_a == a.text.index("Where")
    assert result.shared == divergence.token_index
    assert list(a.ids[: result.shared]) == list(b.ids[: result.shared])
    assert a.ids[result.shared] != b.ids[result.shared]


def test_early_system_change_is_attributed_to_the_system_prompt() -> None:
    """A changed system prompt start is reported at messages[0].content, at a small offset."""
    a = prompt(request("hi", system="Today is Monday. " + SYSTEM), "a")
    b = prompt(request("hi", system="Today is Friday. " + SYSTEM), "b")
    result = diff_prompts(a, b, tokenizer=TOKENIZER, template=QWEN)
    assert result.divergence is not None
    assert result.divergence.field_path == "messages[0].content"
    assert {r.rule: r.reused for r in result.reuse}["vllm"] == 0


def test_tool_key_order_is_attributed_to_the_tool_schema() -> None:
    """Same tool, keys in another order: the path names the reordered object."""
    reordered = copy.deepcopy(TOOLS)
    function = reordered[1]["function"]
    reordered[1]["function"] = {
        "name": function["name"], "parameters": function["parameters"],
        "description": function["description"],
    }
    a, b = prompt(request("hi", tools=TOOLS), "a"), prompt(request("hi", tools=reordered), "b")
    result = diff_prompts(a, b, tokenizer=TOKENIZER, template=QWEN)
    assert result.divergence is not None
    assert result.divergence.field_path == "tools[1].function"


def test_template_layout_decides_which_field_comes_first() -> None:
    """Qwen renders tools after the system prompt: with both changed, the system one is first."""
    tools_b = copy.deepcopy(TOOLS)
    tools_b[0]["function"]["description"] = "changed"
    a = prompt(request("hi", system="A" + SYSTEM, tools=TOOLS), "a")
    b = prompt(request("hi", system="B" + SYSTEM, tools=tools_b), "b")
    result = diff_prompts(a, b, tokenizer=TOKENIZER, template=QWEN)
    assert result.divergence is not None
    assert result.divergence.field_path == "messages[0].content"


def test_stable_text_ending_in_a_space_merges_with_the_next_word() -> None:
    """Raw prompts 'Question: X' share fewer tokens than their common text suggests."""
    stable = "Answer from the manual below.\n" * 40 + "Question: "
    a = build_prompt(stable + "refund", tokenizer=TOKENIZER, template=None, label="a")
    b = build_prompt(stable + "shipping", tokenizer=TOKENIZER, template=None, label="b")
    stable_tokens = len(TOKENIZER.encode(stable))
    result = diff_prompts(a, b, tokenizer=TOKENIZER)
    assert result.shared < stable_tokens
    assert result.divergence is not None
    assert result.divergence.field_path is not None
    assert result.divergence.field_path.startswith("prompt (line 41")


def test_differing_paths_are_order_sensitive() -> None:
    """Equal dicts with another key order differ at the dict; lists of other length at the tail."""
    a = {"x": {"p": 1, "q": 2}, "l": [1, 2]}
    b = {"x": {"q": 2, "p": 1}, "l": [1, 2, 3]}
    assert a["x"] == b["x"]
    paths = list(differing_paths(a, b))
    assert paths == [FieldPath(("x",)), FieldPath(("l", 2), tail=True)]
    assert str(paths[0]) == "x"


def test_splice_takes_one_field_from_the_other_request() -> None:
    """splice copies only the named field (or list tail) and leaves the input untouched."""
    a = {"m": [{"c": "a0"}, {"c": "a1"}]}
    b = {"m": [{"c": "b0"}, {"c": "b1"}, {"c": "b2"}]}
    assert splice(a, b, FieldPath(("m", 1, "c"))) == {"m": [{"c": "a0"}, {"c": "b1"}]}
    assert splice(a, b, FieldPath(("m", 1), tail=True)) == {
        "m": [{"c": "a0"}, {"c": "b1"}, {"c": "b2"}]
    }
    assert a == {"m": [{"c": "a0"}, {"c": "a1"}]}
