"""The generate endpoints' bare-ASGI path: methods, chunked bodies, clients that leave."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import httpx

from .fleet import Engine, RunningGateway, start_engine

Factory = Callable[..., RunningGateway]


def test_wrong_method_on_a_generate_endpoint_is_405(engines: list[Engine],
                                                    gateway_factory: Factory) -> None:
    """GET /v1/completions answers 405 naming POST, as a routed endpoint would."""
    gateway = gateway_factory(engines)
    response = httpx.get(gateway.url + "/v1/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"


def test_chunked_request_body_is_read_whole(engines: list[Engine],
                                            gateway_factory: Factory) -> None:
    """A body sent with chunked transfer encoding (no content-length) is forwarded whole."""
    gateway = gateway_factory(engines, policy="round_robin")
    body = json.dumps({"model": "sim", "prompt": "chunked " * 50, "max_tokens": 2}).encode()

    def pieces() -> Iterator[bytes]:
        for at in range(0, len(body), 64):
            yield body[at:at + 64]

    response = httpx.post(gateway.url + "/v1/completions", content=pieces(),
                          headers={"content-type": "application/json"})
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] == len("chunked " * 50) // 4


def test_oversized_chunked_body_is_413(engines: list[Engine], gateway_factory: Factory) -> None:
    """Without a content-length, the limit is enforced while reading."""
    gateway = gateway_factory(engines, max_body_bytes=1000)

    def pieces() -> Iterator[bytes]:
        yield b'{"model": "sim", "prompt": "'
        for _ in range(40):
            yield b"x" * 100
        yield b'"}'

    response = httpx.post(gateway.url + "/v1/completions", content=pieces())
    assert response.status_code == 413 and response.json()["error"]["param"] == "body"


def test_client_leaving_mid_stream_frees_gateway_and_engine(gateway_factory: Factory) -> None:
    """When the caller drops a stream, the gateway stops relaying, counts the request done,
    and the engine aborts it (its blocks freed) instead of generating on."""
    slow = start_engine("slow", time_per_output_token_s=0.02)
    try:
        gateway = gateway_factory([slow], policy="round_robin")
        body = {"model": "sim", "prompt": "leave early", "max_tokens": 500, "stream": True}
        with httpx.stream("POST", gateway.url + "/v1/completions", json=body,
                          timeout=10) as response:
            first = next(response.iter_raw())
        assert first.startswith(b"data: ")
        upstream = gateway.gateway.upstreams[0]
        deadline = time.monotonic() + 5
        while upstream.in_flight or slow.engine.replica.running:
            assert time.monotonic() < deadline, "the dropped stream was never released"
            time.sleep(0.02)
        assert slow.engine.replica.counters.generation_tokens < 400
    finally:
        slow.server.stop()
