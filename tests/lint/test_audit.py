"""Audit rules KV101-KV108 on real templates and a real tokenizer: each fires on its problem
and stays quiet on the fixed prompt."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.errors import ConfigError
from kvreuse.lint.audit import AUDIT_RULES, AuditInput, Severity, fixed_clocks, run_audit
from kvreuse.lint.audit.base import TextEnds, stable_end_char
from kvreuse.lint.audit.report import to_json, to_sarif, to_text
from kvreuse.lint.paths import common_prefix_chars
from kvreuse.lint.prompt import build_prompt
from kvreuse.tokenizers import load_tokenizer
from kvreuse.tokenizers.chat_template import ChatTemplate

TEMPLATES = Path(__file__).parents[1] / "data" / "templates"
TOKENIZER = load_tokenizer("o200k_base").tokenizer
POLICY = "Refunds are possible within 30 days of delivery. Shipping is free above 25 EUR. " * 12


SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


def template(name: str) -> ChatTemplate:
    source = (TEMPLATES / f"{name}.jinja").read_text()
    return ChatTemplate(source, special_tokens=SPECIALS, clock=fixed_clocks()[0])


QWEN = template("Qwen-Qwen2.5-7B-Instruct")


def chat(system: str, user: str, tools: Any = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        **extra,
    }
    if tools is not None:
        body["tools"] = tools
    return body


def audit(bodies: list[Any], tpl: ChatTemplate | None = QWEN, rules: list[str] | None = None
          ) -> list[Any]:
    prompts = tuple(
        build_prompt(body, tokenizer=TOKENIZER, template=tpl, label=f"r{i}.json")
        for i, body in enumerate(bodies)
    )
    findings = run_audit(
        AuditInput(prompts, TOKENIZER, tpl, fixed_clocks(), template_label="tpl.jinja"), rules
    )
    return findings


def only(findings: list[Any], rule: str) -> list[Any]:
    return [f for f in findings if f.rule_id == rule]


def test_kv101_timestamp_varying_across_requests_is_an_error() -> None:
    """A per-request time in the system prompt: error at messages[0].content, priced in tokens."""
    findings = only(audit([
        chat(f"Now: 2025-01-30 09:15. {POLICY}", "Where is my order?"),
        chat(f"Now: 2025-01-31 14:02. {POLICY}", "Can I return it?"),
    ], rules=["KV101"]), "KV101")
    assert len(findings) == 1
    assert findings[0].severity is Severity.ERROR
    assert findings[0].location == "r0.json: messages[0].content"
    assert findings[0].tokens_cost > 200


def test_kv101_date_in_the_last_user_turn_is_fine() -> None:
    """The same date after the stable part costs nothing and is not reported."""
    findings = audit([
        chat(POLICY, "It is 2025-01-30 09:15. Where is my order?"),
        chat(POLICY, "It is 2025-01-31 14:02. Can I return it?"),
    ], rules=["KV101"])
    assert findings == []


def test_kv101_template_reading_the_clock() -> None:
    """Llama 3.2 writes today's date into every prompt: found by rendering at two instants."""
    llama = template("meta-llama-Llama-3.2-3B-Instruct")
    findings = only(audit([chat(POLICY, "hi")], tpl=llama, rules=["KV101"]), "KV101")
    assert [f.location for f in findings] == ["tpl.jinja: strftime_now"]
    assert findings[0].severity is Severity.ERROR
    assert findings[0].tokens_cost > 100


def test_kv102_request_id_in_the_system_prompt() -> None:
    """UUIDs that change per request: error."""
    findings = only(audit([
        chat(f"request 3f2b8a1e-9c4d-4e5f-8a7b-1c2d3e4f5a6b. {POLICY}", "a"),
        chat(f"request 7d9e0f1a-2b3c-4d5e-9f6a-7b8c9d0e1f2a. {POLICY}", "b"),
    ], rules=["KV102"]), "KV102")
    assert len(findings) == 1 and findings[0].severity is Severity.ERROR


def test_kv103_per_user_name_ahead_of_shared_policy() -> None:
    """A user's name before the shared policy text: the policy cannot be reused."""
    findings = only(audit([
        chat(f"You are helping Alice Example. {POLICY}", "Where is my order?"),
        chat(f"You are helping Bob Sample. {POLICY}", "Where is my order?"),
    ], rules=["KV103"]), "KV103")
    assert len(findings) == 1
    assert findings[0].location.endswith("messages[0].content")
    assert findings[0].tokens_cost >= len(TOKENIZER.encode(POLICY)) - 5


def test_kv103_quiet_when_only_the_question_differs() -> None:
    """Requests that differ only in the last user message have nothing to report."""
    assert audit([chat(POLICY, "Where is my order?"), chat(POLICY, "Refund?")]) == []


TOOLS = [
    {"type": "function", "function": {"name": "lookup_order", "description": "Find an order",
     "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "refund", "description": "Refund an order",
     "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}}},
]


def test_kv104_tool_order_varies() -> None:
    """The same tools in another order: error at 'tools'."""
    findings = only(audit([
        chat(POLICY, "a", tools=TOOLS), chat(POLICY, "b", tools=list(reversed(TOOLS))),
    ], rules=["KV104"]), "KV104")
    assert [f.location for f in findings] == ["r0.json: tools"]


def test_kv104_key_order_varies() -> None:
    """The same schema with keys in another order: error at the reordered object."""
    reordered = copy.deepcopy(TOOLS)
    function = reordered[1]["function"]
    reordered[1]["function"] = dict(reversed(list(function.items())))
    findings = only(audit([chat(POLICY, "a", tools=TOOLS), chat(POLICY, "b", tools=reordered)],
                          rules=["KV104"]), "KV104")
    assert [f.location for f in findings] == ["r0.json: tools[1].function"]
    assert findings[0].severity is Severity.ERROR


def test_kv104_quiet_for_identical_tools() -> None:
    """Deterministic tools: nothing to report."""
    assert audit([chat(POLICY, "a", tools=TOOLS), chat(POLICY, "b", tools=TOOLS)],
                 rules=["KV104"]) == []


CHUNKS = [f"Chunk {i}: " + "contract clause text " * 20 for i in range(3)]


def test_kv105_same_chunks_in_another_order() -> None:
    """Retrieved chunks ordered by score in the stable part: warning at that field."""
    first = "\n\n".join(CHUNKS)
    second = "\n\n".join([CHUNKS[2], CHUNKS[0], CHUNKS[1]])
    findings = only(audit([chat(first, "q1"), chat(second, "q2")], rules=["KV105"]), "KV105")
    assert [f.location for f in findings] == ["r0.json: messages[0].content"]
    assert findings[0].severity is Severity.WARNING


def test_kv106_client_rewrote_an_earlier_answer() -> None:
    """A follow-up request that changed turn 1's answer: error at messages[2].content."""
    turn1 = {"messages": [
        {"role": "system", "content": POLICY}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Where is my order?"},
    ]}
    turn2 = copy.deepcopy(turn1)
    turn2["messages"][2]["content"] = "Hello! How can I help?"
    turn2["messages"] += [
        {"role": "assistant", "content": "It shipped."}, {"role": "user", "content": "Thanks"},
    ]
    findings = only(audit([turn1, turn2], rules=["KV106"]), "KV106")
    assert [f.location for f in findings] == ["r1.json: messages[2].content"]
    assert findings[0].tokens_cost > 0


@pytest.mark.parametrize(
    ("name", "severity"),
    [("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", Severity.ERROR),
     ("Qwen-Qwen3-0.6B", Severity.WARNING)],
)
def test_kv106_template_drops_reasoning_from_history(name: str, severity: Severity) -> None:
    """Reasoning templates re-render earlier answers without their thinking."""
    findings = only(audit([chat(POLICY, "hi")], tpl=template(name), rules=["KV106"]), "KV106")
    assert len(findings) == 1
    assert findings[0].severity is severity
    assert findings[0].location == "tpl.jinja: rendering"


def test_kv107_mistral_moves_the_system_prompt() -> None:
    """Mistral NeMo's template puts the system prompt into the last user turn."""
    findings = audit([chat(POLICY, "hi")], tpl=template("mistralai-Mistral-Nemo-Instruct-2407"))
    moved = only(findings, "KV107")
    assert len(moved) == 1 and moved[0].severity is Severity.ERROR
    assert moved[0].tokens_cost > len(TOKENIZER.encode(POLICY)) - 5


@pytest.mark.parametrize(
    "name", ["Qwen-Qwen2.5-7B-Instruct", "meta-llama-Llama-3.1-8B-Instruct", "google-gemma-2-2b-it",
             "vllm-template_chatml"],
)
def test_append_only_templates_have_no_history_findings(name: str) -> None:
    """Templates that extend turn 1 on turn 2 produce no KV106/KV107 finding."""
    body = {"messages": [{"role": "user", "content": "hi"}]}
    findings = audit([body], tpl=template(name), rules=["KV106", "KV107"])
    assert findings == []


def test_kv108_stable_part_ending_in_a_space() -> None:
    """'...Question: ' + question merges the space into the question's first token."""
    stable = "Answer using the manual.\n" * 20 + "Question: "
    findings = only(audit([stable + "refund", stable + "shipping"], tpl=None), "KV108")
    assert len(findings) == 1 and findings[0].tokens_cost >= 1


def test_kv108_quiet_when_the_stable_part_ends_on_a_newline() -> None:
    """Ending the stable part with a newline keeps the boundary fixed."""
    stable = "Answer using the manual.\n" * 20 + "Question:\n"
    assert only(audit([stable + "refund", stable + "shipping"], tpl=None), "KV108") == []


def test_probe_that_cannot_render_says_so() -> None:
    """A template that fails on the probe conversation yields a note, not silence."""
    broken = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'assistant' %}{{ raise_exception('no replies') }}"
        "{% endif %}{{ m.content }}{% endfor %}"
    )
    findings = only(audit([chat(POLICY, "hi")], tpl=broken, rules=["KV106"]), "KV106")
    assert [f.severity for f in findings] == [Severity.NOTE]
    assert "could not" in findings[0].message


def test_findings_sorted_worst_first_and_unknown_rules_refused() -> None:
    """Errors before warnings; an unknown rule id is a ConfigError listing the known ones."""
    findings = audit([
        chat(f"Hi Alice, now 2025-01-30 09:15. {POLICY}", "a", tools=TOOLS),
        chat(f"Hi Bob, now 2025-01-31 14:02. {POLICY}", "b", tools=list(reversed(TOOLS))),
    ])
    severities = [f.severity for f in findings]
    assert severities == sorted(severities, reverse=True)
    with pytest.raises(ConfigError, match="KV101"):
        audit([chat(POLICY, "a")], rules=["KV999"])


def test_sarif_report_lists_every_rule_and_each_finding() -> None:
    """SARIF 2.1.0: one run, all rules described, results with level, rule index and cost."""
    findings = audit([
        chat(f"Now: 2025-01-30 09:15. {POLICY}", "a"),
        chat(f"Now: 2025-01-31 14:02. {POLICY}", "b"),
    ])
    sarif = to_sarif(findings)
    assert sarif["version"] == "2.1.0"
    run = sarif["runs"][0]
    assert [r["id"] for r in run["tool"]["driver"]["rules"]] == list(AUDIT_RULES)
    result = run["results"][0]
    assert result["ruleId"] == findings[0].rule_id
    assert run["tool"]["driver"]["rules"][result["ruleIndex"]]["id"] == result["ruleId"]
    assert result["level"] == "error"
    assert result["properties"]["tokensCost"] == findings[0].tokens_cost
    assert result["locations"][0]["logicalLocations"][0]["fullyQualifiedName"] == (
        "messages[0].content"
    )
    assert to_json(findings, 2)["findings"][0]["rule"] == findings[0].rule_id
    assert "fix:" in to_text(findings, 2)


def test_run_audit_announces_each_chosen_rule_before_it_runs() -> None:
    """on_rule gets (rule id, index, count) once per chosen rule, in order, before its findings."""
    bodies = [chat(f"Now: 2025-01-3{i} 09:15. {POLICY}", "Where is my order?") for i in (0, 1)]
    prompts = tuple(build_prompt(body, tokenizer=TOKENIZER, template=QWEN, label=f"r{i}.json")
                    for i, body in enumerate(bodies))
    calls: list[tuple[str, int, int]] = []
    findings = run_audit(AuditInput(prompts, TOKENIZER, QWEN, fixed_clocks()), ["KV108", "KV101"],
                         lambda rule, index, count: calls.append((rule, index, count)))
    assert calls == [("KV108", 0, 2), ("KV101", 1, 2)]
    assert [f.rule_id for f in findings] == ["KV101"]


@settings(max_examples=200, deadline=None)
@given(texts=st.lists(st.text(alphabet="ab\u00e9", max_size=6), min_size=1, max_size=8))
def test_text_ends_give_the_prefix_every_other_text_shares(texts: list[str]) -> None:
    """Differential: TextEnds' two comparisons equal the shortest common prefix with each of
    the others, duplicates and a single prompt included."""
    prompts = [build_prompt(text, tokenizer=TOKENIZER, template=None, label=f"t{i}")
               for i, text in enumerate(texts)]
    ends = TextEnds.of(prompts)
    for prompt in prompts:
        others = [other.text for other in prompts if other is not prompt]
        expected = min((common_prefix_chars(prompt.text, other) for other in others),
                       default=None)
        assert ends.shared_by_all_others(prompt) == expected, (prompt.text, texts)


def test_the_stable_part_of_raw_prompts_is_the_text_they_all_share() -> None:
    """Raw prompts have no last user message: their stable part ends where the first of the
    other prompts parts from them."""
    bodies = [f"You are the support assistant. {POLICY}Question {i}: where is order {i}?"
              for i in range(3)]
    prompts = tuple(build_prompt(body, tokenizer=TOKENIZER, template=None, label=f"r{i}")
                    for i, body in enumerate(bodies))
    ends = AuditInput(prompts, TOKENIZER, None, fixed_clocks()).text_ends
    for prompt in prompts:
        assert stable_end_char(prompt, ends) == prompt.text.index("Question") + len("Question ")
    assert stable_end_char(prompts[0]) == len(prompts[0].text)  # alone, all of it is stable
