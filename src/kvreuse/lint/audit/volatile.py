"""Volatile values in the stable part: timestamps and dates (KV101), unique ids (KV102).

Seed 000: "A timestamp or request id in the system prompt makes every prompt unique from token
one." A value found in one sample is a suspect; one that differs across samples at the same
field is a certain loss; a template that calls ``strftime_now`` is checked by rendering at two
instants.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from kvreuse.errors import KvreuseError
from kvreuse.lint.audit.base import (
    AuditInput,
    Finding,
    Severity,
    cost_from,
    location,
    stable_end_char,
    token_at,
)
from kvreuse.lint.paths import common_prefix_chars, path_containing
from kvreuse.lint.prompt import Prompt, build_prompt

_MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
TIMESTAMP_PATTERNS = (
    re.compile(
        r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?\b"
    ),
    re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?\s?(?:[AaPp]\.?[Mm]\.?)?(?=\W|$)"),
    re.compile(rf"\b\d{{1,2}}(?:st|nd|rd|th)? {_MONTH},? \d{{4}}\b"),
    re.compile(rf"\b{_MONTH} \d{{1,2}}(?:st|nd|rd|th)?,? \d{{4}}\b"),
    re.compile(r"\b\d{1,2}/\d{1,2}/\d{2,4}\b"),
    re.compile(r"\b1[6-9]\d{8}(?:\d{3})?\b"),
)
"""ISO 8601, clock times, '26 Jul 2024', 'July 26, 2024', '7/26/2024', epoch seconds/ms."""

ID_PATTERNS = (
    re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"),
    re.compile(r"\b[0-7][0-9A-HJKMNP-TV-Z]{25}\b"),
    re.compile(r"\b(?:req|request|chatcmpl|cmpl|trace|span|session|msg|run)[-_][A-Za-z0-9]{6,}\b"),
    re.compile(
        r"(?i)\b(?:request|trace|correlation|session|message)[ _-]?id\b[\"']?\s*[:=]\s*[\"']?"
        r"[A-Za-z0-9_-]{4,}"
    ),
    re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{16,}\b"),
)
"""UUIDs, ULIDs, prefixed ids (``req_...``, ``chatcmpl-...``), ``request_id: ...``, long hex."""


@dataclass(frozen=True, slots=True)
class _Hit:
    prompt: Prompt
    field: str
    value: str
    char_offset: int


class VolatileValueRule:
    """A regex family for values that change per request, found in the stable part."""

    def __init__(
        self, rule_id: str, name: str, summary: str, fix: str, patterns: tuple[re.Pattern[str], ...]
    ) -> None:
        self.id = rule_id
        self.name = name
        self.summary = summary
        self.fix = fix
        self.patterns = patterns

    def _hits(self, audit: AuditInput) -> list[_Hit]:
        hits: list[_Hit] = []
        for prompt in audit.prompts:
            stable = prompt.text[: stable_end_char(prompt, audit.text_ends)]
            taken: list[tuple[int, int]] = []
            for pattern in self.patterns:
                for match in pattern.finditer(stable):
                    if any(start < match.end() and match.start() < end for start, end in taken):
                        continue  # one value, one hit: ISO datetime also matches the time pattern
                    taken.append((match.start(), match.end()))
                    request = prompt.request
                    field = (
                        path_containing(request, match.group()) if request is not None else None
                    )
                    if field is None:
                        field = "template" if request is not None else "prompt"
                    hits.append(_Hit(prompt, field, match.group(), match.start()))
        return hits

    def check(self, audit: AuditInput) -> list[Finding]:
        by_field: dict[str, list[_Hit]] = defaultdict(list)
        for hit in self._hits(audit):
            by_field[hit.field].append(hit)
        findings = self._clock_findings(audit) if self.id == TIMESTAMP_RULE_ID else []
        clock_fields = {"template"} if findings else set()
        for field, hits in by_field.items():
            if field in clock_fields:
                continue
            values = {hit.value for hit in hits}
            samples = {hit.prompt.label for hit in hits}
            first = hits[0]
            if len(values) > 1:
                severity, how = Severity.ERROR, f"varies across samples ({len(values)} values)"
            elif len(samples) == 1:
                severity, how = Severity.WARNING, "seen in one sample; check it is not per request"
            else:
                severity, how = Severity.NOTE, f"identical in {len(samples)} samples"
            token = token_at(first.prompt, first.char_offset)
            cost = cost_from(first.prompt, token, audit.text_ends)
            findings.append(
                Finding(
                    rule_id=self.id,
                    rule_name=self.name,
                    severity=severity,
                    sample=first.prompt.label,
                    location=location(first.prompt, field),
                    message=(
                        f"{self.summary}: {first.value!r} at token {token}, {how}; "
                        f"{cost} stable tokens follow it"
                    ),
                    fix=self.fix,
                    tokens_cost=cost,
                    token_index=token,
                    char_offset=first.char_offset,
                )
            )
        return findings

    def _clock_findings(self, audit: AuditInput) -> list[Finding]:
        """Render each chat sample at two instants; a difference means the template reads the
        clock into the prompt."""
        template = audit.template
        if template is None or audit.clocks is None or not template.reads_clock:
            return []
        for prompt in audit.prompts:
            if prompt.request is None:
                continue
            try:
                early, late = (
                    build_prompt(
                        prompt.request,
                        tokenizer=audit.tokenizer,
                        template=template.with_clock(clock),
                        label=prompt.label,
                    )
                    for clock in audit.clocks
                )
            except KvreuseError:
                continue
            if early.text == late.text:
                continue
            char = common_prefix_chars(early.text, late.text)
            token = token_at(early, char)
            cost = cost_from(early, token, audit.text_ends)
            return [
                Finding(
                    rule_id=self.id,
                    rule_name=self.name,
                    severity=Severity.ERROR,
                    sample=prompt.label,
                    location=f"{audit.template_label}: strftime_now",
                    message=(
                        f"the chat template writes the current date/time into the prompt at token "
                        f"{token}; every new day (or second) starts a cold cache for the "
                        f"{cost} stable tokens after it"
                    ),
                    fix=(
                        "pass a fixed date through chat_template_kwargs (for example "
                        "date_string), or move the date after the stable content"
                    ),
                    tokens_cost=cost,
                    token_index=token,
                    char_offset=char,
                )
            ]
        return []


TIMESTAMP_RULE_ID = "KV101"

TIMESTAMP_RULE = VolatileValueRule(
    TIMESTAMP_RULE_ID,
    "timestamp-in-stable-part",
    "a date or time in the stable part",
    "move dates and times after the stable content (into the last user turn), or round them "
    "to a value that changes rarely and deploy it like a template change",
    TIMESTAMP_PATTERNS,
)

ID_RULE = VolatileValueRule(
    "KV102",
    "unique-id-in-stable-part",
    "a UUID or request id in the stable part",
    "send request, trace and session ids as request metadata or headers, not in the prompt; "
    "if the model needs one, put it in the last user turn",
    ID_PATTERNS,
)
