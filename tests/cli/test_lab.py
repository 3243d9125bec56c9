"""`kvreuse lab`: the command serves the page and the API on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from kvreuse.cli.main import main


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_lab_serves_the_page_and_the_api() -> None:
    """The command starts a server whose page and config answer, then stops on SIGTERM."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvreuse.cli.main", "lab", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(base + "/api/config", timeout=2) as response:
                    config = json.load(response)
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline, "kvreuse lab did not start listening"
                time.sleep(0.2)
        assert len(config["missions"]) == 4
        with urllib.request.urlopen(base + "/", timeout=5) as response:
            assert b"kvreuse lab" in response.read()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert proc.stdout is not None
    assert f"http://127.0.0.1:{port}/" in proc.stdout.read()


def test_a_port_out_of_range_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    """--port 70000 fails with a message naming the flag, before binding anything."""
    assert main(["lab", "--port", "70000"]) == 1
    assert "--port" in capsys.readouterr().err


def test_port_zero_is_a_usage_error() -> None:
    """--port 0 is rejected by argparse (exit 2)."""
    with pytest.raises(SystemExit) as info:
        main(["lab", "--port", "0"])
    assert info.value.code == 2
