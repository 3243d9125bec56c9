"""``kvreuse engine``'s render endpoints: vLLM's shapes, the ids the engine itself prefills."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvreuse.engine.replica import EngineConfig
from kvreuse.engine.server import build_engine
from kvreuse.gateway.prompts import TextApproximation, request_tokens
from kvreuse.gateway.validation import parse_request
from kvreuse.testing.servers import ServerThread
from kvreuse.tokens import unpack

BLOCK = 4
FAST = {"block_size": BLOCK, "prefill_tokens_per_s": 1e6, "overhead_s": 0.0,
        "time_per_output_token_s": 0.0}
# vLLM 0.32's GenerateRequest.model_dump() keys (entrypoints/scale_out/token_in_token_out).
GENERATE_REQUEST_KEYS = {
    "request_id", "token_ids", "token_offsets", "features", "content_parts", "sampling_params",
    "model", "reasoning_ended", "reasoning_parser_kwargs", "return_token_ids", "output_mode",
    "stream", "stream_options", "cache_salt", "priority", "kv_transfer_params",
    "ec_transfer_params",
}


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    app = build_engine(EngineConfig(model="sim", **FAST), TextApproximation())  # type: ignore[arg-type]
    with ServerThread(app.app) as server:
        yield server.url


def cached_for(url: str, token_ids: list[int]) -> int:
    """What the engine reports as cached for a token-id prompt of ``token_ids``."""
    body = {"model": "sim", "prompt": token_ids, "max_tokens": 1}
    usage = httpx.post(url + "/v1/completions", json=body).json()["usage"]
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def test_completion_render_is_a_list_of_vllm_generate_requests(engine_url: str) -> None:
    """A completion renders to a one-item list in vLLM's GenerateRequest shape."""
    body = {"model": "sim", "prompt": "render me " * 5, "max_tokens": 7, "cache_salt": "t1"}
    rendered = httpx.post(engine_url + "/v1/completions/render", json=body)
    assert rendered.status_code == 200
    items = rendered.json()
    assert isinstance(items, list) and len(items) == 1
    item = items[0]
    assert set(item) == GENERATE_REQUEST_KEYS
    assert item["request_id"].startswith("cmpl-") and item["model"] == "sim"
    assert item["sampling_params"]["max_tokens"] == 7 and item["cache_salt"] == "t1"


def test_chat_render_is_one_generate_request(engine_url: str) -> None:
    """A chat renders to a single object (not a list), its id prefixed chatcmpl-."""
    body = {"model": "sim", "messages": [{"role": "user", "content": "hello there"}]}
    item = httpx.post(engine_url + "/v1/chat/completions/render", json=body).json()
    assert isinstance(item, dict) and set(item) == GENERATE_REQUEST_KEYS
    assert item["request_id"].startswith("chatcmpl-")


@pytest.mark.parametrize(
    ("kind", "path", "body"),
    [("completion", "/v1/completions",
      {"model": "sim", "prompt": "the same text, twice over " * 3, "max_tokens": 2}),
     ("chat", "/v1/chat/completions",
      {"model": "sim", "max_tokens": 2, "tools": [{"type": "function", "function": {"name": "f"}}],
       "messages": [{"role": "system", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": "a"},
                                                 {"type": "text", "text": "b"}]}]})],
)
def test_render_gives_the_ids_the_engine_prefills(engine_url: str, kind: str, path: str,
                                                  body: dict[str, Any]) -> None:
    """Rendered ids equal request_tokens() and are what the engine cached for that body."""
    rendered = httpx.post(engine_url + path + "/render", json=body).json()
    token_ids = (rendered[0] if kind == "completion" else rendered)["token_ids"]
    assert token_ids == unpack(request_tokens(TextApproximation(), parse_request(kind, body)))
    assert httpx.post(engine_url + path, json=body).status_code == 200
    assert cached_for(engine_url, token_ids) == (len(token_ids) - 1) // BLOCK * BLOCK


def test_render_leaves_the_cache_alone(engine_url: str) -> None:
    """Rendering prefills nothing: the same prompt afterwards has no cached tokens."""
    body = {"model": "sim", "prompt": "only rendered, never run " * 3}
    httpx.post(engine_url + "/v1/completions/render", json=body)
    usage = httpx.post(engine_url + "/v1/completions", json=body).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_request_id_follows_the_header_like_vllm(engine_url: str) -> None:
    """X-Request-Id names the rendered request, as vLLM's _base_request_id does."""
    body = {"model": "sim", "prompt": "id please"}
    item = httpx.post(engine_url + "/v1/completions/render", json=body,
                      headers={"X-Request-Id": "abc-1"}).json()[0]
    assert item["request_id"] == "cmpl-abc-1"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [("/v1/completions/render", {"model": "other", "prompt": "x"}, 404, "model"),
     ("/v1/completions/render", {"model": "sim"}, 400, "prompt"),
     ("/v1/completions/render", {"model": "sim", "prompt": ["a", "b"]}, 400, "prompt"),
     ("/v1/completions/render", {"model": "sim", "prompt": "x", "max_tokens": 40_000}, 400,
      "max_tokens"),
     ("/v1/chat/completions/render", {"model": "sim", "messages": []}, 400, "messages"),
     ("/v1/chat/completions/render",
      {"model": "sim", "messages": [{"role": "user", "content": "x"}], "cache_salt": "a/b"},
      400, "cache_salt")],
)
def test_bad_bodies_are_refused_naming_the_field(engine_url: str, path: str,
                                                 body: dict[str, Any], status: int,
                                                 param: str) -> None:
    """Render refuses what the generate endpoints refuse, in vLLM's error shape."""
    response = httpx.post(engine_url + path, json=body)
    assert response.status_code == status and response.json()["error"]["param"] == param


def test_render_needs_post(engine_url: str) -> None:
    """GET on a render path is 405 with Allow: POST, like the generate paths."""
    response = httpx.get(engine_url + "/v1/chat/completions/render")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
