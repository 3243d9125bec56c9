"""Fixtures for the real-vLLM tests: two vLLM replicas for the session, a gateway per test.

The tests run when a vLLM interpreter is found (``KVREUSE_VLLM_PYTHON``, else ``.venv-vllm``);
otherwise they are skipped, unless ``KVREUSE_REQUIRE_VLLM=1`` (set by ``make test``) makes that
a failure.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvreuse.gateway.app import Gateway
from kvreuse.gateway.config import GatewayConfig, UpstreamConfig
from kvreuse.gateway.prompts import HFPromptTokenizer
from kvreuse.testing.processes import vllm_python
from kvreuse.testing.servers import ServerThread

from .vllm_fleet import ALIAS_NAME, MODEL_NAME, Replica, build_model, launch, wait_ready

ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    ours = [item for item in items if Path(str(item.fspath)).is_relative_to(here)]
    for item in ours:
        item.add_marker(pytest.mark.vllm)
    if ours and vllm_python(ROOT) is None:
        if os.environ.get("KVREUSE_REQUIRE_VLLM") == "1":
            raise pytest.UsageError(
                "KVREUSE_REQUIRE_VLLM=1 but no vLLM interpreter: run `make vllm-env` or set "
                "KVREUSE_VLLM_PYTHON (see DEVELOPERS.md)"
            )
        skip = pytest.mark.skip(reason="no vLLM interpreter (make vllm-env, or set "
                                "KVREUSE_VLLM_PYTHON; see DEVELOPERS.md)")
        for item in ours:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    python = vllm_python(ROOT)
    assert python is not None
    out = Path(os.environ.get("KVREUSE_TINY_MODEL", ROOT / "build" / "tiny-llama"))
    return build_model(python, out.resolve())


@pytest.fixture(scope="session")
def replicas(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    """Two vLLM replicas, started in parallel (~40-100 s), for the whole session; the second
    also serves the model as ``ALIAS_NAME``."""
    python = vllm_python(ROOT)
    assert python is not None
    log_dir = Path(os.environ.get("KVREUSE_VLLM_LOGS", tmp_path_factory.mktemp("vllm-logs")))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = [launch("vllm0", python, model_dir, log_dir),
               launch("vllm1", python, model_dir, log_dir, served=(MODEL_NAME, ALIAS_NAME))]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda r: wait_ready([r]), started))
        yield started
    finally:
        for replica in started:
            replica.stop()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> HFPromptTokenizer:
    return HFPromptTokenizer(model_dir)


@dataclass
class LiveGateway:
    server: ServerThread
    gateway: Gateway

    @property
    def url(self) -> str:
        return self.server.url

    def events_settled(self, quiet_s: float = 0.3, timeout_s: float = 10.0) -> None:
        """Wait until no KV-event batch has arrived for ``quiet_s`` (vLLM publishes each
        engine step's events right away, so silence means the gateway has caught up)."""
        deadline = time.monotonic() + timeout_s
        last = -1
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            seen = sum(s.stats.batches for s in self.gateway.subscribers)
            if seen != last:
                last, quiet_since = seen, time.monotonic()
            elif time.monotonic() - quiet_since >= quiet_s:
                return
            time.sleep(0.02)


def wait_released(endpoints: list[str], timeout_s: float = 10.0) -> None:
    """Wait until no socket listens on the ``tcp://127.0.0.1:P`` endpoints a gateway binds:
    the previous test's gateway closed its SUB sockets, but ZeroMQ's I/O thread unbinds them
    a moment later, and a bind in that moment fails with "Address already in use" (seen once
    in a fresh-clone run). Probes as ZeroMQ binds (SO_REUSEADDR), so only a listener blocks."""
    deadline = time.monotonic() + timeout_s
    for endpoint in endpoints:
        port = int(endpoint.rsplit(":", 1)[1])
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind(("127.0.0.1", port))  # fails while a socket listens there
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{endpoint} still bound after {timeout_s} s") from None
            time.sleep(0.05)


@pytest.fixture
def gateway_for(replicas: list[Replica], tokenizer: HFPromptTokenizer
                ) -> Iterator[Callable[..., LiveGateway]]:
    """Start a gateway in front of (some of) the replicas; stopped after the test."""
    running: list[LiveGateway] = []

    def start(chosen: list[Replica] | None = None,
              upstreams: tuple[UpstreamConfig, ...] | None = None,
              **options: object) -> LiveGateway:
        """``upstreams``, when given, replaces the replicas' own entries (e.g. proxies)."""
        if upstreams is None:
            wait_released([r.events for r in chosen or replicas])
            upstreams = tuple(
                UpstreamConfig(r.url, name=r.name, events=r.events, replay=r.replay,
                               topic="kv-events")
                for r in (chosen or replicas)
            )
        settings: dict[str, object] = {"policy": "exact", "metrics_interval_s": 0.5,
                                       "health_interval_s": 1.0}
        settings.update(options)
        if settings["policy"] in ("exact", "cache_aware", "cache_aware_sglang"):
            # The policies' own block-hash mirror must use vLLM's block size.
            settings.setdefault("policy_options", {"block_size": 32})
        gateway = Gateway(GatewayConfig(upstreams=upstreams, **settings),  # type: ignore[arg-type]
                          tokenizer=tokenizer)
        live = LiveGateway(ServerThread(gateway.app).start(), gateway)
        time.sleep(0.5)  # vLLM's PUB sockets reconnect to the newly bound SUB sockets
        running.append(live)
        return live

    yield start
    for live in running:
        live.server.stop()
