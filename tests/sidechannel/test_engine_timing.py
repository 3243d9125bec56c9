"""Timing side channel against `kvreuse engine` (fast; the real-vLLM twin is test_vllm_timing.py).

Without salts an attacker tells a prompt another tenant cached from one nobody sent; through the
gateway with tenant salts it cannot (seed 004). The engine's own report of reused tokens makes
the same point without statistics: zero cross-tenant cached tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvreuse.testing.loadgen import tokens_text
from kvreuse.testing.processes import EngineSpec, Fleet, Process
from kvreuse.testing.timing import probe
from kvreuse.tokens import pack

SAMPLES = 30
PROMPT_TOKENS = 1024  # 50 ms of prefill at 20k tokens/s: a gap far above the noise
TENANTS = """\
secret = "side-channel-test-secret-0123456789"
[keys]
"sk-victim" = "victim"
"sk-attacker" = "attacker"
"""


def secret_prompt(i: int) -> str:
    return tokens_text(pack(range(1_000_000 + i * PROMPT_TOKENS,
                                  1_000_000 + (i + 1) * PROMPT_TOKENS)))


def cold_prompt(i: int) -> str:
    return tokens_text(pack(range(5_000_000 + i * PROMPT_TOKENS,
                                  5_000_000 + (i + 1) * PROMPT_TOKENS)))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with Fleet(tmp_path_factory.mktemp("sidechannel")) as started:
        yield started


@pytest.fixture(scope="module")
def engine(fleet: Fleet) -> Process:
    spec = EngineSpec(model="sim", cache_tokens=262_144, prefill_tokens_per_s=20_000.0,
                      overhead_ms=5.0, tpot_ms=1.0, events=False)
    return fleet.start_engine("engine", spec)


def test_without_salts_another_tenants_prompt_is_detectable(fleet: Fleet, engine: Process
                                                            ) -> None:
    """No tenants: the attacker's probe of the victim's prompt is measurably faster."""
    gateway = fleet.start_gateway("gw-open", [engine], policy="round_robin")
    result = probe(gateway.url, samples=SAMPLES, secret=secret_prompt, cold=lambda i:
                   cold_prompt(i), suffix="zzzz", model="sim", victim={}, attacker={})
    fleet.forget(gateway)
    print(f"no salts: gap {result.median_gap_ms:.1f} ms, p={result.test.p_less:.2g}")
    assert result.cross_tenant_cached_tokens >= SAMPLES * (PROMPT_TOKENS - 16)
    assert result.test.p_less < 1e-4


def test_tenant_salts_hide_another_tenants_prompt(fleet: Fleet, engine: Process,
                                                  tmp_path: Path) -> None:
    """Tenant keys: the gateway salts each tenant; the probe gets no hit and no timing gap."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    gateway = fleet.start_gateway("gw-salted", [engine], policy="round_robin",
                                  extra_args=["--tenants", str(tenants)])
    result = probe(gateway.url, samples=SAMPLES,
                   secret=lambda i: secret_prompt(SAMPLES + i),
                   cold=lambda i: cold_prompt(SAMPLES + i), suffix="zzzz", model="sim",
                   victim={"authorization": "Bearer sk-victim"},
                   attacker={"authorization": "Bearer sk-attacker"})
    fleet.forget(gateway)
    print(f"salted: gap {result.median_gap_ms:.1f} ms, p={result.test.p_less:.2g}")
    assert result.cross_tenant_cached_tokens == 0
    assert result.test.p_less > 1e-3
