"""Ctrl-C as a terminal sends it: SIGINT to the process group of a running `kvreuse` command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")


@dataclass(frozen=True, slots=True)
class Interrupted:
    """How an interrupted command ended."""

    code: int
    output: str
    """Its stdout and stderr after ``ready`` returned (``ready`` may have read some)."""
    took_s: float
    """From the SIGINT to its exit."""
    pid: int


def interrupt_kvreuse(argv: Sequence[str], ready: Callable[[subprocess.Popen[str]], None],
                      *, timeout_s: float = 60.0) -> Interrupted:
    """Start ``kvreuse ARGV`` in a session of its own (this tree's ``src`` first on
    ``PYTHONPATH``, output unbuffered, stderr into stdout), wait for ``ready(child)`` to return,
    check it is still running, SIGINT its process group and collect it. Whatever fails, the
    group is SIGKILLed before this returns."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kvreuse.cli.main import main; sys.exit(main())",
         *argv],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        ready(child)
        assert child.poll() is None, "the command ended before it could be interrupted"
        os.killpg(child.pid, signal.SIGINT)
        interrupted = time.monotonic()
        output, _ = child.communicate(timeout=timeout_s)
        return Interrupted(child.returncode, output, time.monotonic() - interrupted, child.pid)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
