"""An index that heals itself, and indexes that stay within their budgets: a running gateway
in front of real ``kvreuse engine`` replicas (real HTTP, real ZMQ)."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from kvreuse.gateway.upstreams import parse_kv_capacity
from kvreuse.kv_event_codec import EventBatch

from .fleet import RunningGateway, start_engine
from .test_kv_events_hostile import exchange, metric, text

Factory = Callable[..., RunningGateway]


@pytest.mark.parametrize(("policy", "options"), [
    ("exact", {}), ("relative_spill", {"estimator": "exact"}),
])
def test_a_stale_index_is_noticed_routed_around_and_rebuilt(
    gateway_factory: Factory, policy: str, options: dict[str, object]
) -> None:
    """The engine's cache is cleared while its events are lost before the index (the stream's
    numbering stays whole, so no gap shows): predictions exceed realized hits, the index turns
    suspect, is rebuilt from the replay socket, and exact mode returns with exact predictions."""
    engine = start_engine("e0", replay=True)
    try:
        gateway = gateway_factory([engine], policy=policy,
                                  policy_options={"block_size": 4, **options})
        router = gateway.gateway.router
        subscriber = gateway.gateway.subscribers[0]
        prompts = [text() for _ in range(5)]
        for prompt in prompts:
            exchange(gateway, prompt)
        deliver = subscriber._on_batch
        lost: list[EventBatch] = []
        subscriber._on_batch = lost.append  # events lost on the way, stream numbering intact
        assert httpx.post(engine.server.url + "/reset_prefix_cache").status_code == 200
        gateway.events_settled()
        subscriber._on_batch = deliver
        assert lost and router.indexes["e0"].num_blocks > 0  # the index still claims them

        stale = [exchange(gateway, prompt + " again") for prompt in prompts[:3]]
        assert all(predicted > realized == 0 for predicted, realized in stale), stale
        assert router.health["e0"].suspect
        assert metric(gateway, "kvreuse_gateway_index_suspect", upstream="e0") == 1
        assert metric(gateway, "kvreuse_gateway_index_prediction_error", upstream="e0") == 1
        deadline = time.monotonic() + 5
        while ((subscriber.stats.resyncs < 1 or subscriber.stats.state == "resyncing")
               and time.monotonic() < deadline):
            time.sleep(0.02)
        assert subscriber.stats.resyncs == 1
        gateway.events_settled()
        after = [exchange(gateway, prompt + " again") for prompt in prompts[:3]]
        time.sleep(1.0)  # min_suspect_s
        after += [exchange(gateway, prompt + " once more") for prompt in prompts[3:]]
        after += [exchange(gateway, prompt + " again") for prompt in prompts[3:]]
        assert not router.health["e0"].suspect, after
        assert metric(gateway, "kvreuse_gateway_index_suspect", upstream="e0") == 0
        final = [exchange(gateway, prompt + " again and again") for prompt in prompts]
        assert all(predicted == realized > 0 for predicted, realized in final), final
        assert metric(gateway, "kvreuse_gateway_index_state_changes_total", upstream="e0") == 2
        assert metric(gateway, "kvreuse_gateway_index_shortfall_tokens_total",
                      upstream="e0") >= sum(p for p, _ in stale)
    finally:
        engine.server.stop()


def test_kv_capacity_is_read_from_vllm_cache_config_info() -> None:
    """num_gpu_blocks x block_size from the info metric's labels; None until known."""
    line = ('vllm:cache_config_info{block_size="16",cache_dtype="auto",'
            'enable_prefix_caching="True",num_gpu_blocks="4096",prefix="a \\"b\\" c"} 1.0')
    assert parse_kv_capacity("# HELP x\n" + line + "\n") == 65_536
    assert parse_kv_capacity(line.replace('"4096"', '"None"')) is None
    assert parse_kv_capacity("vllm:num_requests_running 1\n") is None


def test_index_budget_follows_the_scraped_capacity(gateway_factory: Factory) -> None:
    """The engine's /metrics says 64 blocks of 4 tokens: every index for it is bounded to
    index_budget_factor times 256 tokens, and stays there under a flood of unique prompts."""
    engine = start_engine("e0", num_blocks=64)
    try:
        gateway = gateway_factory([engine], policy="exact", policy_options={"block_size": 4},
                                  index_budget_factor=1.5)
        deadline = time.monotonic() + 5
        while gateway.gateway.router.budget_of("e0") != 384 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(gateway, "kvreuse_gateway_index_budget_tokens", upstream="e0") == 384
        index = gateway.gateway.router.indexes["e0"]
        for _ in range(30):
            exchange(gateway, text(60))
            assert index.tree_tokens <= 384
        assert index.num_blocks > 0
    finally:
        engine.server.stop()


@pytest.mark.parametrize("policy", ["cache_aware", "relative_spill"])
def test_approximate_trees_show_in_the_gauges_within_budget(
    gateway_factory: Factory, policy: str
) -> None:
    """Under policies with approximate trees (no KV events) the index gauges report the trees,
    non-zero while they predict cached tokens, and the trees keep within the engine's budget
    (64 blocks of 4 tokens, factor 2: 512 tokens)."""
    engine = start_engine("e0", events=False, num_blocks=64)
    try:
        gateway = gateway_factory([engine], policy=policy, index_budget_factor=2.0)
        deadline = time.monotonic() + 5
        while gateway.gateway.router.budget_of("e0") != 512 and time.monotonic() < deadline:
            time.sleep(0.05)
        prompt = text(60)
        exchange(gateway, prompt)
        predicted, _ = exchange(gateway, prompt + " again")
        assert predicted > 0
        assert metric(gateway, "kvreuse_gateway_index_blocks", upstream="e0") > 0
        assert metric(gateway, "kvreuse_gateway_index_tokens", upstream="e0") > 0
        trees = gateway.gateway.policy.estimator  # type: ignore[attr-defined]
        for _ in range(40):
            exchange(gateway, text(60))
            assert trees.tree_tokens("e0") <= 512
    finally:
        engine.server.stop()


def test_answers_predicted_by_a_forgotten_index_do_not_count() -> None:
    """Requests predicted before the index was made cold (an engine restart with requests in
    flight) say nothing about the index now: they cannot make it suspect."""
    from kvreuse.gateway.config import UpstreamConfig
    from kvreuse.gateway.prompts import TextApproximation
    from kvreuse.gateway.router import Candidate, Router
    from kvreuse.gateway.upstreams import UpstreamState
    from kvreuse.routing import build_policy

    def router() -> Router:
        upstream = UpstreamState(UpstreamConfig("http://127.0.0.1:9", name="u0",
                                                events="tcp://127.0.0.1:9"),
                                 eject_after=3, readmit_after=2)
        return Router(build_policy("exact", block_size=4), [upstream], TextApproximation())

    restarted, steady = router(), router()
    for r in (restarted, steady):
        stale = Candidate(r.upstreams["u0"], "test", 400, 400, r.epochs["u0"])
        if r is restarted:
            r.mark_cold("u0", "publisher restarted")
        for _ in range(5):
            r.realized(stale, 420, 0)
    assert not restarted.health["u0"].suspect and restarted.health["u0"].predicted_tokens == 0
    assert steady.health["u0"].suspect and steady.suspects() == ["u0"]


@pytest.mark.parametrize("policy", ["exact", "relative_spill", "dynamo_kv"])
def test_every_kv_event_policy_gets_fallback_trees(policy: str) -> None:
    """The router gives any policy routing on KV events approximate trees to route a suspect
    upstream on, whatever its rule; one on its own trees needs none."""
    from kvreuse.gateway.config import UpstreamConfig
    from kvreuse.gateway.prompts import TextApproximation
    from kvreuse.gateway.router import Router
    from kvreuse.gateway.upstreams import UpstreamState
    from kvreuse.routing import ApproxTrees, build_policy

    upstream = UpstreamState(UpstreamConfig("http://127.0.0.1:9", name="u0",
                                            events="tcp://127.0.0.1:9"),
                             eject_after=3, readmit_after=2)
    options = {"estimator": "exact"} if policy == "relative_spill" else {}
    built = build_policy(policy, block_size=4, **options)
    Router(built, [upstream], TextApproximation())
    assert isinstance(getattr(built, "fallback", None), ApproxTrees)
    on_trees = build_policy("relative_spill")
    Router(on_trees, [upstream], TextApproximation())
    assert getattr(on_trees, "fallback", None) is None
