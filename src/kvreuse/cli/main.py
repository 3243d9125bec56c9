"""The ``kvreuse`` command line: one entry point, subcommands registered by module.

Each module in :data:`COMMAND_MODULES` exposes ``register(subparsers)``, which adds its
subparser(s) and sets ``func`` (``argparse.Namespace -> int`` exit code) as the default.
Adding a command is one line here and one module; nothing is dispatched with if/elif.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Sequence

from kvreuse import __version__
from kvreuse.cli.files import StreamLost, discard_standard_output, standard_streams_reported
from kvreuse.errors import KvreuseError

COMMAND_MODULES: tuple[str, ...] = (
    "kvreuse.cli.demo",
    "kvreuse.cli.engine",
    "kvreuse.cli.route",
    "kvreuse.cli.lab",
    "kvreuse.cli.scenarios",
    "kvreuse.cli.simulate",
    "kvreuse.cli.plan",
    "kvreuse.cli.trace",
    "kvreuse.cli.replay",
    "kvreuse.cli.fingerprint",
    "kvreuse.cli.diff",
    "kvreuse.cli.audit",
    "kvreuse.cli.fixtures",
    "kvreuse.cli.hitrate",
    "kvreuse.cli.capacity",
    "kvreuse.cli.native",
)


def build_parser() -> argparse.ArgumentParser:
    """The full parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="kvreuse",
        description="Measure, simulate and route for KV-cache prefix reuse.",
    )
    parser.add_argument("--version", action="version", version=f"kvreuse {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (2 for usage errors, 1 for kvreuse errors)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        with standard_streams_reported():
            code: int = func(args)
    except KvreuseError as exc:
        _tell(f"kvreuse {args.command}: error: {exc}")
        return 1
    except KeyboardInterrupt:  # Ctrl-C: said in one line, not a traceback; 128 + SIGINT
        _tell(f"kvreuse {args.command}: interrupted")
        return 130
    except BrokenPipeError:  # the reader left (`| head`): nothing to say, and no one to say it to
        discard_standard_output()
        return 1
    except StreamLost as exc:
        discard_standard_output()
        _tell(f"kvreuse {args.command}: error: {exc}")
        return 1
    return code


def _tell(line: str) -> None:
    """One line on stderr, unless stderr is itself what failed: the exit code still says it."""
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
