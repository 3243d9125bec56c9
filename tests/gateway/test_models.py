"""Model-aware routing: each request reaches only upstreams serving its model.

The first tests run real ``kvreuse engine`` and ``kvreuse route`` processes on 127.0.0.1 (the
multi-model fleet of issue 13); the others use in-process servers on real sockets where they
need to look inside the gateway or to script a misbehaving upstream.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvreuse.gateway.config import UpstreamConfig
from kvreuse.gateway.prompts import TextApproximation
from kvreuse.gateway.router import Router
from kvreuse.gateway.upstreams import UpstreamState
from kvreuse.gateway.validation import parse_request
from kvreuse.index.events import BlockRemoved, BlockStored
from kvreuse.index.hashing import BlockHash
from kvreuse.kv_event_codec import EventBatch
from kvreuse.routing import FleetView, RequestView, RoutingPolicy, build_policy
from kvreuse.testing.processes import EngineSpec, Fleet, Process, wait_http
from kvreuse.testing.servers import ServerThread, free_port
from kvreuse.tokens import num_tokens, pack

from .fleet import RunningGateway, start_engine, wait_for

Factory = Callable[..., RunningGateway]


def text(words: int = 40) -> str:
    tag = uuid.uuid4().hex
    return tag + " " + " ".join(f"w{hash(tag + str(i)) % 997}" for i in range(words))


def complete(url: str, model: Any, prompt: str = "hello models", **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=15)


def chat(url: str, model: str, content: str = "hi") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=15)


def sample(url: str, name: str, **labels: str) -> float | None:
    """The value of one sample of the gateway's /metrics, or None."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for found in family.samples:
            if found.name == name and found.labels == labels:
                return float(found.value)
    return None


def model_ids(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(url + "/v1/models", timeout=5).json()["data"]]


# ---------------------------------------------------------------------------------- processes


def engine_spec(model: str) -> EngineSpec:
    return EngineSpec(model=model, events=False, overhead_ms=1.0, tpot_ms=1.0,
                      prefill_tokens_per_s=1e6)


@pytest.fixture(scope="module")
def two_models(fleet: Fleet) -> list[Process]:
    """Two `kvreuse engine` processes: one serves model-a, the other model-b."""
    engines = [fleet.start_engine("engine-a", engine_spec("model-a"), wait=False),
               fleet.start_engine("engine-b", engine_spec("model-b"), wait=False)]
    for engine in engines:
        wait_http(engine)
    return engines


def start_route(fleet: Fleet, name: str, upstreams: list[str], *extra: str) -> Process:
    """A `kvreuse route` process with the given --upstream flags."""
    port = free_port()
    argv = [fleet.python, "-m", "kvreuse.cli.main", "route", "--host", "127.0.0.1",
            "--port", str(port), "--drain-delay", "0", *extra]
    for flag in upstreams:
        argv += ["--upstream", flag]
    proc = fleet.spawn(name, argv, url=f"http://127.0.0.1:{port}", port=port)
    wait_http(proc)
    return proc


def test_each_model_reaches_only_its_replica(fleet: Fleet, two_models: list[Process]) -> None:
    """Issue 13's fleet: model-b requests no longer land on the model-a replica (404 there)."""
    a, b = two_models
    gateway = start_route(fleet, "gw-learned",
                          [f"{a.url},name=engine-a", f"{b.url},name=engine-b"],
                          "--policy", "round_robin")
    try:
        assert sorted(model_ids(gateway.url)) == ["model-a", "model-b"]
        for i in range(6):
            for model, replica in (("model-b", "engine-b"), ("model-a", "engine-a")):
                response = complete(gateway.url, model, f"turn {i}")
                assert response.status_code == 200, response.text
                assert response.headers["x-kvreuse-upstream"] == replica
                assert response.json()["model"] == model
        streamed = complete(gateway.url, "model-b", "stream me", stream=True)
        assert streamed.status_code == 200 and streamed.headers["x-kvreuse-upstream"] == "engine-b"
        assert chat(gateway.url, "model-b").headers["x-kvreuse-upstream"] == "engine-b"
        assert sample(gateway.url, "kvreuse_gateway_requests_total", upstream="engine-b",
                      policy="round_robin", branch="round_robin", status="200",
                      model="model-b") == 8.0
    finally:
        fleet.forget(gateway)


def test_unknown_model_is_a_404_listing_the_served_models(fleet: Fleet,
                                                          two_models: list[Process]) -> None:
    """A model no upstream serves gets OpenAI's error shape naming the field and the models."""
    a, b = two_models
    gateway = start_route(fleet, "gw-404", [f"{a.url},name=engine-a", f"{b.url},name=engine-b"])
    try:
        for response in (complete(gateway.url, "model-c"), chat(gateway.url, "model-c")):
            assert response.status_code == 404
            error = response.json()["error"]
            assert error["param"] == "model" and error["code"] == 404
            assert error["type"] == "NotFoundError"
            assert "'model-c'" in error["message"]
            assert "model-a, model-b" in error["message"]
        huge = complete(gateway.url, "m" * 100_000)
        assert huge.status_code == 404 and len(huge.content) < 2_000
        for bad in (None, 7, ["model-a"], ""):
            body = {"prompt": "x", **({} if bad is None else {"model": bad})}
            refused = httpx.post(gateway.url + "/v1/completions", json=body, timeout=10)
            assert refused.status_code == 400, bad
            assert refused.json()["error"]["param"] == "model"
        assert sample(gateway.url, "kvreuse_gateway_rejected_total", status="404",
                      model="other") == 3.0
    finally:
        fleet.forget(gateway)


def test_declared_models_win_over_what_the_upstream_says(fleet: Fleet,
                                                         two_models: list[Process]) -> None:
    """models=... is routed on as declared: the gateway does not ask /v1/models."""
    a, b = two_models
    gateway = start_route(fleet, "gw-declared", [
        f"{a.url},name=engine-a,models=model-z",
        f"{b.url},name=engine-b,models=model-b|model-b-alias",
    ])
    try:
        assert model_ids(gateway.url) == ["model-z", "model-b", "model-b-alias"]
        refused = complete(gateway.url, "model-a")  # engine-a serves it, but was declared z
        assert refused.status_code == 404
        assert "model-b, model-b-alias, model-z" in refused.json()["error"]["message"]
        routed = complete(gateway.url, "model-b-alias")  # engine-b itself refuses the alias
        assert routed.headers["x-kvreuse-upstream"] == "engine-b"
        assert routed.status_code == 404 and "this engine serves" in routed.text
        assert complete(gateway.url, "model-b").status_code == 200
    finally:
        fleet.forget(gateway)


def test_learned_models_follow_a_replaced_engine(fleet: Fleet, two_models: list[Process],
                                                 tmp_path: Any) -> None:
    """An engine restarted with another model is routed on its new model within a few health
    intervals; its old model disappears from routing and from /v1/models."""
    b = two_models[1]
    port = free_port()
    old = fleet.start_engine("engine-old", engine_spec("model-old"), port=port)
    gateway = start_route(fleet, "gw-changing",
                          [f"{old.url},name=swapped", f"{b.url},name=engine-b"],
                          "--health-interval", "0.2", "--readmit-after", "1")
    try:
        assert complete(gateway.url, "model-old").headers["x-kvreuse-upstream"] == "swapped"
        fleet.forget(old)
        new = fleet.start_engine("engine-new", engine_spec("model-new"), port=port)
        deadline = time.monotonic() + 20
        while "model-new" not in model_ids(gateway.url) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(model_ids(gateway.url)) == ["model-b", "model-new"]
        routed = complete(gateway.url, "model-new")
        assert routed.status_code == 200 and routed.headers["x-kvreuse-upstream"] == "swapped"
        gone = complete(gateway.url, "model-old")
        assert gone.status_code == 404
        assert "served models: model-b, model-new" in gone.json()["error"]["message"]
        assert "serves ['model-new'] (was ['model-old'])" in gateway.log_path.read_text()
        fleet.forget(new)
    finally:
        fleet.forget(gateway)


# ---------------------------------------------------------------------------------- in process


def models_app(state: dict[str, Any]) -> Starlette:
    """An upstream whose /v1/models answer the test scripts: ``state["models"]`` is raw bytes
    (or an int: that HTTP status); completions always succeed, naming this upstream."""

    async def models(request: Request) -> Response:
        answer = state["models"]
        state["asked"] = state.get("asked", 0) + 1
        if isinstance(answer, int):
            return Response(status_code=answer)
        return Response(answer, media_type="application/json")

    async def completions(request: Request) -> Response:
        body = await request.json()
        return JSONResponse({"id": "x", "object": "text_completion", "model": body["model"],
                             "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    return Starlette(routes=[Route("/v1/models", models), Route("/health", health),
                             Route("/v1/completions", completions, methods=["POST"])])


def listing(*names: str) -> bytes:
    import json

    return json.dumps({"object": "list", "data": [{"id": n, "object": "model"}
                                                  for n in names]}).encode()


def test_unreadable_model_lists_keep_routing_sane(gateway_factory: Factory,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """An upstream whose /v1/models is garbage only takes models no known upstream serves; once
    read, a later garbage answer keeps its last known models; an empty list serves nothing."""
    state: dict[str, Any] = {"models": b"{not json"}
    real = start_engine("real", model="sim", events=False)
    with ServerThread(models_app(state)) as odd:
        caplog.set_level(logging.INFO, "kvreuse.gateway")
        gateway = gateway_factory([UpstreamConfig(odd.url, name="odd"), real.upstream],
                                  policy="round_robin", health_interval_s=0.1)
        url = gateway.url
        assert {complete(url, "sim").headers["x-kvreuse-upstream"] for _ in range(4)} == {"real"}
        assert complete(url, "whatever").headers["x-kvreuse-upstream"] == "odd"
        assert model_ids(url) == ["sim"]
        state["models"] = listing("odd-model")
        wait_for(lambda: "odd-model" in model_ids(url))
        assert complete(url, "odd-model").headers["x-kvreuse-upstream"] == "odd"
        assert complete(url, "whatever").status_code == 404
        for garbage in (b"[]", b'{"data": [{"id": 5}]}', b"[" * 100_000, 500,
                        b'{"data": "x"}', b"\xff\xfe"):
            state["models"] = garbage
            asked = state["asked"]
            wait_for(lambda asked=asked: state["asked"] >= asked + 2)
            assert complete(url, "odd-model").headers["x-kvreuse-upstream"] == "odd", garbage
        state["models"] = listing()
        wait_for(lambda: model_ids(url) == ["sim"])
        assert complete(url, "odd-model").status_code == 404
        # Counted while odd still answers: once it stops, a probe may fail to connect.
        problems = [r.getMessage() for r in caplog.records
                    if r.getMessage().startswith("upstream odd: cannot read")]
    real.server.stop()
    assert len(problems) == 7, problems  # once per distinct problem, not once per probe
    assert "keeping its last known models ['odd-model']" in problems[-1]


def test_a_model_whose_upstreams_are_all_ejected_is_a_503(gateway_factory: Factory) -> None:
    """While every upstream of a model is ejected its requests get a 503 naming the model;
    other models are served as usual."""
    real = start_engine("real", model="sim", events=False)
    dead = UpstreamConfig(f"http://127.0.0.1:{free_port()}", name="dead", models=("gone",))
    gateway = gateway_factory([dead, real.upstream], eject_after=1, health_interval_s=0.1)
    wait_for(lambda: not gateway.gateway.router.upstreams["dead"].healthy)
    response = complete(gateway.url, "gone")
    assert response.status_code == 503
    assert response.json()["error"]["param"] == "model"
    assert "'gone'" in response.json()["error"]["message"]
    assert complete(gateway.url, "sim").status_code == 200
    real.server.stop()


def test_tenant_subsets_limit_the_models_a_tenant_sees(gateway_factory: Factory,
                                                       tmp_path: Any) -> None:
    """A tenant pinned to some upstreams gets a 404 for models only the others serve."""
    a = start_engine("a", model="model-a", events=False)
    b = start_engine("b", model="model-b", events=False)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('secret = "0123456789abcdef0123"\n[keys]\n"sk-1" = "acme"\n'
                       '[tenants.acme]\nupstreams = ["a"]\n')
    gateway = gateway_factory([a, b], tenants=str(tenants))
    headers = {"authorization": "Bearer sk-1"}
    body = {"prompt": "x", "max_tokens": 1}
    ok = httpx.post(gateway.url + "/v1/completions", json={**body, "model": "model-a"},
                    headers=headers, timeout=10)
    refused = httpx.post(gateway.url + "/v1/completions", json={**body, "model": "model-b"},
                         headers=headers, timeout=10)
    assert ok.status_code == 200
    assert refused.status_code == 404
    assert "served models: model-a " in refused.json()["error"]["message"]
    a.server.stop()
    b.server.stop()


# ---------------------------------------------------------------------------------- identity


def aliases(name: str, events: bool = True) -> Any:
    """An engine serving one cache under two names (vLLM's --served-model-name a b)."""
    return start_engine(name, model="sim", events=events, served_names=("sim", "sim-b"))


def test_approximate_trees_keep_one_namespace_per_model(gateway_factory: Factory) -> None:
    """cache_aware's trees never predict a hit from another model's requests."""
    engines = [aliases("e0", events=False), aliases("e1", events=False)]
    gateway = gateway_factory(engines, policy="cache_aware")
    prompt = text(60)
    first = complete(gateway.url, "sim", prompt)
    other_model = complete(gateway.url, "sim-b", prompt)
    same_model = complete(gateway.url, "sim", prompt)
    assert int(other_model.headers["x-kvreuse-predicted-cached-tokens"]) == 0
    assert int(same_model.headers["x-kvreuse-predicted-cached-tokens"]) > 0
    assert same_model.headers["x-kvreuse-upstream"] == first.headers["x-kvreuse-upstream"]
    trees = gateway.gateway.policy.estimator
    assert {identity.model for identity in trees._roots} == {"sim", "sim-b"}
    for engine in engines:
        engine.server.stop()


def test_kv_events_reach_the_policy_under_each_served_name(gateway_factory: Factory) -> None:
    """An engine's events count for every name it serves (one cache) and for no other model:
    the exact prediction for an alias equals what the engine reports."""
    shared, single = aliases("shared"), start_engine("single", model="other")
    gateway = gateway_factory([shared, single], policy="exact",
                              policy_options={"block_size": 4})
    prompt = text(60)
    complete(gateway.url, "sim", prompt)
    gateway.events_settled()
    alias = complete(gateway.url, "sim-b", prompt)
    predicted = int(alias.headers["x-kvreuse-predicted-cached-tokens"])
    assert predicted > 0
    assert predicted == alias.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    router = gateway.gateway.router
    tokens = router.tokens_for(parse_request("completion", {"model": "sim", "prompt": prompt}))
    fleet = FleetView((router.upstreams["shared"].load(),))
    policy = gateway.gateway.policy
    for model, expected_hit in (("sim", True), ("sim-b", True), ("other", False)):
        view = RequestView("probe", tokens, num_tokens(tokens), router.identity(model, None))
        assert (policy.predict(view, fleet)["shared"] > 0) is expected_hit, model
    for engine in (shared, single):
        engine.server.stop()


def h(value: int) -> BlockHash:
    return BlockHash(value.to_bytes(8, "big"))


def event_router(block_size: int) -> tuple[Router, UpstreamState, RoutingPolicy]:
    """A router over one upstream ``u`` that publishes KV events and serves model ``a``, with
    an ``exact`` policy of ``block_size``."""
    upstream = UpstreamState(UpstreamConfig("http://h:1", name="u", events="tcp://h:2"),
                             eject_after=3, readmit_after=2)
    policy = build_policy("exact", block_size=block_size)
    router = Router(policy, [upstream], TextApproximation())
    upstream.learned(({"id": "a"},))
    router.models_changed(upstream, None)
    return router, upstream, policy


def test_a_model_added_to_an_upstream_gets_its_cached_contents() -> None:
    """When an upstream's served set changes, the policy forgets it and is told its whole
    KV-event index again under the new names, holes included; dropped names predict nothing."""
    router, upstream, policy = event_router(block_size=2)
    events = (BlockStored((h(1), h(2), h(3)), None, (1, 2, 3, 4, 5, 6), 2),
              BlockStored((h(4),), h(1), (7, 8), 2),
              BlockStored((h(5), h(6)), None, (9, 9, 8, 8), 2),
              BlockRemoved((h(2),)))
    router.apply_batch("u", EventBatch(0, 0.0, events))
    prompts = [pack(p) for p in ([1, 2, 3, 4, 5, 6, 0], [1, 2, 7, 8, 0], [9, 9, 8, 8, 0],
                                 [1, 2, 3, 0])]
    fleet = FleetView((upstream.load(),))

    def predicted(model: str) -> list[int]:
        return [policy.predict(RequestView("r", p, num_tokens(p), router.identity(model, None)),
                               fleet)["u"] for p in prompts]

    truth = [router.indexes["u"].match(p) for p in prompts]
    assert truth == [2, 4, 4, 2]  # block 2 is a hole: 3..6 unreachable, 7..8 still held
    assert predicted("a") == truth and predicted("b") == [0, 0, 0, 0]
    before = upstream.models
    upstream.learned(({"id": "b"}, {"id": "c"}))
    router.models_changed(upstream, before)
    assert predicted("b") == truth and predicted("c") == truth
    assert predicted("a") == [0, 0, 0, 0]


def test_lora_adapters_are_models_of_their_own_in_the_event_index() -> None:
    """A LoRA adapter listed with a parent is its own namespace: blocks stored for the base
    model predict nothing for the adapter (vLLM hashes the LoRA in) and the other way round,
    both in the policy's mirror and in the gateway's own prediction."""
    upstream = UpstreamState(UpstreamConfig("http://h:1", name="u", events="tcp://h:2"),
                             eject_after=3, readmit_after=2)
    policy = build_policy("exact", block_size=2)
    router = Router(policy, [upstream], TextApproximation())
    assert upstream.learned(({"id": "base", "parent": None},
                             {"id": "lora-x", "parent": "base"}))
    router.models_changed(upstream, None)
    assert upstream.adapters == {"lora-x"}
    base_prompt, lora_prompt = [1, 2, 3, 4, 0], [5, 6, 7, 8, 0]
    router.apply_batch("u", EventBatch(0, 0.0, (
        BlockStored((h(1), h(2)), None, (1, 2, 3, 4), 2),
        BlockStored((h(3), h(4)), None, (5, 6, 7, 8), 2, lora_name="lora-x"))))
    fleet = FleetView((upstream.load(),))

    def predicted(model: str, prompt: list[int]) -> tuple[int, int]:
        """(the policy's mirror, the gateway's own exact prediction) for ``upstream``."""
        identity = router.identity(model, None)
        plan = router.plan(parse_request("completion", {"model": model, "prompt": prompt}),
                           "r", identity)
        assert plan is not None
        view = RequestView("r", pack(prompt), len(prompt), identity)
        return policy.predict(view, fleet)["u"], plan.first.predicted_cached_tokens

    assert predicted("base", base_prompt) == (4, 4)
    assert predicted("lora-x", base_prompt) == (0, 0)
    assert predicted("lora-x", lora_prompt) == (4, 4)
    assert predicted("base", lora_prompt) == (0, 0)


def test_retries_stay_among_the_upstreams_serving_the_model(gateway_factory: Factory) -> None:
    """A request whose first upstream is dead is retried only on another upstream serving its
    model (the model-b replica, first in the retry order by name, would have answered 404)."""
    a = start_engine("a", model="model-a", events=False)
    b = start_engine("0b", model="model-b", events=False)
    dead = UpstreamConfig(f"http://127.0.0.1:{free_port()}", name="dead", models=("model-a",))
    gateway = gateway_factory([dead, b, a], policy="round_robin", eject_after=100,
                              health_interval_s=60.0, retries=2)
    for i in range(4):
        response = complete(gateway.url, "model-a", f"retry {i}")
        assert response.status_code == 200, response.text
        assert response.headers["x-kvreuse-upstream"] == "a"
    assert sample(gateway.url, "kvreuse_gateway_retries_total", upstream="a") == 2.0
    a.server.stop()
    b.server.stop()


def test_a_batch_too_costly_to_tell_makes_the_index_start_over() -> None:
    """A forged batch whose holes would be told with O(n^2) tokens: the router forgets the
    upstream (KvCleared to the policy, index empty), counts the drop and logs; later events
    are learned again."""
    router, upstream, policy = event_router(block_size=16)
    blocks = 8_000
    chain = BlockStored(tuple(h(1 + i) for i in range(blocks)), None,
                        tuple(i % 50_000 for i in range(blocks * 16)), 16)
    router.apply_batch("u", EventBatch(0, 0.0, (chain,)))
    assert router.indexes["u"].tree_tokens == blocks * 16
    head = pack([i % 50_000 for i in range(64)] + [0])
    fleet = FleetView((upstream.load(),))
    head_view = RequestView("q", head, num_tokens(head), router.identity("a", None))
    assert policy.predict(head_view, fleet)["u"] == 64
    holes = tuple(BlockRemoved((h(1 + i),)) for i in range(0, blocks - 1, 2))
    router.apply_batch("u", EventBatch(1, 0.0, holes))
    assert router.indexes["u"].tree_tokens == 0
    assert router.streams["u"].dropped == {"too_costly": 1}
    assert policy.predict(head_view, fleet)["u"] == 0
    prompt = pack([5, 6, 7, 8] * 4 + [0])
    view = RequestView("r", prompt, num_tokens(prompt), router.identity("a", None))
    router.apply_batch("u", EventBatch(2, 0.0, (BlockStored((h(90_001),), None,
                                                            tuple([5, 6, 7, 8] * 4), 16),)))
    assert policy.predict(view, fleet)["u"] == 16
