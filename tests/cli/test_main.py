"""kvreuse's entry point: Ctrl-C ends any command in one line, not a traceback."""

from __future__ import annotations

import time
from pathlib import Path

from kvreuse.testing.mooncake import synthetic_mooncake

from .interrupt import interrupt_kvreuse


def test_ctrl_c_ends_a_long_simulation_in_one_line_with_exit_130(tmp_path: Path) -> None:
    """SIGINT to a running `kvreuse simulate`'s process group: exit 130, `interrupted`, no
    traceback."""
    trace = tmp_path / "t.jsonl"
    lines = synthetic_mooncake(requests=20000, requests_per_second=20.0, documents=50)
    trace.write_text("\n".join(lines) + "\n")
    stopped = interrupt_kvreuse(
        ["simulate", "--trace", str(trace), "--replicas", "4", "--cache-tokens", "1000000",
         "--policy", "cache_aware,exact,relative_spill", "--trace-granularity", "token"],
        lambda child: time.sleep(2.0))
    out = stopped.output
    assert stopped.code == 130, out
    assert "kvreuse simulate: interrupted" in out and "Traceback" not in out, out
