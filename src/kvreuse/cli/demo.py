"""``kvreuse demo``: placeholder until the six-turn table lands."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("demo", help="the seed's six-turn chat through both indexes")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return 0
