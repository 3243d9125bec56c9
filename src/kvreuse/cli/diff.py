"""``kvreuse diff A B``: where two prompts part, and what each cache reuses of B after A."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from kvreuse.cli._prompts import add_prompt_arguments, read_requests, setup_prompts
from kvreuse.errors import ConfigError
from kvreuse.lint.reuse import rules_with_block_size

if TYPE_CHECKING:
    from kvreuse.lint.diff import PromptDiff


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "diff",
        help="first divergent token of two prompts and reused tokens per cache rule",
        description=(
            "Render and tokenize two requests (or text files) and report the first divergent "
            "token, its character offset and request field, and how many tokens B reuses after "
            "A under a radix tree, vLLM blocks and an OpenAI-style 1,024 + 128k rule."
        ),
    )
    parser.add_argument("a", help="the earlier request (.json) or text file")
    parser.add_argument("b", help="the later request (.json) or text file")
    add_prompt_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(func=run)


def _single(path: str) -> tuple[str, Any]:
    requests = read_requests(path)
    if len(requests) != 1:
        raise ConfigError(f"{path} holds {len(requests)} requests; diff takes one per file")
    return requests[0]


def format_diff(result: PromptDiff, block_size: int) -> str:
    lines = [
        f"A: {result.label_a} ({result.tokens_a:,} tokens)",
        f"B: {result.label_b} ({result.tokens_b:,} tokens)",
        f"shared prefix: {result.shared:,} tokens",
    ]
    divergence = result.divergence
    if divergence is None:
        lines.append("the prompts are identical")
    else:
        lines.append(
            f"first divergent token: #{divergence.token_index:,} at character "
            f"{divergence.char_offset_a:,} of A (line {divergence.line}, column "
            f"{divergence.column}), character {divergence.char_offset_b:,} of B"
        )
        lines.append(f"field: {divergence.field_path or '(not attributable to one field)'}")
        a_piece = "<end of prompt>" if divergence.token_a is None else (
            f"{divergence.piece_a!r} (id {divergence.token_a})"
        )
        b_piece = "<end of prompt>" if divergence.token_b is None else (
            f"{divergence.piece_b!r} (id {divergence.token_b})"
        )
        lines.append(f"after {divergence.context!r}: A has {a_piece}, B has {b_piece}")
    names = {
        "radix": "radix tree",
        "vllm": f"vLLM blocks of {block_size}",
        "openai": "OpenAI-style",
    }
    width = max(len(names.get(r.rule, r.rule)) for r in result.reuse)
    lines.append(f"{'cache':{width}}  {'reused':>9}  {'recomputed':>10}")
    for reuse in result.reuse:
        label = names.get(reuse.rule, reuse.rule)
        lines.append(f"{label:{width}}  {reuse.reused:>9,}  {reuse.recomputed:>10,}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from kvreuse.lint.diff import diff_prompts
    from kvreuse.lint.prompt import build_prompt

    setup = setup_prompts(args)
    tokenizer = setup.bundle.tokenizer
    prompts = []
    for path in (args.a, args.b):
        label, request = _single(path)
        prompts.append(
            build_prompt(request, tokenizer=tokenizer, template=setup.template, label=label)
        )
    result = diff_prompts(
        prompts[0],
        prompts[1],
        tokenizer=tokenizer,
        template=setup.template,
        rules=rules_with_block_size(args.block_size),
    )
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(format_diff(result, args.block_size))
    return 0
