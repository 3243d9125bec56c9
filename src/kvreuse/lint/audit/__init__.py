"""Prompt-stability audit: rules that find what silently breaks prefix reuse.

Rules register in :data:`AUDIT_RULES` by id; :func:`run_audit` runs them all (or a selection)
and returns findings worst first. Output formats live in :mod:`kvreuse.lint.audit.report`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvreuse.errors import ConfigError
from kvreuse.lint.audit.base import AuditInput, AuditRule, Finding, Severity, fixed_clocks
from kvreuse.lint.audit.boundary import TokenBoundaryRule
from kvreuse.lint.audit.history import MovingSystemPromptRule, RewrittenHistoryRule
from kvreuse.lint.audit.structure import PerUserFieldRule, RetrievalOrderRule, ToolSchemaOrderRule
from kvreuse.lint.audit.volatile import ID_RULE, TIMESTAMP_RULE

AUDIT_RULES: dict[str, AuditRule] = {
    rule.id: rule
    for rule in (
        TIMESTAMP_RULE,
        ID_RULE,
        PerUserFieldRule(),
        ToolSchemaOrderRule(),
        RetrievalOrderRule(),
        RewrittenHistoryRule(),
        MovingSystemPromptRule(),
        TokenBoundaryRule(),
    )
}
"""Every audit rule by id (KV101 ... KV108)."""


def run_audit(
    audit: AuditInput,
    rule_ids: Iterable[str] | None = None,
    on_rule: Callable[[str, int, int], None] | None = None,
) -> list[Finding]:
    """Run the chosen rules (all by default); findings sorted by severity, then tokens lost.
    ``on_rule(rule_id, index, count)`` is called before each rule runs (a rule over a large log
    takes seconds)."""
    chosen = list(AUDIT_RULES) if rule_ids is None else list(rule_ids)
    unknown = [rule_id for rule_id in chosen if rule_id not in AUDIT_RULES]
    if unknown:
        raise ConfigError(f"unknown audit rule(s) {unknown}; known: {', '.join(AUDIT_RULES)}")
    findings: list[Finding] = []
    for index, rule_id in enumerate(chosen):
        if on_rule is not None:
            on_rule(rule_id, index, len(chosen))
        findings.extend(AUDIT_RULES[rule_id].check(audit))
    findings.sort(key=lambda f: (-f.severity, -f.tokens_cost, f.rule_id, f.location))
    return findings


def worst_severity(findings: Iterable[Finding]) -> Severity | None:
    return max((f.severity for f in findings), default=None)


__all__ = [
    "AUDIT_RULES",
    "AuditInput",
    "AuditRule",
    "Finding",
    "Severity",
    "fixed_clocks",
    "run_audit",
    "worst_severity",
]
