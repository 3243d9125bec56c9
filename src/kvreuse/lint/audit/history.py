"""History that does not stay put between turns.

KV106: earlier turns are rewritten: by the client (a logged follow-up request carries a changed
earlier message) or by the template (it re-renders earlier answers differently from how they were
generated, e.g. dropping their reasoning).
KV107: the template moves the system prompt between turns (Mistral's templates put it into the
last user turn), so turn 2 shares almost nothing with turn 1.

The template probe is the seed's multi-turn cache walk: turn 1's prompt plus the answer the model
generated is what the cache holds; turn 2's prompt must start with it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from kvreuse.errors import KvreuseError
from kvreuse.lint.audit.base import AuditInput, Finding, Severity, rule_finding
from kvreuse.lint.diff import shared_prefix
from kvreuse.lint.paths import differing_paths, format_path
from kvreuse.lint.prompt import Prompt, build_prompt

PROBE_SYSTEM = "You are the support assistant for Example Books. Answer briefly and politely."
PROBE_USER = "Where is my order?"
PROBE_ANSWER = "It shipped yesterday."
PROBE_NEXT_USER = "When will it arrive?"
PROBE_REASONING = "<think>\nThe user asks about an order.\n</think>\n\n"


def _conversation_key(request: Mapping[str, Any]) -> str | None:
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    first_user = next(
        (m for m in messages if isinstance(m, Mapping) and m.get("role") == "user"), None
    )
    return repr((messages[0], first_user))


class RewrittenHistoryRule:
    id = "KV106"
    name = "history-rewritten"
    summary = "earlier turns of a conversation are rendered differently on a later turn"
    fix = (
        "keep history append-only: resend earlier messages byte for byte, and use a template "
        "that renders earlier turns exactly as they were generated"
    )

    def check(self, audit: AuditInput) -> list[Finding]:
        findings = self._client_rewrites(audit)
        probe = _template_probe(audit)
        if probe is not None and probe.rule_id == self.id:
            findings.append(probe)
        return findings

    def _client_rewrites(self, audit: AuditInput) -> list[Finding]:
        groups: dict[str, list[Prompt]] = {}
        for prompt in audit.prompts:
            key = _conversation_key(prompt.request) if prompt.request is not None else None
            if key is not None:
                groups.setdefault(key, []).append(prompt)
        findings: list[Finding] = []
        for group in groups.values():
            group.sort(key=lambda p: len(p.request["messages"]) if p.request else 0)
            for earlier, later in itertools.pairwise(group):
                assert earlier.request is not None and later.request is not None
                old, new = earlier.request["messages"], later.request["messages"]
                if len(new) <= len(old):
                    continue
                path = next(differing_paths(old, new[: len(old)]), None)
                if path is None:
                    continue
                field = format_path(("messages", *path.keys))
                shared = shared_prefix(earlier, later)
                cost = max(0, len(earlier) - shared)
                findings.append(rule_finding(
                    self, Severity.ERROR, later, field, shared, cost,
                    f"{later.label} continues {earlier.label} but changed {field}; the {cost} "
                    f"tokens of the earlier prompt after token {shared} are recomputed",
                ))
        return findings


class MovingSystemPromptRule:
    id = "KV107"
    name = "system-prompt-moves"
    summary = "the template places the system prompt differently as the conversation grows"
    fix = (
        "use a template that renders the system prompt once at the start of every turn's prompt "
        "(for Mistral models, a template variant that keeps it in the first user turn)"
    )

    def check(self, audit: AuditInput) -> list[Finding]:
        probe = _template_probe(audit)
        return [probe] if probe is not None and probe.rule_id == self.id else []


def _probe_conversation(audit: AuditInput) -> list[dict[str, Any]]:
    """Turn 1 of a real sample when there is one (so costs are in real tokens), else synthetic."""
    for prompt in audit.prompts:
        request = prompt.request
        messages = request.get("messages") if request is not None else None
        if isinstance(messages, list) and messages and messages[-1].get("role") == "user":
            has_system = any(m.get("role") == "system" for m in messages)
            head = [] if has_system else [{"role": "system", "content": PROBE_SYSTEM}]
            return [*head, *[dict(m) for m in messages]]
    return [
        {"role": "system", "content": PROBE_SYSTEM},
        {"role": "user", "content": PROBE_USER},
    ]


def _template_probe(audit: AuditInput) -> Finding | None:
    """Render turn 1 and turn 2 of one conversation; report how turn 2 departs from what the
    cache holds after turn 1 (its prompt plus the generated answer)."""
    template = audit.template
    if template is None:
        return None
    turn1 = _probe_conversation(audit)
    reasoning = PROBE_REASONING if "</think>" in template.source else ""

    failures: list[str] = []

    def render(messages: list[dict[str, Any]], label: str) -> Prompt | None:
        request = {"messages": messages, "add_generation_prompt": True}
        try:
            return build_prompt(request, tokenizer=audit.tokenizer, template=template, label=label)
        except KvreuseError as exc:
            failures.append(f"{label}: {exc}")
            return None

    def not_probed() -> Finding:
        return Finding(
            rule_id=RewrittenHistoryRule.id,
            rule_name=RewrittenHistoryRule.name,
            severity=Severity.NOTE,
            sample=audit.template_label,
            location=f"{audit.template_label}: rendering",
            message=f"could not probe a two-turn conversation ({failures[-1]})",
            fix="check the template renders system, user and assistant turns",
            tokens_cost=0,
        )

    first = render(turn1, "turn 1")
    if first is None and turn1[0].get("role") == "system":
        # Some templates refuse a system role (Gemma); probe the conversation without it.
        turn1 = turn1[1:]
        first = render(turn1, "turn 1")
    if first is None:
        return not_probed()
    if reasoning and first.text.rstrip().endswith("<think>"):
        reasoning = reasoning.removeprefix("<think>\n")  # the generation prompt opened it
    generated = reasoning + PROBE_ANSWER
    second = render(
        [
            *turn1,
            {"role": "assistant", "content": generated},
            {"role": "user", "content": PROBE_NEXT_USER},
        ],
        "turn 2",
    )
    if second is None:
        return not_probed()
    cached_text = first.text + generated
    cached = build_prompt(cached_text, tokenizer=audit.tokenizer, template=None, label="cache")
    shared = shared_prefix(cached, second)
    if shared >= len(first) and shared >= len(cached) - 2:
        return None  # turn 2 extends turn 1 and its answer (up to the end-of-turn marker)
    system = next((m["content"] for m in turn1 if m.get("role") == "system"), None)
    moved = (
        isinstance(system, str)
        and system in first.text
        and first.text.find(system) != second.text.find(system)
    )
    system_text = system if isinstance(system, str) else ""
    rule: type[RewrittenHistoryRule | MovingSystemPromptRule]
    if moved:
        rule, severity, cost = MovingSystemPromptRule, Severity.ERROR, len(first) - shared
        message = (
            "the system prompt sits at character "
            f"{first.text.find(system_text)} on turn 1 and {second.text.find(system_text)} on "
            f"turn 2; "
            f"turn 2 shares only {shared} tokens with turn 1, so {cost} tokens of turn 1 are "
            "recomputed on every turn"
        )
    else:
        rule, cost = RewrittenHistoryRule, len(cached) - shared
        severity = Severity.ERROR if shared < len(first) else Severity.WARNING
        if reasoning:
            how = (
                "on turn 2 the template renders the earlier answer without its reasoning, so "
                "the cache of turn 1 (prompt and generated reasoning)"
            )
        else:
            how = (
                "on turn 2 the template renders earlier turns differently from turn 1's prompt "
                "and generated answer, so the cache of turn 1"
            )
        message = (
            f"{how} stops matching at token {shared}: {cost} cached tokens per turn are "
            "recomputed"
        )
    return Finding(
        rule_id=rule.id,
        rule_name=rule.name,
        severity=severity,
        sample=audit.template_label,
        location=f"{audit.template_label}: rendering",
        message=message,
        fix=rule.fix,
        tokens_cost=cost,
        token_index=shared,
        char_offset=second.char_offset(shared),
    )
