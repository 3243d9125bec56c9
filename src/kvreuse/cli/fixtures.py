"""``kvreuse fixtures record|check``: golden leading-token fingerprints per revision.

``record`` stores each fixture's fingerprint under the current tokenizer, template and model
revisions. ``check`` recomputes them; a changed fixture reports which revision changed, where
the tokens first differ, the reuse it loses and (given traffic) the cold-cache period after the
deploy. ``check`` also runs the built-in block-rule probes on every fixture.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvreuse.cli._prompts import add_prompt_arguments, load_prompts, setup_prompts
from kvreuse.cli.args import bounded, positive_float, positive_int, read_bytes
from kvreuse.cli.files import write_whole
from kvreuse.errors import InputFormatError
from kvreuse.json_input import parse_json
from kvreuse.lint.fingerprint import DEFAULT_PREFIX_TOKENS, PrefixFingerprint, fingerprint
from kvreuse.lint.fixtures import (
    BlockRuleCheck,
    ColdCache,
    FixtureCheck,
    GoldenRecord,
    Traffic,
    block_rule_checks,
    check_fixture,
    dump_golden,
    load_golden,
    predict_cold_cache,
    record_golden,
)
from kvreuse.lint.reuse import rules_with_block_size

if TYPE_CHECKING:
    from kvreuse.lint.prompt import Prompt


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "fixtures", help="record or check golden leading-token fingerprints of prompt fixtures"
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, func, help_text in (
        ("record", run_record, "store the fixtures' fingerprints under the current revisions"),
        ("check", run_check, "compare the fixtures with the golden file and run block probes"),
    ):
        sub = actions.add_parser(name, help=help_text)
        sub.add_argument("fixtures", nargs="+", help="fixture request files (.json, .jsonl)")
        sub.add_argument("--golden", required=True, help="golden JSON file")
        add_prompt_arguments(sub)
        sub.add_argument("--tokens", type=int, default=DEFAULT_PREFIX_TOKENS)
        sub.set_defaults(func=func)
    check = actions.choices["check"]
    check.add_argument("--json", action="store_true", help="print JSON instead of text")
    check.add_argument(
        "--rps", type=bounded(positive_float, 1e9),
        help="requests per second (cold-cache prediction)",
    )
    check.add_argument(
        "--prefixes", type=bounded(positive_int, 10**9), help="distinct prefixes in traffic"
    )
    check.add_argument("--replicas", type=bounded(positive_int, 10**6), default=1)
    check.add_argument(
        "--affinity", action="store_true", help="routing keeps each prefix on one replica"
    )


def _current(args: argparse.Namespace) -> tuple[list[Prompt], dict[str, PrefixFingerprint], Any]:
    setup = setup_prompts(args)
    prompts = load_prompts(args.fixtures, setup)
    current = {
        p.label: fingerprint(
            p.ids, n=args.tokens, block_size=args.block_size, revisions=setup.revisions
        )
        for p in prompts
    }
    return prompts, current, setup


def _read_golden(path: Path) -> list[GoldenRecord]:
    if not path.exists():
        return []
    data = parse_json(read_bytes(str(path), "--golden"), str(path))
    return load_golden(data, str(path))


def run_record(args: argparse.Namespace) -> int:
    _, current, setup = _current(args)
    path = Path(args.golden)
    records = record_golden(_read_golden(path), current, setup.revisions)
    write_whole(path, json.dumps(dump_golden(records), indent=2) + "\n", "--golden")
    print(f"recorded {len(current)} fixture(s) in {path} ({len(records)} revision record(s))")
    return 0


def _describe(check: FixtureCheck, cold: ColdCache | None, block_size: int) -> str:
    if check.status != "changed":
        revisions = (
            f" (revisions changed: {', '.join(check.changed_revisions)}; tokens identical)"
            if check.changed_revisions
            else ""
        )
        return f"{check.name}: {check.status}{revisions}"
    cause = (
        f"{', '.join(check.changed_revisions)} revision changed"
        if check.changed_revisions
        else "prompt content changed under the same revisions"
    )
    block = check.first_changed_block
    where = (
        "beyond the fingerprinted prefix"
        if block is None
        else f"first changed block {block} (tokens {block * block_size}-"
        f"{(block + 1) * block_size - 1})"
    )
    text = (
        f"{check.name}: CHANGED ({cause}); {where}; vLLM reuse of the old cache "
        f"{check.reused_before:,} -> {check.reused_after:,} tokens"
    )
    if cold is not None:
        text += (
            f"; cold cache: {cold.cold_copies:,} cold copies recompute "
            f"{cold.extra_prefill_tokens:,} tokens, 63% warm after "
            f"{cold.seconds_to_63_percent:,.0f} s, 95% after "
            f"{cold.seconds_to_95_percent:,.0f} s"
        )
    return text


def _probe_lines(name: str, checks: list[BlockRuleCheck]) -> list[str]:
    lines = []
    for probe in checks:
        status = "ok" if probe.ok else "MISMATCH"
        observed = ", ".join(f"{rule} {value}" for rule, value in probe.observed.items())
        line = f"  {name}: {probe.probe}: {status} ({observed})"
        if not probe.ok:
            expected = ", ".join(f"{rule} {value}" for rule, value in probe.expected.items())
            line += f"; expected {expected}"
        lines.append(line)
    return lines


def run_check(args: argparse.Namespace) -> int:
    prompts, current, setup = _current(args)
    records = _read_golden(Path(args.golden))
    if not records:
        raise InputFormatError(
            "no golden records; run `kvreuse fixtures record` first", where=args.golden
        )
    matching = [r for r in records if r.revisions == setup.revisions]
    golden = (matching or records)[-1]
    traffic = None
    if args.rps is not None or args.prefixes is not None:
        traffic = Traffic(args.rps or 0.0, args.prefixes or 0, args.replicas, args.affinity)
    names = sorted(set(current) | set(golden.fixtures))
    checks = [check_fixture(n, golden.fixtures.get(n), current.get(n)) for n in names]
    second = load_prompts(args.fixtures, setup)  # an independent render for the identical probe
    rules = rules_with_block_size(args.block_size)
    probes = {
        first.label: block_rule_checks(
            first.ids, again.ids, block_size=args.block_size, rules=rules
        )
        for first, again in zip(prompts, second, strict=True)
        if len(first) >= 4
    }
    failed = any(c.status != "same" for c in checks) or any(
        not probe.ok for group in probes.values() for probe in group
    )
    colds = {
        c.name: predict_cold_cache(c.lost_tokens, traffic) if traffic and c.status == "changed"
        else None
        for c in checks
    }
    if args.json:
        print(json.dumps(_to_json(checks, colds, probes), indent=2))
    else:
        for check in checks:
            print(_describe(check, colds[check.name], args.block_size))
        print("built-in block-rule probes:")
        for name, group in probes.items():
            print("\n".join(_probe_lines(name, group)))
        if traffic is None and any(c.status == "changed" for c in checks):
            print("pass --rps and --prefixes to predict the cold-cache period")
    return 1 if failed else 0


def _to_json(
    checks: list[FixtureCheck],
    colds: dict[str, ColdCache | None],
    probes: dict[str, list[BlockRuleCheck]],
) -> dict[str, Any]:
    def cold_json(cold: ColdCache | None) -> dict[str, Any] | None:
        if cold is None:
            return None
        return {
            "cold_copies": cold.cold_copies,
            "extra_prefill_tokens": cold.extra_prefill_tokens,
            "seconds_to_63_percent": cold.seconds_to_63_percent,
            "seconds_to_95_percent": cold.seconds_to_95_percent,
        }

    return {
        # a check's fields, in order, then its cold-cache prediction
        "fixtures": [{**asdict(c), "cold_cache": cold_json(colds[c.name])} for c in checks],
        "probes": {
            name: [
                {
                    "probe": p.probe,
                    "change_at": p.change_at,
                    "ok": p.ok,
                    "expected": dict(p.expected),
                    "observed": dict(p.observed),
                }
                for p in group
            ]
            for name, group in probes.items()
        },
    }
