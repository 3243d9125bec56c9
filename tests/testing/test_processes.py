"""Finding the processes tests start."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvreuse.testing.processes import vllm_python


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
