"""``kvreuse route`` and ``kvreuse engine`` flags: parsing into configuration, errors by name."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvreuse.cli.main import build_parser
from kvreuse.cli.route import build_config
from kvreuse.errors import ConfigError
from kvreuse.testing.servers import free_port


def test_route_flags_build_the_gateway_config(tmp_path: Path) -> None:
    """Upstream flags, policy options (JSON values) and knobs land in the config."""
    args = build_parser().parse_args([
        "route", "--upstream", "http://127.0.0.1:8001,name=a,events=tcp://127.0.0.1:5557",
        "--upstream", "http://127.0.0.1:8002", "--policy", "exact",
        "--policy-option", "block_size=32", "--policy-option", "balance=sglang",
        "--retries", "1",
    ])
    config = build_config(args)
    assert [u.name for u in config.upstreams] == ["a", "http://127.0.0.1:8002"]
    assert config.policy == "exact" and config.retries == 1
    assert config.policy_options == {"block_size": 32, "balance": "sglang"}


def test_route_without_upstreams_is_a_config_error() -> None:
    """No upstream at all is refused with a message saying how to give one."""
    with pytest.raises(ConfigError, match="--upstream"):
        build_config(build_parser().parse_args(["route"]))


def test_route_unknown_policy_option_is_refused() -> None:
    """A policy option the policy does not take is refused by the registry, by name."""
    from kvreuse.gateway.app import Gateway

    args = build_parser().parse_args(["route", "--upstream", "http://127.0.0.1:1",
                                      "--policy", "round_robin", "--policy-option", "k=3"])
    with pytest.raises(ConfigError, match="no option"):
        Gateway(build_config(args))


def test_engine_command_serves(tmp_path: Path) -> None:
    """`kvreuse engine` starts an OpenAI server on the port asked for."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvreuse.cli.main", "engine", "--port", str(port),
         "--model", "m", "--tpot-ms", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        response = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hello"})
        assert response.status_code == 200
        assert response.json()["usage"]["prompt_tokens"] == 2
    finally:
        process.terminate()
        process.wait(timeout=10)
