"""Audit output: plain text for people, JSON for scripts, SARIF 2.1.0 for code-scanning UIs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvreuse import __version__
from kvreuse.lint.audit import AUDIT_RULES
from kvreuse.lint.audit.base import Finding

SARIF_SCHEMA = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"


def to_text(findings: Sequence[Finding], samples: int) -> str:
    if not findings:
        return f"no findings in {samples} sample(s)"
    lines = []
    for finding in findings:
        lines.append(
            f"{finding.severity.label.upper():7} {finding.rule_id} {finding.rule_name} "
            f"[{finding.tokens_cost} tokens] {finding.location}"
        )
        lines.append(f"        {finding.message}")
        lines.append(f"        fix: {finding.fix}")
    total = sum(f.tokens_cost for f in findings)
    lines.append(f"{len(findings)} finding(s) in {samples} sample(s); {total} tokens at stake")
    return "\n".join(lines)


def to_json(findings: Sequence[Finding], samples: int) -> dict[str, Any]:
    return {"samples": samples, "findings": [f.to_json() for f in findings]}


def _artifact_and_field(location: str) -> tuple[str, str]:
    artifact, _, field = location.partition(": ")
    return artifact, field


def to_sarif(findings: Sequence[Finding]) -> dict[str, Any]:
    """A SARIF 2.1.0 log: one run, every rule described, one result per finding.

    Offsets point into the *rendered* prompt, not the request file, so results carry the file as
    the artifact and the request field as a logical location.
    """
    rules = [
        {
            "id": rule.id,
            "name": rule.name,
            "shortDescription": {"text": rule.summary},
            "help": {"text": getattr(rule, "fix", rule.summary)},
        }
        for rule in AUDIT_RULES.values()
    ]
    index = {rule_id: i for i, rule_id in enumerate(AUDIT_RULES)}
    results = []
    for finding in findings:
        artifact, field = _artifact_and_field(finding.location)
        location: dict[str, Any] = {"physicalLocation": {"artifactLocation": {"uri": artifact}}}
        if field:
            location["logicalLocations"] = [{"fullyQualifiedName": field, "kind": "member"}]
        results.append(
            {
                "ruleId": finding.rule_id,
                "ruleIndex": index[finding.rule_id],
                "level": finding.severity.label,
                "message": {"text": f"{finding.message}. Fix: {finding.fix}"},
                "locations": [location],
                "properties": {
                    "tokensCost": finding.tokens_cost,
                    "tokenIndex": finding.token_index,
                    "renderedCharOffset": finding.char_offset,
                },
            }
        )
    return {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "kvreuse audit",
                        "version": __version__,
                        "rules": rules,
                    }
                },
                "results": results,
            }
        ],
    }
