"""The gateway's router and its policy: what it asks of the policy, not of its name."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import pytest

from kvreuse.errors import ConfigError
from kvreuse.gateway.config import UpstreamConfig
from kvreuse.gateway.prompts import TextApproximation
from kvreuse.gateway.router import Router
from kvreuse.gateway.upstreams import UpstreamState
from kvreuse.gateway.validation import parse_request
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


def kept_past_its_streak(state: UpstreamState) -> None:
    for _ in range(3):
        state.record_failure(probe=False, may_eject=False)
    assert state.ejection_withheld


def made_a_backup(state: UpstreamState) -> None:
    state.config = dataclasses.replace(state.config, backup=True)


@pytest.mark.parametrize("demote", [kept_past_its_streak, made_a_backup])
def test_a_demoted_upstream_is_chosen_only_when_nothing_else_is(
        demote: Callable[[UpstreamState], None]) -> None:
    """An upstream kept admitted past its streak of failed requests (the ejection cap), or a
    backup, is not the policy's choice while another upstream of the model is admitted,
    comes last among retries, and is routed to when it is the only one admitted."""
    first, demoted, third = (upstream(name, events=False) for name in ("a", "demoted", "c"))
    router = Router(build_policy("round_robin"), [first, demoted, third], TextApproximation())
    demote(demoted)
    parsed = parse_request("completion", {"model": "m", "prompt": "hello"})
    identity = router.identity("m", None)
    for i in range(6):
        plan = router.plan(parsed, f"r{i}", identity)
        assert plan is not None and plan.first.upstream is not demoted
        assert [c.upstream.name for c in router.candidates(plan, 3)][-1] == "demoted"
    first.healthy = third.healthy = False
    plan = router.plan(parsed, "alone", identity)
    assert plan is not None and plan.first.upstream is demoted


def test_retries_try_backups_before_an_upstream_kept_past_its_streak() -> None:
    """Retry order: the admitted upstreams, then backups, then those the cap keeps admitted
    (a backup is healthy; a kept one has just failed eject_after requests in a row)."""
    chosen, plain, spare, kept = (upstream(name, events=False)
                                  for name in ("chosen", "plain", "spare", "kept"))
    router = Router(build_policy("round_robin"), [chosen, plain, spare, kept],
                    TextApproximation())
    made_a_backup(spare)
    kept_past_its_streak(kept)
    parsed = parse_request("completion", {"model": "m", "prompt": "hello"})
    identity = router.identity("m", None)
    plan = router.plan(parsed, "r", identity)
    assert plan is not None
    order = [c.upstream.name for c in router.candidates(plan, 4)]
    assert order[2:] == ["spare", "kept"] and set(order[:2]) == {"chosen", "plain"}
