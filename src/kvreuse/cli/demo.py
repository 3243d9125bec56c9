"""``kvreuse demo``: seed 001's six-turn chat table through both real indexes."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from kvreuse.cli.args import positive_int
from kvreuse.cli.tables import make_console, print_table
from kvreuse.six_turn import ChatShape, run_six_turn


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="the seed's six-turn chat through the radix and block indexes",
        description="Replay the six-turn chat (1,500-token system prompt, 150-token user "
        "messages, 250-token answers inserted at finish) through a RadixIndex and a vLLM-style "
        "BlockIndex and print the prefill table.",
    )
    parser.add_argument("--system-tokens", type=positive_int, default=1500)
    parser.add_argument("--user-tokens", type=positive_int, default=150)
    parser.add_argument("--answer-tokens", type=positive_int, default=250)
    parser.add_argument("--turns", type=positive_int, default=6)
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    shape = ChatShape(
        args.system_tokens, args.user_tokens, args.answer_tokens, args.turns, args.block_size
    )
    result = run_six_turn(shape)
    if args.json:
        print(json.dumps({
            "rows": [asdict(r) for r in result.rows],  # turn, prompt_tokens, radix/block_prefilled
            "total_prompt_tokens": result.total_prompt_tokens,
            "total_radix_prefilled": result.total_radix_prefilled,
            "total_block_prefilled": result.total_block_prefilled,
        }))
        return 0
    rows = [
        [str(r.turn), f"{r.prompt_tokens:,}", f"{r.radix_prefilled:,}", f"{r.block_prefilled:,}"]
        for r in result.rows
    ]
    total = result.total_prompt_tokens
    rows.append([
        "total", f"{total:,}", f"{result.total_radix_prefilled:,}",
        f"{result.total_block_prefilled:,}",
    ])
    console = make_console()
    print_table(
        console, "The six-turn chat: prefill tokens per turn",
        ("turn", "prompt\ntokens", "prefilled\n(radix)",
         f"prefilled (blocks\nof {shape.block_size})"),
        rows, text_columns=(),
    )
    saved = 1 - result.total_radix_prefilled / total
    console.print(
        f"Radix tree: {saved:.0%} less prefill than no cache. Block index: "
        f"{1 - result.total_block_prefilled / total:.0%} less (whole blocks only, and at most "
        "prompt - 1 tokens are reused)."
    )
    return 0
