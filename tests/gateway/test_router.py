"""The gateway's router and its policy: what it asks of the policy, not of its name."""

from __future__ import annotations

import re

import pytest

from kvreuse.errors import ConfigError
from kvreuse.gateway.config import UpstreamConfig
from kvreuse.gateway.prompts import TextApproximation
from kvreuse.gateway.router import Router
from kvreuse.gateway.upstreams import UpstreamState
from kvreuse.routing import ApproxTrees, RequestView, RoutingDecision, build_policy
from kvreuse.tokens import pack


def upstream(name: str, events: bool) -> UpstreamState:
    return UpstreamState(UpstreamConfig(f"http://127.0.0.1:9/{name}", name=name,
                                        events="tcp://127.0.0.1:9" if events else None),
                         eject_after=3, readmit_after=2)


@pytest.mark.parametrize("options", [{"estimator": "exact"}, {"pins": {"acme": ["u0"]}}])
@pytest.mark.parametrize("name", ["exact", "cost", "dynamo_kv"])
def test_a_policy_on_kv_events_needs_an_upstream_that_publishes_them(
        name: str, options: dict[str, object]) -> None:
    """Any policy whose estimator learns from KV events, pinned or not, is refused without an
    events endpoint, naming the policy; with one it routes."""
    if name == "exact" and "estimator" in options:
        options = {}
    policy = build_policy(name, **options)  # type: ignore[arg-type]
    if not policy.uses_kv_events:
        policy = build_policy(name, estimator="exact", **options)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=re.escape(f"--policy {policy.name} routes on KV")):
        Router(policy, [upstream("u0", events=False)], TextApproximation())
    assert Router(policy, [upstream("u0", events=True)], TextApproximation()).indexes


@pytest.mark.parametrize("name", ["cache_aware", "cost", "relative_spill", "round_robin"])
def test_a_policy_on_its_own_record_needs_no_events(name: str) -> None:
    """Policies that learn from routing (or from nothing) run without KV events."""
    policy = build_policy(name)
    assert not policy.uses_kv_events
    router = Router(policy, [upstream("u0", events=False)], TextApproximation())
    assert (router.estimating is None) == (name == "round_robin")


@pytest.mark.parametrize("name", ["cache_aware", "cost", "relative_spill", "dynamo_kv"])
def test_the_budget_bounds_every_approximate_estimator(name: str) -> None:
    """set_budget caps the approximate trees of any policy holding them (one name for the
    estimator), and the index size counts what they hold."""
    policy = build_policy(name, estimator="approx")
    router = Router(policy, [upstream("u0", events=False)], TextApproximation())
    router.set_budget("u0", 100)
    assert router.estimating is not None
    trees = router.estimating.estimator
    assert isinstance(trees, ApproxTrees) and trees.capacity_of("u0") == 100
    for i in range(10):
        prompt = [1000 * i + t for t in range(60)]
        policy.on_routed(RequestView(f"q{i}", pack(prompt), 60), RoutingDecision("u0", "t"), i)
    assert 60 <= trees.tree_tokens("u0") <= 100
    assert router.index_size("u0").tokens == trees.tree_tokens("u0")


def test_an_upstream_kept_past_its_streak_is_chosen_only_when_nothing_else_is() -> None:
    """An upstream whose ejection the cap withheld is not the policy's choice while another
    upstream of the model is admitted, comes last among retries, and is routed to when it is
    the only one admitted."""
    from kvreuse.gateway.validation import parse_request

    first, kept, third = (upstream(name, events=False) for name in ("a", "kept", "c"))
    router = Router(build_policy("round_robin"), [first, kept, third], TextApproximation())
    for _ in range(3):
        kept.record_failure(probe=False, may_eject=False)
    assert kept.ejection_withheld
    parsed = parse_request("completion", {"model": "m", "prompt": "hello"})
    identity = router.identity("m", None)
    for i in range(6):
        plan = router.plan(parsed, f"r{i}", identity)
        assert plan is not None and plan.first.upstream is not kept
        assert [c.upstream.name for c in router.candidates(plan, 3)][-1] == "kept"
    first.healthy = third.healthy = False
    plan = router.plan(parsed, "alone", identity)
    assert plan is not None and plan.first.upstream is kept


def test_a_backup_is_chosen_only_while_no_other_upstream_of_the_model_is_admitted() -> None:
    """A backup upstream is not the policy's choice while another is admitted, comes after
    the others among retries, and takes requests when it is the only one admitted."""
    import dataclasses

    from kvreuse.gateway.validation import parse_request

    primary, other, spare = (upstream(name, events=False) for name in ("a", "b", "spare"))
    spare.config = dataclasses.replace(spare.config, backup=True)
    router = Router(build_policy("round_robin"), [primary, other, spare], TextApproximation())
    parsed = parse_request("completion", {"model": "m", "prompt": "hello"})
    identity = router.identity("m", None)
    for i in range(6):
        plan = router.plan(parsed, f"r{i}", identity)
        assert plan is not None and plan.first.upstream is not spare
        assert [c.upstream.name for c in router.candidates(plan, 3)][-1] == "spare"
    primary.healthy = other.healthy = False
    plan = router.plan(parsed, "alone", identity)
    assert plan is not None and plan.first.upstream is spare
