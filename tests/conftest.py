"""Settings for the whole suite."""

from __future__ import annotations

import signal

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Let the suite's child processes be interrupted as at a terminal.

    A shell without job control (a CI step, ``nohup ... &`` in a script) starts a background
    command with SIGINT ignored. Children inherit that, and a Python started so never raises
    KeyboardInterrupt: every Ctrl-C test then fails with the command finishing normally. A
    handler, unlike an ignored signal, is reset to the default at exec, so one installed
    here gives every child the signal back.
    """
    del config
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
