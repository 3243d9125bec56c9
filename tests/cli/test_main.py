"""kvreuse's entry point: Ctrl-C ends any command in one line, not a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvreuse.testing.mooncake import synthetic_mooncake

ROOT = Path(__file__).resolve().parents[2]


def test_ctrl_c_ends_a_long_simulation_in_one_line_with_exit_130(tmp_path: Path) -> None:
    """SIGINT to a running `kvreuse simulate`'s process group: exit 130, `interrupted`, no
    traceback."""
    trace = tmp_path / "t.jsonl"
    lines = synthetic_mooncake(requests=20000, requests_per_second=20.0, documents=50)
    trace.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kvreuse.cli.main import main; sys.exit(main())",
         "simulate", "--trace", str(trace), "--replicas", "4", "--cache-tokens", "1000000",
         "--policy", "cache_aware,exact,relative_spill", "--trace-granularity", "token"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        time.sleep(2.0)
        assert child.poll() is None, "the simulation ended before it could be interrupted"
        os.killpg(child.pid, signal.SIGINT)
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    assert child.returncode == 130, out
    assert "kvreuse simulate: interrupted" in out and "Traceback" not in out, out
