"""``kvreuse route`` end to end, in front of ``kvreuse engine`` replicas on real sockets."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvreuse.gateway.config import UpstreamConfig
from kvreuse.gateway.prompts import HFPromptTokenizer
from kvreuse.identity import CacheIdentity
from kvreuse.routing import POLICIES
from kvreuse.testing.servers import (
    ServerThread,
    calling_threads,
    free_listen_port,
    free_port,
    probe_while_posting,
)
from kvreuse.testing.tiny_tokenizer import corpus_words

from .fleet import Engine, RunningGateway, start_engine

Factory = Callable[..., RunningGateway]
WORDS = corpus_words()


def unique_text(words: int = 60) -> str:
    tag = uuid.uuid4().hex
    return tag + " " + " ".join(WORDS[hash(tag + str(i)) % len(WORDS)] for i in range(words))


def completion(gateway: RunningGateway, prompt: str, **extra: Any) -> httpx.Response:
    body = {"model": "sim", "prompt": prompt, "max_tokens": 3, **extra}
    return httpx.post(gateway.url + "/v1/completions", json=body, timeout=10)


def chat(gateway: RunningGateway, messages: list[dict[str, str]], **extra: Any) -> httpx.Response:
    body = {"model": "sim", "messages": messages, "max_tokens": 4, **extra}
    return httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=10,
                      headers=extra.pop("headers", None))


def sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


# ---------------------------------------------------------------------------------- pass-through


def test_completion_passes_through_with_routing_headers(engines: list[Engine],
                                                         gateway_factory: Factory) -> None:
    """A completion comes back as the engine wrote it, naming the upstream that served it."""
    gateway = gateway_factory(engines, policy="round_robin")
    response = completion(gateway, "hello gateway")
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion" and body["usage"]["prompt_tokens"] == 4
    assert response.headers["x-kvreuse-upstream"] in ("e0", "e1")


def test_streams_are_forwarded_unbuffered(engines: list[Engine], gateway_factory: Factory) -> None:
    """The first SSE chunk reaches the client long before the stream ends."""
    slow = start_engine("slow", time_per_output_token_s=0.05)
    try:
        gateway = gateway_factory([slow])
        body = {"model": "sim", "prompt": "tick tock", "max_tokens": 8, "stream": True}
        started = time.monotonic()
        first_at = None
        chunks = []
        with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=10) as r:
            for chunk in r.iter_raw():
                first_at = first_at or time.monotonic()
                chunks.append(chunk)
        ended = time.monotonic()
        assert first_at is not None and first_at - started < (ended - started) / 2
        events = sse_events(b"".join(chunks).decode())
        assert events[-1] == "[DONE]" and len(events) == 9
    finally:
        slow.server.stop()


def test_chat_streamed_and_whole_pass_through(engines: list[Engine],
                                              gateway_factory: Factory) -> None:
    """Chat completions pass through both ways; the usage chunk arrives when asked for."""
    gateway = gateway_factory(engines)
    messages = [{"role": "user", "content": "hello there"}]
    whole = chat(gateway, messages)
    assert whole.json()["choices"][0]["message"]["role"] == "assistant"
    streamed = chat(gateway, messages, stream=True, stream_options={"include_usage": True})
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["prompt_tokens"] == whole.json()["usage"][
        "prompt_tokens"]


def test_models_is_the_union_of_upstreams(gateway_factory: Factory) -> None:
    """GET /v1/models lists every model any admitted upstream serves, once."""
    a, b = start_engine("a", model="m-a", events=False), start_engine("b", model="m-b",
                                                                      events=False)
    try:
        gateway = gateway_factory([a, b])
        ids = sorted(m["id"] for m in httpx.get(gateway.url + "/v1/models").json()["data"])
        assert ids == ["m-a", "m-b"]
    finally:
        a.server.stop()
        b.server.stop()


# ---------------------------------------------------------------------------------- routing


@pytest.mark.parametrize("policy", ["cache_aware", "exact", "prefix_hash", "session_affinity"])
def test_a_conversation_stays_on_the_replica_holding_its_history(
    engines: list[Engine], gateway_factory: Factory, policy: str
) -> None:
    """Each turn of a chat goes where the previous turns are cached, and hits there."""
    # prefix_hash keys on the first k tokens: k must fit inside the first turn's prompt.
    options = {"exact": {"block_size": 4}, "prefix_hash": {"k": 64}}.get(policy, {})
    gateway = gateway_factory(engines, policy=policy, policy_options=options)
    messages = [{"role": "system", "content": unique_text(80)}]
    served, cached = [], []
    for turn in range(4):
        messages.append({"role": "user", "content": f"question {turn} " + unique_text(10)})
        response = chat(gateway, messages, user="conversation-1")
        served.append(response.headers["x-kvreuse-upstream"])
        cached.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages.append({"role": "assistant",
                         "content": response.json()["choices"][0]["message"]["content"]})
        gateway.events_settled()
    assert len(set(served)) == 1, served
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_routing_policy_serves_through_the_gateway(
    engines: list[Engine], gateway_factory: Factory, policy: str
) -> None:
    """Each policy of kvreuse.routing, built by name, routes real requests."""
    options = {"block_size": 4} if policy in ("exact", "cache_aware", "cache_aware_sglang") else {}
    gateway = gateway_factory(engines, policy=policy, policy_options=options)
    for i in range(3):
        response = completion(gateway, f"policy smoke {i} " + unique_text(8))
        assert response.status_code == 200 and response.headers["x-kvreuse-upstream"] in (
            "e0", "e1")
    assert f'policy="{policy}"' in httpx.get(gateway.url + "/metrics").text


def test_exact_mode_predicts_what_the_engine_reports(engines: list[Engine],
                                                     gateway_factory: Factory) -> None:
    """In exact mode the predicted cached tokens equal the engine's cached_tokens."""
    gateway = gateway_factory(engines, policy="exact", policy_options={"block_size": 4})
    shared = unique_text(50)
    pairs = []
    for i in range(6):
        response = completion(gateway, shared + f" variant {i % 3} " + unique_text(5))
        pairs.append((int(response.headers["x-kvreuse-predicted-cached-tokens"]),
                      response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]))
        gateway.events_settled()
    assert all(predicted == real for predicted, real in pairs), pairs
    assert sum(real for _, real in pairs) > 0


def test_kv_event_index_namespaces_by_salt(engines: list[Engine],
                                           gateway_factory: Factory) -> None:
    """A caller's cache_salt (no tenants file) namespaces the routing index too."""
    gateway = gateway_factory(engines[:1], policy="exact", policy_options={"block_size": 4})
    prompt = unique_text(40)
    completion(gateway, prompt, cache_salt="team-x")
    gateway.events_settled()
    again = completion(gateway, prompt, cache_salt="team-x")
    other = completion(gateway, prompt, cache_salt="team-y")
    assert int(again.headers["x-kvreuse-predicted-cached-tokens"]) > 0
    assert int(other.headers["x-kvreuse-predicted-cached-tokens"]) == 0
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_hf_tokenizer_mode_predicts_exactly(tokenizer_dir: Path, gateway_factory: Factory) -> None:
    """With --tokenizer, the gateway's chat tokens are the engine's: predictions are exact."""
    from kvreuse.engine.replica import EngineConfig
    from kvreuse.engine.server import build_engine
    from kvreuse.gateway.prompts import HFPromptTokenizer as Hf

    endpoint = f"tcp://127.0.0.1:{free_listen_port()}"
    app = build_engine(EngineConfig(model="sim", block_size=4), Hf(tokenizer_dir),
                       events_endpoint=endpoint)
    with ServerThread(app.app) as server:
        engine = Engine(server, app, UpstreamConfig(server.url, name="hf", events=endpoint))
        gateway = gateway_factory([engine], policy="exact", policy_options={"block_size": 4},
                                  prompt_tokenizer=HFPromptTokenizer(tokenizer_dir))
        messages = [{"role": "system", "content": unique_text(30)},
                    {"role": "user", "content": "hi"}]
        chat(gateway, messages)
        gateway.events_settled()
        messages[-1]["content"] = "hello again"
        response = chat(gateway, messages)
        predicted = int(response.headers["x-kvreuse-predicted-cached-tokens"])
        assert predicted > 0
        assert predicted == response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


# ---------------------------------------------------------------------------------- tenants


def write_tenants(tmp_path: Path, caller_salt: str = "reject") -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(f'secret = "a-long-enough-secret"\ncaller_salt = "{caller_salt}"\n'
                    '[keys]\n"key-a" = "alpha"\n"key-b" = "beta"\n')
    return path


def test_tenants_unknown_key_401_caller_salt_400(engines: list[Engine], tmp_path: Path,
                                                gateway_factory: Factory) -> None:
    """Without a known key: 401; with a caller-chosen salt: 400 naming cache_salt; a null
    salt is no salt."""
    gateway = gateway_factory(engines, tenants=str(write_tenants(tmp_path)))
    body = {"model": "sim", "prompt": "x"}
    assert httpx.post(gateway.url + "/v1/completions", json=body).status_code == 401
    bad = httpx.post(gateway.url + "/v1/completions", json=body,
                     headers={"authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["param"] == "authorization"
    salted = httpx.post(gateway.url + "/v1/completions", json={**body, "cache_salt": "mine"},
                        headers={"authorization": "Bearer key-a"})
    assert salted.status_code == 400 and salted.json()["error"]["param"] == "cache_salt"
    unset = httpx.post(gateway.url + "/v1/completions", json={**body, "cache_salt": None},
                       headers={"authorization": "Bearer key-a"})
    assert unset.status_code == 200  # null is "no salt", as everywhere else


def test_tenant_salts_isolate_and_strip_mode_drops_caller_salts(
    engines: list[Engine], tmp_path: Path, gateway_factory: Factory
) -> None:
    """Tenant B gets no hit on tenant A's prefix; A does; a stripped salt changes nothing."""
    gateway = gateway_factory(engines[:1], policy="exact", policy_options={"block_size": 4},
                              tenants=str(write_tenants(tmp_path, "strip")))
    prompt = unique_text(40)

    def as_tenant(key: str, **extra: Any) -> int:
        response = httpx.post(gateway.url + "/v1/completions",
                              json={"model": "sim", "prompt": prompt, "max_tokens": 2, **extra},
                              headers={"authorization": f"Bearer {key}"})
        gateway.events_settled()
        cached: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return cached

    assert as_tenant("key-a") == 0
    assert as_tenant("key-b") == 0
    assert as_tenant("key-a", cache_salt="beta-guess") > 0
    tenants = gateway.gateway.tenants
    assert tenants is not None
    expected = CacheIdentity(cache_salt=tenants.salt("alpha"))
    assert expected in gateway.gateway.router.indexes["e0"].identities()


# ---------------------------------------------------------------------------------- failures


def flaky_app(state: dict[str, Any]) -> Starlette:
    """An upstream whose behaviour a test switches: healthy, 500s, or a broken stream."""

    async def health(request: Request) -> Response:
        return Response(status_code=500 if state.get("sick") else 200)

    async def generate(request: Request) -> Response:
        state["calls"] = state.get("calls", 0) + 1
        if state.get("mode") == "500":
            return JSONResponse({"error": "boom"}, status_code=500)

        async def broken() -> AsyncIterator[bytes]:
            yield b'data: {"choices": [{"text": "partial"}]}\n\n'
            raise RuntimeError("engine crashed mid-stream")

        return StreamingResponse(broken(), media_type="text/event-stream")

    return Starlette(routes=[Route("/health", health), Route("/v1/completions", generate,
                                                              methods=["POST"])])


def forged_metrics_app(waiting: str) -> Starlette:
    """An upstream that serves completions but whose /metrics reports ``waiting`` requests
    waiting (a broken or hostile exporter: NaN, +Inf)."""

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        return Response(f"vllm:num_requests_waiting{{model_name=\"sim\"}} {waiting}\n",
                        media_type="text/plain")

    async def generate(request: Request) -> Response:
        return JSONResponse({"id": "c", "object": "text_completion", "model": "sim",
                             "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})

    return Starlette(routes=[Route("/health", health), Route("/metrics", metrics),
                             Route("/v1/completions", generate, methods=["POST"])])


@pytest.mark.parametrize("waiting", ["+Inf", "NaN", "1e300", "-5"])
def test_a_forged_queue_in_an_upstreams_metrics_never_fails_a_request(
        gateway_factory: Factory, waiting: str) -> None:
    """Scraped waiting counts of +Inf, NaN, 1e300 or -5 leave every request answered (+Inf
    made each routing call raise OverflowError before) and the upstream's queue finite."""
    with ServerThread(forged_metrics_app(waiting)) as forged:
        gateway = gateway_factory([UpstreamConfig(forged.url, name="forged", models=("sim",))],
                                  policy="relative_spill")
        for upstream in gateway.gateway.upstreams:
            gateway.server.call(gateway.gateway.scrape(upstream))
        assert all(completion(gateway, f"forged {i}").status_code == 200 for i in range(3))
        assert 0 <= gateway.gateway.upstreams[0].load().queued_requests <= 1_000_000


def test_connection_failure_is_retried_and_ejects(engines: list[Engine],
                                                  gateway_factory: Factory) -> None:
    """A dead upstream's requests are retried on the next candidate; it is then ejected."""
    dead = UpstreamConfig(f"http://127.0.0.1:{free_port()}", name="dead", models=("sim",))
    gateway = gateway_factory([dead, engines[0]], policy="round_robin", eject_after=2,
                              health_interval_s=30.0)
    statuses = [completion(gateway, f"retry me {i}") for i in range(4)]
    assert all(r.status_code == 200 and r.headers["x-kvreuse-upstream"] == "e0"
               for r in statuses)
    metrics = httpx.get(gateway.url + "/metrics").text
    assert 'kvreuse_gateway_retries_total{upstream="e0"}' in metrics
    assert 'kvreuse_gateway_upstream_healthy{upstream="dead"} 0.0' in metrics


def test_5xx_before_first_byte_is_retried(engines: list[Engine],
                                          gateway_factory: Factory) -> None:
    """An upstream answering 500 is skipped for the next candidate."""
    state: dict[str, Any] = {"mode": "500"}
    with ServerThread(flaky_app(state)) as flaky:
        flaky_upstream = UpstreamConfig(flaky.url, name="flaky", models=("sim",))
        gateway = gateway_factory([flaky_upstream, engines[0]], policy="round_robin")
        results = [completion(gateway, "x").headers["x-kvreuse-upstream"] for _ in range(2)]
        assert results == ["e0", "e0"] and state["calls"] == 1


def test_failure_after_first_byte_ends_with_an_error_event(gateway_factory: Factory) -> None:
    """A stream that breaks after its first chunk ends with an SSE error and [DONE]."""
    state: dict[str, Any] = {}
    with ServerThread(flaky_app(state)) as flaky:
        gateway = gateway_factory([UpstreamConfig(flaky.url, name="flaky")])
        response = completion(gateway, "x", stream=True)
        events = sse_events(response.text)
        assert json.loads(events[0])["choices"][0]["text"] == "partial"
        assert "error" in json.loads(events[-2]) and events[-1] == "[DONE]"


def test_health_probes_eject_and_readmit(gateway_factory: Factory) -> None:
    """Failing probes eject (503 on /ready); passing probes re-admit."""
    state: dict[str, Any] = {"sick": True}
    with ServerThread(flaky_app(state)) as flaky:
        gateway = gateway_factory([UpstreamConfig(flaky.url, name="flaky")],
                                  health_interval_s=0.05, eject_after=2, readmit_after=2)
        deadline = time.monotonic() + 5
        # /ready also answers 503 before the first probe (nothing probed yet): wait for the
        # ejection itself, or the request below races the probes to a still-admitted upstream.
        while httpx.get(gateway.url + "/ready").json()["ejected"] != ["flaky"]:
            assert time.monotonic() < deadline, "never ejected"
            time.sleep(0.05)
        assert httpx.get(gateway.url + "/ready").status_code == 503
        assert completion(gateway, "x").status_code == 503
        state["sick"] = False
        while httpx.get(gateway.url + "/ready").status_code != 200:
            assert time.monotonic() < deadline + 5, "never re-admitted"
            time.sleep(0.05)


def test_upstream_4xx_passes_through_unretried(engines: list[Engine],
                                               gateway_factory: Factory) -> None:
    """The engine's 404 for an unknown model reaches the caller unchanged."""
    gateway = gateway_factory(engines, policy="round_robin")
    response = httpx.post(gateway.url + "/v1/completions",
                          json={"model": "no-such-model", "prompt": "x"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
    metrics = httpx.get(gateway.url + "/metrics").text
    assert "kvreuse_gateway_retries_total{" not in metrics


@pytest.mark.parametrize(
    ("raw", "param", "status"),
    [
        (b"{not json", "body", 400),
        (json.dumps({"model": "sim"}).encode(), "prompt", 400),
        (json.dumps({"model": "sim", "prompt": "x", "max_tokens": "9"}).encode(),
         "max_tokens", 400),
        (json.dumps({"model": "sim", "prompt": "x" * 5000}).encode(), "body", 413),
    ],
)
def test_bad_input_gets_a_json_error_naming_the_field(
    engines: list[Engine], gateway_factory: Factory, raw: bytes, param: str, status: int
) -> None:
    """Invalid JSON, missing or mistyped fields and oversized bodies are refused by name."""
    gateway = gateway_factory(engines, max_body_bytes=4096)
    response = httpx.post(gateway.url + "/v1/completions", content=raw,
                          headers={"content-type": "application/json"})
    assert response.status_code == status and response.json()["error"]["param"] == param


def test_chat_without_a_chat_template_is_refused(engines: list[Engine], tmp_path: Path,
                                                gateway_factory: Factory) -> None:
    """A tokenizer without chat_template cannot render chats: 400 saying so, not a crash."""
    from kvreuse.testing.tiny_tokenizer import build_tokenizer_dir

    directory = build_tokenizer_dir(tmp_path / "tok", vocab_size=600, corpus_lines=300)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    gateway = gateway_factory(engines, prompt_tokenizer=HFPromptTokenizer(directory))
    response = chat(gateway, [{"role": "user", "content": "hi"}])
    assert response.status_code == 400 and "chat_template" in response.json()["error"]["message"]


def test_metrics_expose_the_listed_families(engines: list[Engine],
                                            gateway_factory: Factory) -> None:
    """Requests by branch, decision latency, predicted vs realized, hit rates, index sizes,
    KV events received and dropped are all exported."""
    gateway = gateway_factory(engines, policy="exact", policy_options={"block_size": 4})
    prompt = unique_text(30)
    completion(gateway, prompt)
    gateway.events_settled()
    completion(gateway, prompt)
    for upstream in gateway.gateway.upstreams:
        gateway.server.call(gateway.gateway.scrape(upstream))
    text = httpx.get(gateway.url + "/metrics").text
    for family in (
        "kvreuse_gateway_requests_total{", "kvreuse_gateway_routing_decision_seconds_bucket",
        "kvreuse_gateway_predicted_cached_tokens_total", "kvreuse_gateway_realized_cached_"
        "tokens_total", "kvreuse_gateway_token_hit_rate{", "kvreuse_gateway_index_blocks{",
        "kvreuse_gateway_kv_events_received_total{", "kvreuse_gateway_kv_events_dropped_total{",
        "kvreuse_gateway_engine_token_hit_rate{", "kvreuse_gateway_engine_cached_tokens{",
        "kvreuse_gateway_upstream_kv_usage{", "kvreuse_gateway_kv_event_gaps_total{",
    ):
        assert family in text, family
    assert 'branch="affinity"' in text


class SlowTokenizer:
    """The text approximation, but a prompt containing SLOW holds its caller for 3 s and
    every call notes the thread it ran on: a stand-in for a real tokenizer on a 7 MB chat."""

    name = "slow"
    blocking = True

    def __init__(self) -> None:
        import threading

        from kvreuse.gateway.prompts import TextApproximation
        self.inner = TextApproximation()
        self.threads: list[str] = []
        self._current = threading.current_thread

    def completion(self, prompt: str) -> Any:
        self.threads.append(self._current().name)
        if "SLOW" in prompt:
            time.sleep(3.0)
        return self.inner.completion(prompt)

    def chat(self, messages: Any, **options: Any) -> Any:
        self.threads.append(self._current().name)
        return self.inner.chat(messages, **options)


def test_a_blocking_tokenizer_runs_off_the_event_loop(engines: list[Engine],
                                                      gateway_factory: Factory) -> None:
    """A tokenizer that takes 3 s on one prompt does not hold other clients: /health answers
    meanwhile, and every call ran on the gateway's tokenizing thread (one at a time)."""
    import threading

    tokenizer = SlowTokenizer()
    gateway = gateway_factory(engines, prompt_tokenizer=tokenizer)
    slow: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: slow.append(completion(gateway, "SLOW " * 10)))
    sender.start()
    time.sleep(0.5)  # the slow prompt is being tokenized now
    started = time.monotonic()
    assert httpx.get(gateway.url + "/health", timeout=10).status_code == 200
    assert time.monotonic() - started < 1.0
    assert not slow  # still tokenizing
    sender.join(timeout=30)
    assert slow and slow[0].status_code == 200
    assert completion(gateway, unique_text()).status_code == 200
    assert tokenizer.threads and all(t.startswith("kvreuse-tokenize") for t in tokenizer.threads)


def test_a_real_tokenizer_on_a_huge_prompt_leaves_the_event_loop_free(
        tokenizer_dir: Path, engines: list[Engine], gateway_factory: Factory) -> None:
    """A 3 MB prompt through a real HF tokenizer (~2.5 s of encode, on the tokenizing thread
    and without the GIL) leaves /health answering meanwhile."""
    gateway = gateway_factory(engines, prompt_tokenizer=HFPromptTokenizer(tokenizer_dir))
    text = "hello world the quick brown fox jumps over " * 70_000
    body = json.dumps({"model": "sim", "prompt": text, "max_tokens": 1}).encode()
    latency, pending, status = probe_while_posting(gateway.url, "/v1/completions", body)
    assert pending and latency < 1.0, (latency, pending)
    assert status == 400  # the engine's context length, relayed


def test_a_huge_prompt_being_tokenized_does_not_hold_up_small_requests(
        tokenizer_dir: Path, engines: list[Engine], gateway_factory: Factory) -> None:
    """While a 3 MB prompt is tokenized (~2.5 s, in the bulk lane), a small chat through the
    same real tokenizer is routed and answered: it does not queue behind the big one."""
    gateway = gateway_factory(engines, prompt_tokenizer=HFPromptTokenizer(tokenizer_dir))
    text = "hello world the quick brown fox jumps over " * 70_000
    body = json.dumps({"model": "sim", "prompt": text, "max_tokens": 1}).encode()
    latency, pending, status = probe_while_posting(
        gateway.url, "/v1/completions", body,
        probe=lambda: chat(gateway, [{"role": "user", "content": unique_text(20)}]))
    assert pending and latency < 1.0, (latency, pending)
    assert status == 400  # the engine's context length, relayed


def test_large_prompts_past_the_bulk_lane_s_bound_get_a_readable_503(
        tokenizer_dir: Path, engines: list[Engine], gateway_factory: Factory) -> None:
    """Eight 3 MB prompts at once with room for one in the bulk lane: one is tokenized, seven
    are refused at once with a 503 saying why; then a small chat is served as usual."""
    from concurrent.futures import ThreadPoolExecutor

    gateway = gateway_factory(engines, prompt_tokenizer=HFPromptTokenizer(tokenizer_dir))
    gateway.gateway._lanes.max_bulk_bytes = 4 * 2**20
    text = "hello world the quick brown fox jumps over " * 70_000
    body = json.dumps({"model": "sim", "prompt": text, "max_tokens": 1}).encode()

    def post(_: int) -> httpx.Response:
        return httpx.post(gateway.url + "/v1/completions", content=body, timeout=60,
                          headers={"content-type": "application/json"})

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(post, range(8)))
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [400] + [503] * 7, statuses  # 400: the engine's context length
    refusal = next(r for r in responses if r.status_code == 503).json()["error"]
    assert refusal["type"] == "ServiceUnavailableError" and "retry" in refusal["message"]
    assert chat(gateway, [{"role": "user", "content": "hi"}]).status_code == 200
    assert gateway.gateway._lanes.bulk_bytes == 0


def test_a_body_over_the_inline_size_is_decoded_off_the_event_loop(
        engines: list[Engine], gateway_factory: Factory) -> None:
    """Past INLINE_BODY_BYTES the gateway decodes a body on its tokenizing thread (a 6.8 MB
    chat of 200,000 messages held its loop for 0.38 s); smaller bodies stay on the loop."""
    import kvreuse.gateway.app as app_module
    from kvreuse.gateway.validation import INLINE_BODY_BYTES

    gateway = gateway_factory(engines)
    with calling_threads(app_module, "decode_body") as threads:
        for user in ("me", "x" * INLINE_BODY_BYTES):  # OpenAI's end-user id, forwarded as sent
            assert completion(gateway, unique_text(), user=user).status_code == 200
    assert threads[0].startswith("asgi-") and threads[1].startswith("kvreuse-tokenize"), threads


def test_the_decision_histogram_counts_tokenization_off_the_event_loop(
        engines: list[Engine], gateway_factory: Factory) -> None:
    """A prompt a blocking tokenizer takes 3 s over: the routing decision histogram's sum holds
    those 3 s (tokenization plus policy decision, wherever tokenization ran)."""
    gateway = gateway_factory(engines, prompt_tokenizer=SlowTokenizer())
    assert completion(gateway, "SLOW " * 10).status_code == 200
    text = httpx.get(gateway.url + "/metrics", timeout=10).text
    total = next(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("kvreuse_gateway_routing_decision_seconds_sum"))
    assert 3.0 <= total < 10.0
