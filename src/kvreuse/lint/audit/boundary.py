"""KV108: the stable part does not end on a token boundary.

Seed 000: "a tokenizer can merge characters across the stable-to-variable boundary; ending the
stable part on a newline keeps that boundary fixed." The stable part is tokenized on its own and
compared with the full prompt's tokens: if its last tokens are not a prefix of the full prompt,
they merge with whatever follows and differ from request to request.
"""

from __future__ import annotations

from dataclasses import replace

from kvreuse.lint.audit.base import (
    AuditInput,
    Finding,
    Severity,
    rule_finding,
    stable_end_char,
)
from kvreuse.tokens import common_prefix_tokens, pack


class TokenBoundaryRule:
    id = "KV108"
    name = "stable-part-not-on-token-boundary"
    summary = "the stable part's last tokens merge with the variable text after it"
    fix = (
        "end the stable part on a newline or a special token (not on a space or inside a word), "
        "so the variable text starts a new token"
    )

    def check(self, audit: AuditInput) -> list[Finding]:
        worst: Finding | None = None
        affected = 0
        for prompt in audit.prompts:
            end = stable_end_char(prompt, audit.text_ends)
            if end <= 0 or end >= len(prompt.text):
                continue
            stable_ids = audit.tokenizer.encode(prompt.text[:end])
            shared = common_prefix_tokens(pack(stable_ids), pack(prompt.ids))
            if shared >= len(stable_ids):
                continue
            affected += 1
            cost = len(stable_ids) - shared
            if worst is None or cost > worst.tokens_cost:
                tail = prompt.text[max(0, end - 12) : end + 12]
                worst = rule_finding(
                    self, Severity.WARNING, prompt, f"stable part end (character {end})", shared,
                    cost, f"the stable part ends inside a token ({tail!r}): its last {cost} "
                    f"token(s) merge with the variable text, so token {shared} onwards "
                    "differs per request",
                )
        if worst is None:
            return []
        if affected > 1:
            worst = replace(worst, message=f"{worst.message} ({affected} samples affected)")
        return [worst]
