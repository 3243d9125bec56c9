"""Model-aware routing in front of real vLLM: replica 1 serves the model under a second name.

One test (vLLM is slow on CPU): the gateway learns each replica's served names from its
``/v1/models``, sends the alias only to the replica serving it, credits that replica's KV events
(which name no model) to both of its names, and answers a 404 for a model nobody serves.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import httpx

from kvreuse.testing.tiny_tokenizer import corpus_words

from .conftest import LiveGateway
from .vllm_fleet import ALIAS_NAME, MODEL_NAME

WORDS = corpus_words()


def test_models_route_to_their_replicas_and_share_one_vllm_cache(
    gateway_for: Callable[..., LiveGateway],
) -> None:
    """The alias reaches only vllm1; a prompt cached there under the alias is predicted (and
    reported by vLLM) as cached for the other name; an unknown model is a 404."""
    gateway = gateway_for()
    ids = [m["id"] for m in httpx.get(gateway.url + "/v1/models").json()["data"]]
    assert ids == [MODEL_NAME, ALIAS_NAME]
    prompt = uuid.uuid4().hex + " " + " ".join(WORDS[i * 7 % len(WORDS)] for i in range(120))

    def complete(model: str) -> httpx.Response:
        response = httpx.post(gateway.url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": 1})
        gateway.events_settled()
        return response

    first = complete(ALIAS_NAME)
    assert first.status_code == 200, first.text
    assert first.headers["x-kvreuse-upstream"] == "vllm1"
    again = complete(MODEL_NAME)  # both replicas serve it; only vllm1 holds the prompt
    assert again.status_code == 200, again.text
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert again.headers["x-kvreuse-upstream"] == "vllm1"
    assert cached > 0
    assert int(again.headers["x-kvreuse-predicted-cached-tokens"]) == cached
    for _ in range(3):
        other = uuid.uuid4().hex + " hello"
        routed = httpx.post(gateway.url + "/v1/completions", timeout=120, json={
            "model": ALIAS_NAME, "prompt": other, "max_tokens": 1})
        assert routed.status_code == 200 and routed.headers["x-kvreuse-upstream"] == "vllm1"
    missing = httpx.post(gateway.url + "/v1/completions", timeout=30, json={
        "model": "tiny-llama-c", "prompt": "x", "max_tokens": 1})
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["param"] == "model"
    assert f"served models: {MODEL_NAME}, {ALIAS_NAME}" in error["message"]
