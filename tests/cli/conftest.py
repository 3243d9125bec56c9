"""Fixtures for the CLI tests: a command run as a user's shell runs it, stdout a pipe."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from .plan_traces import write_trace

SRC = str(Path(__file__).resolve().parents[2] / "src")


def run_piped(args: list[str], columns: int | None) -> str:
    """`kvreuse ARGS` in a child process whose stdout is a pipe, with COLUMNS set or unset;
    its stdout (the exit status must be 0)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    if columns is not None:
        env["COLUMNS"] = str(columns)
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from kvreuse.cli.main import main; sys.exit(main())",
         *args],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def piped() -> Callable[[list[str], int | None], str]:
    """:func:`run_piped`."""
    return run_piped


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 240-request synthetic Mooncake trace for the `kvreuse plan` tests."""
    return write_trace(tmp_path_factory, 240)
