"""Helpers for the gateway tests: simulated engines and gateways on real sockets."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvreuse.engine.replica import EngineConfig
from kvreuse.engine.server import EngineApp, build_engine
from kvreuse.gateway.app import Gateway
from kvreuse.gateway.config import UpstreamConfig
from kvreuse.gateway.prompts import TextApproximation
from kvreuse.testing.servers import ServerThread, free_listen_port


@dataclass
class Engine:
    """A running simulated replica and the upstream entry that reaches it."""

    server: ServerThread
    engine: EngineApp
    upstream: UpstreamConfig


def start_engine(name: str, *, model: str = "sim", events: bool = True, shape: str = "map",
                 replay: bool = False, host: str = "127.0.0.1", port: int = 0,
                 **overrides: object) -> Engine:
    settings: dict[str, object] = {"model": model, "block_size": 4, "num_blocks": 4096,
                                   "prefill_tokens_per_s": 1e6, "overhead_s": 0.0,
                                   "time_per_output_token_s": 0.001}
    settings.update(overrides)
    endpoint = f"tcp://127.0.0.1:{free_listen_port()}" if events else None
    replay_endpoint = f"tcp://127.0.0.1:{free_listen_port()}" if events and replay else None
    engine = build_engine(EngineConfig(**settings), TextApproximation(),  # type: ignore[arg-type]
                          events_endpoint=endpoint, replay_endpoint=replay_endpoint,
                          topic="kv-events", shape=shape)
    server = ServerThread(engine.app, host=host, port=port).start()
    upstream = UpstreamConfig(server.url, name=name, events=endpoint, replay=replay_endpoint,
                              topic="kv-events")
    return Engine(server, engine, upstream)


def slow_engines(prefill_tokens_per_s: float, overhead_s: float) -> Iterator[list[Engine]]:
    """Two fresh engines without KV events, e0 and e1, at that prefill speed (decode 1 ms a
    token, 65,536 tokens of KV); stopped when the generator is closed (a fixture's body)."""
    pair = [start_engine(name, events=False, prefill_tokens_per_s=prefill_tokens_per_s,
                         overhead_s=overhead_s, time_per_output_token_s=0.001,
                         num_blocks=16_384) for name in ("e0", "e1")]
    yield pair
    for engine in pair:
        engine.server.stop()


@dataclass
class RunningGateway:
    server: ServerThread
    gateway: Gateway

    @property
    def url(self) -> str:
        return self.server.url

    def events_settled(self, timeout_s: float = 5.0) -> None:
        """Wait until every upstream's published batches have reached the gateway."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self._caught_up(name) for name in self.gateway.router.indexes):
                return
            time.sleep(0.01)
        raise AssertionError("KV events did not reach the gateway")

    def _caught_up(self, name: str) -> bool:
        publisher = self._publishers.get(name)
        if publisher is None:
            return True
        next_seq, seq_at_start = publisher
        if next_seq() == seq_at_start:
            return True  # nothing published since this gateway started
        subscriber = next(s for s in self.gateway.subscribers if s.replica == name)
        return subscriber.tracker.last_seq == next_seq() - 1

    _publishers: dict[str, tuple[Callable[[], int], int]] = field(default_factory=dict)


def served_by(gateway: RunningGateway, count: int, model: str = "sim") -> set[str]:
    """The upstreams that answered ``count`` small completions through ``gateway`` (each
    must succeed)."""
    import httpx

    names = set()
    for index in range(count):
        response = httpx.post(gateway.url + "/v1/completions", timeout=30, json={
            "model": model, "prompt": f"request {index}", "max_tokens": 2})
        assert response.status_code == 200, response.text
        names.add(response.headers["x-kvreuse-upstream"])
    return names


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0,
             what: str | Callable[[], str] = "the condition") -> None:
    """Poll ``condition`` every 50 ms until it holds; fail saying ``what`` did not happen
    (a callable is asked at the failure, so it can tell what was seen last)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what() if callable(what) else what} did not happen "
                                 f"within {timeout_s} s")
        time.sleep(0.05)
