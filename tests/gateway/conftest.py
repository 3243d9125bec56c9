"""Fixtures for the gateway tests: a tokenizer directory, simulated engines, gateways."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvreuse.gateway.app import Gateway
from kvreuse.gateway.config import GatewayConfig, UpstreamConfig
from kvreuse.gateway.prompts import TextApproximation
from kvreuse.gateway.serve import uvicorn_options
from kvreuse.testing.processes import Fleet
from kvreuse.testing.servers import ServerThread
from kvreuse.testing.tiny_tokenizer import build_tokenizer_dir

from .fleet import Engine, RunningGateway, start_engine


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer with a chat template (no download, ~0.2 s)."""
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"), vocab_size=2000,
                               corpus_lines=3000)


@pytest.fixture(scope="module")
def engines() -> Iterator[list[Engine]]:
    """Two simulated replicas publishing KV events (one map-shaped, one array-shaped)."""
    pair = [start_engine("e0"), start_engine("e1", shape="array")]
    yield pair
    for engine in pair:
        engine.server.stop()


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    """One simulated replica without KV events, e0."""
    one = start_engine("e0", events=False)
    yield one
    one.server.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Processes (misbehaving upstreams, engines, gateways) the module's tests start; all are
    stopped after its last test."""
    with Fleet(tmp_path_factory.mktemp("fleet")) as processes:
        yield processes


@pytest.fixture(scope="module")
def plain_engines() -> Iterator[list[Engine]]:
    """Three simulated replicas without KV events, r0 to r2."""
    started = [start_engine(f"r{i}", events=False) for i in range(3)]
    yield started
    for engine in started:
        engine.server.stop()


@pytest.fixture
def gateway_factory() -> Iterator[Callable[..., RunningGateway]]:
    """Start gateways in front of given engines; all are stopped after the test."""
    running: list[RunningGateway] = []

    def start(upstreams: list[Engine | UpstreamConfig], **options: object) -> RunningGateway:
        configs = [u.upstream if isinstance(u, Engine) else u for u in upstreams]
        settings: dict[str, object] = {"health_interval_s": 0.2, "metrics_interval_s": 0.2}
        settings.update(options)
        tokenizer = settings.pop("prompt_tokenizer", TextApproximation())
        gateway = Gateway(GatewayConfig(upstreams=tuple(configs), **settings),  # type: ignore[arg-type]
                          tokenizer=tokenizer)  # type: ignore[arg-type]
        server = ServerThread(gateway.app, **uvicorn_options(gateway.config))
        handle = RunningGateway(server.start(), gateway)
        for u in upstreams:
            if isinstance(u, Engine) and u.engine.publisher is not None:
                publisher = u.engine.publisher
                handle._publishers[u.upstream.name] = (lambda p=publisher: p.seq, publisher.seq)
        if handle._publishers:
            time.sleep(0.3)  # the engines' PUB sockets reconnect to the newly bound SUB
        running.append(handle)
        return handle

    yield start
    for handle in running:
        handle.server.stop()
