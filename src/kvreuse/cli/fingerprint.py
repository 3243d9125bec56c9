"""``kvreuse fingerprint``: the leading-token fingerprint of each request, as JSON (no prompt text).

Log it with every observation or deploy so a hit-rate change can be tied to the prompt revision
that caused it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvreuse.cli._prompts import add_prompt_arguments, load_prompts, setup_prompts
from kvreuse.lint.fingerprint import DEFAULT_PREFIX_TOKENS, fingerprint


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "fingerprint",
        help="sha256 of a prompt's leading tokens plus tokenizer/template/model revisions",
        description=(
            "Render each request through the chat template, tokenize it, and print a JSON "
            "fingerprint of its first N tokens (aligned down to whole cache blocks) with the "
            "tokenizer, template and model revisions. One JSON object per request."
        ),
    )
    parser.add_argument("requests", nargs="+", help="request files (.json, .jsonl) or text files")
    add_prompt_arguments(parser)
    parser.add_argument(
        "--tokens",
        type=int,
        default=DEFAULT_PREFIX_TOKENS,
        help="leading tokens to fingerprint, a multiple of --block-size (default 2048)",
    )
    parser.add_argument("--blocks", action="store_true", help="include per-block chained hashes")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    setup = setup_prompts(args)
    for prompt in load_prompts(args.requests, setup):
        result = fingerprint(
            prompt.ids, n=args.tokens, block_size=args.block_size, revisions=setup.revisions
        ).to_json()
        if not args.blocks:
            del result["block_hashes"]
        print(json.dumps({"source": prompt.label, **result}))
    return 0
