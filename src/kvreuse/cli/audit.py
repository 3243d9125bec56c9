"""``kvreuse audit``: find what breaks prefix reuse in a template's fixtures or logged requests."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvreuse.cli._prompts import add_prompt_arguments, load_prompts, setup_prompts, write_output
from kvreuse.cli.args import output_file
from kvreuse.cli.tables import make_console, progress_bar

FORMATS = ("text", "json", "sarif")
RULES_HELP = (
    "KV101 dates and times, KV102 UUIDs and request ids, KV103 per-request fields ahead of "
    "shared content, KV104 tool schemas whose key or tool order varies, KV105 retrieved chunks "
    "in another order, KV106 rewritten history, KV107 a system prompt that moves between turns, "
    "KV108 a stable part not ending on a token boundary"
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "audit",
        help="find timestamps, ids, unstable JSON, reordered chunks and other reuse breakers",
        description=(
            "Render every request (fixtures for one template, or a .jsonl of logged requests), "
            f"tokenize, and run the audit rules: {RULES_HELP}. Each finding has a rule id, "
            "severity, location, the tokens it costs and a fix."
        ),
    )
    parser.add_argument("requests", nargs="+", help="request files (.json, .jsonl) or text files")
    add_prompt_arguments(parser)
    parser.add_argument("--format", choices=FORMATS, default="text")
    parser.add_argument("--output", type=output_file,
                        help="write the report to this file instead of stdout")
    parser.add_argument(
        "--fail-on",
        default="error",
        choices=("error", "warning", "note", "never"),
        help="exit 1 when a finding is at least this severe (default: error)",
    )
    parser.add_argument("--rules", help="comma-separated rule ids to run (default: all)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvreuse.lint.audit import AUDIT_RULES, AuditInput, Severity, fixed_clocks, run_audit
    from kvreuse.lint.audit.report import to_json, to_sarif, to_text

    setup = setup_prompts(args)
    prompts = load_prompts(args.requests, setup)
    audit = AuditInput(
        prompts=tuple(prompts),
        tokenizer=setup.bundle.tokenizer,
        template=setup.template,
        clocks=fixed_clocks(),
        block_size=args.block_size,
        template_label=setup.template_label,
    )
    chosen = None if args.rules is None else [r.strip() for r in args.rules.split(",") if r]
    with progress_bar(make_console(stderr=True)) as progress:
        task = progress.add_task("audit rules", total=len(chosen or AUDIT_RULES))

        def on_rule(rule_id: str, index: int, count: int) -> None:
            progress.update(task, completed=index, description=f"rule {rule_id}")

        findings = run_audit(audit, chosen, on_rule)
    if args.format == "text":
        write_output(to_text(findings, len(prompts)), args.output)
    elif args.format == "json":
        write_output(json.dumps(to_json(findings, len(prompts)), indent=2), args.output)
    else:
        write_output(json.dumps(to_sarif(findings), indent=2), args.output)
    if args.fail_on == "never":
        return 0
    threshold = Severity.parse(args.fail_on)
    return 1 if any(f.severity >= threshold for f in findings) else 0
