"""Timing side channel against real vLLM (CPU build, the tiny random Llama of tests/vllm).

One vLLM replica with prefix caching behind `kvreuse route`. Without tenants the attacker's
probe of a prompt the victim sent reaches its first token measurably sooner than a fresh prompt
of the same length; with tenant keys the gateway injects per-tenant ``cache_salt`` and vLLM
neither reuses the victim's blocks (``cached_tokens`` = 0) nor shows a timing gap.

Runs when a vLLM interpreter exists (``KVREUSE_VLLM_PYTHON`` or ``.venv-vllm``; ``make vllm-env``)
and skips otherwise, unless ``KVREUSE_REQUIRE_VLLM=1`` (``make test``) makes that a failure.
Start-up of the replica takes 40-100 s on two cores.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvreuse.testing.processes import Fleet, Process, free_port, vllm_python, wait_http
from kvreuse.testing.timing import ProbeResult, probe

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = 30
PROMPT_TOKENS = 1536  # max-model-len is 2048; 48 blocks of 32
VOCAB = 8192
TENANTS = """\
secret = "side-channel-test-secret-0123456789"
[keys]
"sk-victim" = "victim"
"sk-attacker" = "attacker"
"""


PYTHON = vllm_python(ROOT)
if PYTHON is None and os.environ.get("KVREUSE_REQUIRE_VLLM") == "1":
    raise RuntimeError("KVREUSE_REQUIRE_VLLM=1 but no vLLM interpreter: run `make vllm-env` or "
                       "set KVREUSE_VLLM_PYTHON")
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(PYTHON is None, reason="no vLLM interpreter (make vllm-env)")]


def prompt(i: int, salt: int) -> list[int]:
    rng = random.Random(salt * 100_003 + i)
    return [rng.randrange(10, VOCAB) for _ in range(PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, Process]]:
    """One vLLM replica with prefix caching (the recipe of tests/vllm/vllm_fleet.py)."""
    assert PYTHON is not None
    model = Path(os.environ.get("KVREUSE_TINY_MODEL", ROOT / "build" / "tiny-llama")).resolve()
    subprocess.run([PYTHON, str(ROOT / "tests" / "vllm" / "build_tiny_model.py"), str(model)],
                   check=True, capture_output=True)
    port = free_port()
    argv = [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "tiny-llama", "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", "2048", "--block-size", "32",
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--enforce-eager", "-O0", "--max-num-seqs", "8"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "OMP_NUM_THREADS": "1"}
    with Fleet(tmp_path_factory.mktemp("sidechannel-vllm")) as fleet:
        proc = fleet.spawn("vllm", argv, env=env, url=f"http://127.0.0.1:{port}", port=port)
        wait_http(proc, "/v1/models", timeout_s=float(
            os.environ.get("KVREUSE_VLLM_START_TIMEOUT", "600")))
        yield fleet, proc


def test_vllm_without_salts_leaks_another_tenants_prompt(replica: tuple[Fleet, Process]
                                                         ) -> None:
    """No salts: the victim's cached prompt comes back faster to the attacker (p < 1e-3)."""
    fleet, vllm = replica
    gateway = fleet.start_gateway("gw-open", [vllm], policy="round_robin")
    result = probe(gateway.url, samples=SAMPLES, secret=lambda i: prompt(i, 1),
                   cold=lambda i: prompt(i, 2), suffix=[7, 7, 7, 7], model="tiny-llama",
                   victim={}, attacker={})
    fleet.forget(gateway)
    report("vllm, no salts", result)
    assert result.cross_tenant_cached_tokens >= SAMPLES * (PROMPT_TOKENS - 32)
    assert result.test.p_less < 1e-3


def test_vllm_tenant_salts_hide_another_tenants_prompt(replica: tuple[Fleet, Process],
                                                       tmp_path: Path) -> None:
    """Tenant salts from the gateway: no reuse across tenants and no detectable gap."""
    fleet, vllm = replica
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    gateway = fleet.start_gateway("gw-salted", [vllm], policy="round_robin",
                                  extra_args=["--tenants", str(tenants)])
    result = probe(gateway.url, samples=SAMPLES, secret=lambda i: prompt(i, 3),
                   cold=lambda i: prompt(i, 4), suffix=[7, 7, 7, 7], model="tiny-llama",
                   victim={"authorization": "Bearer sk-victim"},
                   attacker={"authorization": "Bearer sk-attacker"})
    fleet.forget(gateway)
    report("vllm, tenant salts", result)
    assert result.cross_tenant_cached_tokens == 0
    assert result.test.p_less > 1e-3


def report(label: str, result: ProbeResult) -> None:
    print(label, json.dumps({"median_gap_ms": result.median_gap_ms,
                             "cross_tenant_cached_tokens": result.cross_tenant_cached_tokens}),
          result.test)
