"""relative_spill in a running gateway: its approximate trees are the gateway's to bound and
to report, as cache_aware's are (real engine, real HTTP)."""

from __future__ import annotations

import time
from collections.abc import Callable

from .fleet import RunningGateway, start_engine
from .test_kv_events_hostile import exchange, metric, text

Factory = Callable[..., RunningGateway]


def test_relative_spill_trees_stay_within_the_engines_budget(gateway_factory: Factory) -> None:
    """64 blocks of 4 tokens and a budget factor of 2: the policy's trees predict hits, show in
    the index gauges, and never hold more than 512 tokens for the engine under new prompts."""
    engine = start_engine("e0", events=False, num_blocks=64)
    try:
        gateway = gateway_factory([engine], policy="relative_spill", index_budget_factor=2.0)
        deadline = time.monotonic() + 5
        while gateway.gateway.router.budget_of("e0") != 512 and time.monotonic() < deadline:
            time.sleep(0.05)
        prompt = text(60)
        exchange(gateway, prompt)
        predicted, _ = exchange(gateway, prompt + " again")
        assert predicted > 0
        assert metric(gateway, "kvreuse_gateway_index_tokens", upstream="e0") > 0
        trees = gateway.gateway.policy.trees  # type: ignore[attr-defined]
        for _ in range(40):
            exchange(gateway, text(60))
            assert trees.tree_tokens("e0") <= 512
    finally:
        engine.server.stop()
