"""``kvreuse route`` and ``kvreuse engine`` flags: parsing into configuration, errors by name."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvreuse.cli.main import build_parser
from kvreuse.cli.route import build_config
from kvreuse.errors import ConfigError
from kvreuse.testing.processes import EngineSpec, Fleet, Process
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


def test_route_prefill_flags_land_in_the_config() -> None:
    """--prefill-rate, --prefill-overhead and --fixed-prefill; by default the gateway measures."""
    config = build_config(build_parser().parse_args([
        "route", "--upstream", "http://127.0.0.1:8001", "--prefill-rate", "3000",
        "--prefill-overhead", "0.01", "--fixed-prefill"]))
    assert (config.prefill_tokens_per_s, config.prefill_overhead_s) == (3000.0, 0.01)
    assert config.learn_prefill is False
    plain = build_config(build_parser().parse_args(["route", "--upstream", "http://h:1"]))
    assert plain.learn_prefill is True and plain.prefill_tokens_per_s == 10_000.0
    with pytest.raises(ConfigError, match="prefill_tokens_per_s"):
        build_config(build_parser().parse_args([
            "route", "--upstream", "http://127.0.0.1:8001", "--prefill-rate", "0"]))


def test_route_kv_event_and_budget_flags_land_in_the_config() -> None:
    """The frame cap, the sequence window and the budget factor; capacity_tokens per upstream;
    nonsense values refused."""
    args = build_parser().parse_args([
        "route", "--upstream", "http://127.0.0.1:8001,events=tcp://127.0.0.1:5557,"
        "capacity_tokens=65536", "--kv-events-max-frame-bytes", "1048576",
        "--kv-events-seq-window", "500", "--index-budget-factor", "1.5",
    ])
    config = build_config(args)
    assert config.kv_events_max_frame_bytes == 1 << 20 and config.kv_events_seq_window == 500
    assert config.index_budget_factor == 1.5 and config.upstreams[0].capacity_tokens == 65536
    with pytest.raises(ConfigError, match="kv_events_seq_window"):
        build_config(build_parser().parse_args([
            "route", "--upstream", "http://127.0.0.1:8001", "--kv-events-seq-window", "0"]))
    with pytest.raises(ConfigError, match="capacity_tokens"):
        build_config(build_parser().parse_args([
            "route", "--upstream", "http://127.0.0.1:8001,capacity_tokens=lots"]))


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


def wait_for_line(proc: Process, needle: str, timeout_s: float = 20.0) -> str:
    """The first line of ``proc``'s output containing ``needle`` (waits for it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in proc.log_path.read_text(errors="replace").splitlines():
            if needle in line:
                return line
        time.sleep(0.1)
    raise AssertionError(f"{proc.name} never printed {needle!r}:\n{proc.log_tail()}")


def test_route_and_engine_announce_themselves_and_log_each_request(tmp_path: Path) -> None:
    """Real processes: each prints one start-up line; the gateway serves /metrics only on
    --metrics-port, writes a JSON access line per request and warns about a failed upstream
    at the default log level."""
    with Fleet(tmp_path) as fleet:
        engine = fleet.start_engine("engine0", EngineSpec(events=False))
        engine_line = wait_for_line(engine, "kvreuse engine: serving")
        assert engine.url in engine_line and "models sim," in engine_line
        metrics_port = free_port()
        dead = f"http://127.0.0.1:{free_port()}"
        gateway = fleet.start_gateway(
            "gateway", [engine], policy="round_robin",
            extra_args=["--metrics-port", str(metrics_port), "--access-log", "json",
                        "--upstream", f"{dead},name=dead,models=sim", "--eject-after", "5",
                        "--health-interval", "60"])
        line = wait_for_line(gateway, "kvreuse route: serving")
        assert gateway.url in line and "policy round_robin" in line
        assert f"engine0={engine.url} (sim)" in line and f"dead={dead} (sim)" in line
        assert f"/metrics on port {metrics_port}" in line and "access log json" in line
        assert "prefill speed measured from first tokens, from 10000 tokens/s" in line
        assert gateway.log_path.read_text().count("kvreuse route: serving") == 1
        assert httpx.get(gateway.url + "/metrics").status_code == 404
        page = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics")
        assert page.status_code == 200 and "process_cpu_seconds_total" in page.text
        assert httpx.get(f"http://127.0.0.1:{metrics_port}/v1/models").status_code == 404
        for _ in range(2):  # round robin: one of the two goes to the dead upstream first
            body = {"model": "sim", "prompt": "hello", "max_tokens": 1}
            assert httpx.post(gateway.url + "/v1/completions", json=body).status_code == 200
        warning = wait_for_line(gateway, "upstream dead failed")
        assert "WARNING kvreuse.gateway.proxy" in warning
        def access_records() -> list[dict[str, object]]:
            return [json.loads(text) for text in gateway.log_path.read_text().splitlines()
                    if text.startswith('{"time"')]

        deadline = time.monotonic() + 20
        while len(access_records()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        records = access_records()
        assert len(records) == 2 and {r["status"] for r in records} == {200}
        assert sorted(r["retries"] for r in records) == [0, 1]
        assert all(r["upstream"] == "engine0" and r["model"] == "sim" for r in records)


def test_route_names_the_flag_of_a_port_in_use() -> None:
    """A --metrics-port already taken: exit 1 with an error naming the flag and the port."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "kvreuse.cli.main", "route", "--upstream",
             "http://127.0.0.1:1", "--port", str(free_port()), "--metrics-port", str(port)],
            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}" in result.stderr


def test_route_refuses_an_events_endpoint_it_cannot_bind_before_serving() -> None:
    """Two upstreams binding one KV-event endpoint: exit 1 naming the second upstream and the
    endpoint, before the server starts (it was a traceback from the server's start-up)."""
    events = f"tcp://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [sys.executable, "-m", "kvreuse.cli.main", "route", "--port", str(free_port()),
         "--upstream", f"http://127.0.0.1:1,name=a,models=m,events={events}",
         "--upstream", f"http://127.0.0.1:2,name=b,models=m,events={events}"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"upstream b: cannot bind events {events}: Address already in use" in result.stderr
    assert "Traceback" not in result.stderr and "serving" not in result.stdout


@pytest.mark.parametrize(
    ("flags", "needle"),
    [(["--kv-events", "http://127.0.0.1:5557"], "--kv-events must be a ZeroMQ endpoint"),
     (["--kv-events-replay", "tcp://*:5558"], "--kv-events-replay needs --kv-events"),
     (["--port", "70000"], "must be a port, 0 to 65535")],
)
def test_engine_refuses_bad_endpoints_and_ports_in_one_line(flags: list[str], needle: str) -> None:
    """A malformed endpoint or port exits with a one-line error before anything is served."""
    result = subprocess.run([sys.executable, "-m", "kvreuse.cli.main", "engine", *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and needle in result.stderr
    assert "Traceback" not in result.stderr and "serving" not in result.stdout


def test_engine_refuses_a_kv_events_endpoint_in_use_before_serving() -> None:
    """A KV-event endpoint another process holds: exit 1 naming it, nothing served."""
    import zmq

    context = zmq.Context()
    holder = context.socket(zmq.PUB)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    try:
        result = subprocess.run(
            [sys.executable, "-m", "kvreuse.cli.main", "engine", "--port", "0",
             "--kv-events", f"tcp://*:{port}"],
            capture_output=True, text=True, timeout=60)
    finally:
        holder.close(linger=0)
        context.term()
    assert result.returncode == 1
    assert f"KV events: cannot use tcp://*:{port}: Address already in use" in result.stderr
    assert "Traceback" not in result.stderr and "serving" not in result.stdout


def test_engine_announces_the_port_it_was_given_for_port_0() -> None:
    """--port 0 serves on a free port, and the start-up line names that port, not 0."""
    engine = subprocess.Popen([sys.executable, "-m", "kvreuse.cli.main", "engine", "--port", "0"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout is not None
        line = engine.stdout.readline()
        url = line.split("serving ", 1)[1].split(" ", 1)[0]
        assert not url.endswith(":0")
        deadline = time.monotonic() + 20
        while True:
            try:
                assert httpx.get(f"{url}/health", timeout=1).status_code == 200
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, f"nothing answered at {url}"
                time.sleep(0.1)
    finally:
        engine.terminate()
        engine.wait(timeout=20)
