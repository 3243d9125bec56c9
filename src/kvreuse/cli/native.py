"""``kvreuse native``: build, remove or report the compiled core (:mod:`kvreuse.native`)."""

from __future__ import annotations

import argparse
from typing import Any

from kvreuse import native


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "native",
        help="build, remove or report the mypyc-compiled core of the simulator and routers",
    )
    parser.add_argument(
        "action",
        nargs="?",
        choices=("status", "build", "clean"),
        default="status",
        help="status (default): which core runs and why; build: compile it (needs mypy, "
        "setuptools and a C compiler); clean: remove it",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="show the compiler's output")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "build":
        code = native.build(verbose=args.verbose)
        if code != 0:
            print(f"kvreuse native: the build failed (exit {code}); the pure core stays in use")
            return code
        # This process chose its core at start; the new build is for the next ones.
        print(f"kvreuse native: built; new processes will run {native.decide().reason}")
        return 0
    if args.action == "clean":
        print(f"kvreuse native: removed {native.clean()} files; new processes run pure Python")
        return 0
    print(f"this process: {native.status().reason}")
    print(f"a new process: {native.decide().reason}")
    return 0
