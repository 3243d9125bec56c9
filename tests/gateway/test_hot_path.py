"""The generate endpoints' bare-ASGI path: methods, chunked bodies, clients that leave."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from .fleet import Engine, RunningGateway, start_engine

Factory = Callable[..., RunningGateway]


def test_wrong_method_on_a_generate_endpoint_is_405(engines: list[Engine],
                                                    gateway_factory: Factory) -> None:
    """GET /v1/completions answers 405 naming POST, as a routed endpoint would."""
    gateway = gateway_factory(engines)
    response = httpx.get(gateway.url + "/v1/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["type"] == "MethodNotAllowed"


def test_unknown_paths_and_methods_answer_in_openai_error_shape(engines: list[Engine],
                                                               gateway_factory: Factory) -> None:
    """Starlette's own 404 and 405 carry OpenAI's error body, as every other refusal does."""
    gateway = gateway_factory(engines)
    missing = httpx.get(gateway.url + "/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    wrong = httpx.post(gateway.url + "/health")
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "MethodNotAllowed"
    assert "GET" in wrong.headers["allow"]


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


def test_body_decoding_accepts_and_refuses_as_the_stdlib() -> None:
    """The fast decoder falls back to json's rules: NaN is accepted (and written back as json
    writes it); non-objects, broken JSON and bytes that are not UTF-8 are refused naming the
    body."""
    from kvreuse.gateway.validation import RequestError, decode_body

    assert decode_body(b'{"model": "m", "n": 2}').value == {"model": "m", "n": 2}
    lenient = decode_body(b'{"temperature": NaN, "s": "\\u00e9"}')
    assert lenient.value["temperature"] != lenient.value["temperature"]  # NaN, as json gives
    assert json.loads(lenient.encode())["s"] == "\u00e9"  # and re-encoded as json would
    assert b"NaN" in lenient.encode()
    for raw in (b"[1, 2]", b"{not json", b"\xff\xfe"):
        with pytest.raises(RequestError) as refused:
            decode_body(raw)
        assert refused.value.param == "body" and refused.value.status == 400


def test_usage_is_read_from_whole_and_streamed_responses() -> None:
    """usage comes out of a completion body and out of the SSE usage chunk; null, absent or
    malformed usage gives None."""
    from kvreuse.gateway.migration import UsageScanner
    from kvreuse.gateway.proxy import usage_of

    usage = {"prompt_tokens": 8, "prompt_tokens_details": {"cached_tokens": 4}}
    assert usage_of(json.dumps({"choices": [], "usage": usage}).encode()) == usage
    for body in (b'{"usage": null}', b'{"usage": 3}', b'["usage"]', b'{"usage": {'):
        assert usage_of(body) is None
    scanner = UsageScanner()
    event = b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
    for piece in (b'data: {"choices": [1], "usage": null}\n\n', event[:20], event[20:],
                  b"data: [DONE]\n\n"):
        scanner.feed(piece)
    assert scanner.usage == usage


def test_trailing_slash_is_served(engines: list[Engine], gateway_factory: Factory) -> None:
    """POST /v1/completions/ is the same endpoint, forwarded to the upstream's canonical path."""
    gateway = gateway_factory(engines, policy="round_robin")
    response = httpx.post(gateway.url + "/v1/completions/",
                          json={"model": "sim", "prompt": "slash", "max_tokens": 1})
    assert response.status_code == 200 and response.json()["object"] == "text_completion"
