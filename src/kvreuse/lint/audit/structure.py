"""Differences between samples that land in the stable part.

KV103: a per-user (per-request) field ahead of content every request shares.
KV104: tool schemas whose key order or tool order varies between requests.
KV105: the same retrieved chunks in a different order.

Each compares consecutive samples (O(n) pairs) and prices a finding at the stable tokens the
second sample cannot reuse from the first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from kvreuse.lint.audit.base import (
    AuditInput,
    Finding,
    Severity,
    pairs,
    rule_finding,
    stable_end_char,
    stable_end_token,
    token_at,
)
from kvreuse.lint.audit.volatile import ID_PATTERNS, TIMESTAMP_PATTERNS
from kvreuse.lint.diff import attribute_field, shared_prefix
from kvreuse.lint.paths import differing_paths, format_path, string_leaves
from kvreuse.lint.prompt import Prompt


def _lost_stable_tokens(a: Prompt, b: Prompt, audit: AuditInput) -> tuple[int, int]:
    """(first divergent token, stable tokens of ``b`` after it); (shared, 0) when the prompts
    part only in their variable tails."""
    shared = shared_prefix(a, b)
    end = min(stable_end_token(a, audit.text_ends), stable_end_token(b, audit.text_ends))
    return shared, max(0, end - shared)


def _common_suffix(a: str, b: str) -> int:
    n = 0
    limit = min(len(a), len(b))
    while n < limit and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return n


def _volatile_only(a: object, b: object) -> bool:
    """True when two strings differ only in dates, times or ids (KV101/KV102 report those)."""
    if not (isinstance(a, str) and isinstance(b, str)):
        return False
    for pattern in (*TIMESTAMP_PATTERNS, *ID_PATTERNS):
        a, b = pattern.sub("\0", a), pattern.sub("\0", b)
    return a == b


class PerUserFieldRule:
    id = "KV103"
    name = "per-request-field-before-stable-content"
    summary = "a field that differs per request sits ahead of content all requests share"
    fix = (
        "move per-user and per-request values (names, account data, retrieved facts) after the "
        "shared instructions, tools and documents, ideally into the last user turn"
    )

    def check(self, audit: AuditInput) -> list[Finding]:
        seen: dict[str, Finding] = {}
        for a, b in pairs(audit.prompts):
            if a.request is None or b.request is None or _is_continuation(a.request, b.request):
                continue
            shared, _ = _lost_stable_tokens(a, b, audit)
            end_a, end_b = stable_end_char(a, audit.text_ends), stable_end_char(b, audit.text_ends)
            start_a, start_b = a.char_offset(shared), b.char_offset(shared)
            if start_a >= end_a or start_b >= end_b:
                continue
            # Stable content *behind* the difference: the stable parts re-converge.
            suffix = _common_suffix(a.text[start_a:end_a], b.text[start_b:end_b])
            cost = stable_end_token(a, audit.text_ends) - token_at(a, end_a - suffix)
            if suffix == 0 or cost < audit.block_size:
                continue
            field = attribute_field(audit.template, a.request, b.request, a.text)
            if field is None or field.startswith(("tools", "documents")):
                continue  # KV104 / KV105 own these
            try:
                if _volatile_only(get_path_str(a.request, field), get_path_str(b.request, field)):
                    continue
            except (KeyError, IndexError, TypeError):
                pass
            if field not in seen or seen[field].tokens_cost < cost:
                seen[field] = rule_finding(
                    self, Severity.WARNING, a, field, shared, cost,
                    f"{field} differs between {a.label} and {b.label} at token {shared}, ahead of "
                    f"{cost} tokens both share; none of them can be reused",
                )
        return list(seen.values())


def get_path_str(request: Mapping[str, Any], field: str) -> object:
    """The value at a formatted path, found by matching against the request's string leaves."""
    for path, value in string_leaves(request):
        if path == field:
            return value
    raise KeyError(field)


def _is_continuation(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """B continues A's conversation: B has more messages and starts with A's first message."""
    ma, mb = a.get("messages"), b.get("messages")
    if not (isinstance(ma, list) and isinstance(mb, list)) or not ma or not mb:
        return False
    shorter, longer = (ma, mb) if len(ma) <= len(mb) else (mb, ma)
    return len(shorter) < len(longer) and shorter[0] == longer[0] and (
        len(shorter) < 2 or shorter[1] == longer[1]
    )


def _tool_name(tool: object) -> str | None:
    if not isinstance(tool, Mapping):
        return None
    function = tool.get("function")
    name = function.get("name") if isinstance(function, Mapping) else tool.get("name")
    return name if isinstance(name, str) else None


class ToolSchemaOrderRule:
    id = "KV104"
    name = "tool-schema-order-varies"
    summary = "the same tools serialise in a different key or tool order"
    fix = (
        "serialise tools deterministically: a fixed tool order and a fixed key order "
        "(json.dumps(tools, sort_keys=True) or a schema built once at deploy time)"
    )

    def check(self, audit: AuditInput) -> list[Finding]:
        findings: dict[str, Finding] = {}
        for a, b in pairs(audit.prompts):
            tools_a = a.request.get("tools") if a.request else None
            tools_b = b.request.get("tools") if b.request else None
            if not (isinstance(tools_a, list) and isinstance(tools_b, list)):
                continue
            shared, cost = _lost_stable_tokens(a, b, audit)
            if cost == 0:
                continue
            names_a = [_tool_name(t) for t in tools_a]
            names_b = [_tool_name(t) for t in tools_b]
            if names_a != names_b and Counter(names_a) == Counter(names_b):
                findings.setdefault("tools", rule_finding(
                    self, Severity.ERROR, a, "tools", shared, cost,
                    f"the same {len(names_a)} tools arrive in a different order in {a.label} and "
                    f"{b.label}; {cost} stable tokens after token {shared} are recomputed",
                ))
                continue
            by_name_b = {_tool_name(t): (i, t) for i, t in enumerate(tools_b)}
            for index, tool in enumerate(tools_a):
                other = by_name_b.get(_tool_name(tool))
                if other is None or tool != other[1]:
                    continue  # a different tool, or a real change: not an ordering problem
                path = next(differing_paths(tool, other[1]), None)
                if path is None:
                    continue
                field = format_path(("tools", index, *path.keys))
                findings.setdefault(field, rule_finding(
                    self, Severity.ERROR, a, field, shared, cost,
                    f"tool {_tool_name(tool)!r} has the same schema with keys in another order in "
                    f"{b.label}; {cost} stable tokens after token {shared} are recomputed",
                ))
        return list(findings.values())


def _chunks(text: str) -> list[str]:
    return [chunk.strip() for chunk in text.split("\n\n") if chunk.strip()]


def _reordered(a: Sequence[object], b: Sequence[object]) -> bool:
    keys_a = [repr(x) for x in a]
    keys_b = [repr(x) for x in b]
    return len(keys_a) >= 2 and keys_a != keys_b and Counter(keys_a) == Counter(keys_b)


class RetrievalOrderRule:
    id = "KV105"
    name = "retrieved-chunks-reordered"
    summary = "the same retrieved chunks arrive in a different order"
    fix = (
        "order retrieved chunks by a stable key (document id), not by score, so requests over "
        "the same documents share them; measure answer quality before and after"
    )

    def check(self, audit: AuditInput) -> list[Finding]:
        findings: dict[str, Finding] = {}
        for a, b in pairs(audit.prompts):
            if a.request is None or b.request is None:
                continue
            shared, cost = _lost_stable_tokens(a, b, audit)
            if cost == 0:
                continue
            for field in _reordered_fields(a.request, b.request):
                findings.setdefault(field, rule_finding(
                    self, Severity.WARNING, a, field, shared, cost,
                    f"{field} holds the same chunks in another order in {b.label}; sharing stops "
                    f"at token {shared} and {cost} stable tokens are recomputed",
                ))
        return list(findings.values())


def _reordered_fields(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    fields: list[str] = []
    docs_a, docs_b = a.get("documents"), b.get("documents")
    if isinstance(docs_a, list) and isinstance(docs_b, list) and _reordered(docs_a, docs_b):
        fields.append("documents")
    leaves_b = dict(string_leaves(b))
    for path, text in string_leaves(a):
        other = leaves_b.get(path)
        if other is not None and _reordered(_chunks(text), _chunks(other)):
            fields.append(path)
    messages_a, messages_b = a.get("messages"), b.get("messages")
    if isinstance(messages_a, list) and isinstance(messages_b, list):
        for index, (ma, mb) in enumerate(zip(messages_a, messages_b, strict=False)):
            parts_a = ma.get("content") if isinstance(ma, Mapping) else None
            parts_b = mb.get("content") if isinstance(mb, Mapping) else None
            if (
                isinstance(parts_a, list)
                and isinstance(parts_b, list)
                and _reordered(parts_a, parts_b)
            ):
                fields.append(format_path(("messages", index, "content")))
    return fields

