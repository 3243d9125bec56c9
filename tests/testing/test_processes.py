"""Finding the processes tests start."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from kvreuse.testing.processes import Fleet, vllm_python


def test_vllm_python_prefers_the_environment_then_the_repo_venv(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """KVREUSE_VLLM_PYTHON wins when the file exists (None when not); unset, root's
    .venv-vllm interpreter is used if present."""
    explicit = tmp_path / "python"
    explicit.touch()
    monkeypatch.setenv("KVREUSE_VLLM_PYTHON", str(explicit))
    assert vllm_python(tmp_path) == str(explicit)
    monkeypatch.setenv("KVREUSE_VLLM_PYTHON", str(tmp_path / "missing"))
    assert vllm_python(tmp_path) is None
    monkeypatch.delenv("KVREUSE_VLLM_PYTHON")
    assert vllm_python(tmp_path) is None
    venv = tmp_path / ".venv-vllm" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").touch()
    assert vllm_python(tmp_path) == str(venv / "python")


# The child sleeps a little before starting its own child, as vLLM starts its engine core
# seconds after its server.
PRINT_AFFINITIES = """
import os, subprocess, sys, time
time.sleep(0.5)
print("parent", sorted(os.sched_getaffinity(0)), flush=True)
subprocess.run([sys.executable, "-c",
                "import os; print('child', sorted(os.sched_getaffinity(0)), flush=True)"])
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin one")
def test_a_process_spawned_on_a_cpu_runs_there_with_its_children(tmp_path: Path) -> None:
    """spawn(cpus={c}) runs the program and the children it starts later on CPU c only."""
    cpu = max(os.sched_getaffinity(0))
    with Fleet(tmp_path) as fleet:
        proc = fleet.spawn("pinned", [sys.executable, "-c", PRINT_AFFINITIES], cpus={cpu})
        assert proc.popen.wait(30) == 0
        time.sleep(0.1)
        lines = proc.log_path.read_text().splitlines()
    assert lines == [f"parent [{cpu}]", f"child [{cpu}]"]
