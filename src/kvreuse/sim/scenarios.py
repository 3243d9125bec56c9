"""Named scenarios: the seeds' worked examples and the lab's missions, every parameter sourced.

Each :class:`Scenario` lists its parameters with the seed sentence they come from (or, where a
seed is silent, why the value was chosen), the runs it compares, and the ranges the seeds state
for their results (:class:`Expectation`), which ``tests/sim`` checks. The numbers live in
:mod:`kvreuse.sim.scenario_params`, the types in :mod:`kvreuse.sim.scenario_model`; this module
builds traffic and fleets from them.

Variants change the traffic or the replicas, not the policy: ``no_cache`` turns prefix caching
off, ``timestamp`` puts the current second into the system prompt (mission two), ``block``
replaces the replicas' radix trees by vLLM's block pool (``cache_kind="block"``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvreuse.errors import ConfigError
from kvreuse.sim.config import FleetConfig, ReplicaConfig
from kvreuse.sim.requests import SimRequest
from kvreuse.sim.scenario_model import (
    BYTES_PER_TOKEN,
    GIB,
    Expectation,
    FleetFactory,
    Param,
    RequestsFactory,
    RunSpec,
    Scenario,
    gib_to_tokens,
)
from kvreuse.sim.scenario_params import (
    BELGAVI,
    BELGAVI_EXPECTATIONS,
    BELGAVI_PARAMS,
    BELGAVI_POOL,
    BELGAVI_RUNS,
    CACHE_TREE_OPTIONS,
    CONTRACT_EXPECTATIONS,
    CONTRACT_PARAMS,
    CONTRACT_POOL,
    CONTRACT_RUNS,
    CONTRACTS,
    LONG_CONTEXT,
    LONG_CONTEXT_EXPECTATIONS,
    LONG_CONTEXT_PARAMS,
    LONG_CONTEXT_POOL,
    LONG_CONTEXT_RUNS,
    MISSION_1_EXPECTATIONS,
    MISSION_1_RUNS,
    MISSION_2_EXPECTATIONS,
    MISSION_2_PARAMS,
    MISSION_2_RUNS,
    MISSION_3_EXPECTATIONS,
    MISSION_3_RUNS,
    MISSION_4_PARAMS,
    MISSION_4_RUNS,
    MULTI_MODEL_EXPECTATIONS,
    MULTI_MODEL_PARAMS,
    MULTI_MODEL_RUNS,
    MULTI_MODEL_WORKLOADS,
    SIX_TURN_ANSWER_TOKENS,
    SIX_TURN_BLOCK_SIZE,
    SIX_TURN_EXPECTATIONS,
    SIX_TURN_GAP_S,
    SIX_TURN_PARAMS,
    SIX_TURN_POOL,
    SIX_TURN_RUNS,
    SIX_TURN_SYSTEM_TOKENS,
    SIX_TURN_TURNS,
    SIX_TURN_USER_TOKENS,
    SPILLS,
    SURGE,
    multi_model_serving,
)
from kvreuse.sim.workloads import ChatWorkload, TokenSpace, merge_workloads
from kvreuse.tokens import TOKEN_BYTES, TokenBuffer

__all__ = [
    "BELGAVI",
    "BYTES_PER_TOKEN",
    "GIB",
    "SCENARIOS",
    "SPILLS",
    "SURGE",
    "Expectation",
    "FleetFactory",
    "Param",
    "RequestsFactory",
    "RunSpec",
    "Scenario",
    "belgavi_fleet",
    "get_scenario",
    "gib_to_tokens",
]


def _replica_variant(config: ReplicaConfig, variant: str) -> ReplicaConfig:
    """What a variant changes in the replicas: caching off, or vLLM's block pool."""
    if variant == "no_cache":
        return replace(config, prefix_caching=False)
    if variant == "block":
        return replace(config, cache_kind="block")
    return config


def _fleet(replica: ReplicaConfig, **options: Any) -> FleetFactory:
    """Fleets of ``replica`` as each variant changes it, with ``options`` for
    :class:`FleetConfig` (e.g. ``kv_event_lag_s=0.0``)."""

    def build(replicas: int, variant: str) -> FleetConfig:
        return FleetConfig(replicas=replicas, replica=_replica_variant(replica, variant), **options)

    return build


# ---------------------------------------------------------------------------- six-turn

def _six_turn_requests(seed: int, variant: str, scale: float) -> list[SimRequest]:
    """One conversation, built directly: the table has no randomness."""
    space = TokenSpace()
    history = space.fresh(SIX_TURN_SYSTEM_TOKENS)
    out = []
    for turn in range(SIX_TURN_TURNS):
        user, answer = space.fresh(SIX_TURN_USER_TOKENS), space.fresh(SIX_TURN_ANSWER_TOKENS)
        tokens = TokenBuffer(history + user)
        out.append(
            SimRequest(turn, SIX_TURN_GAP_S * turn, tokens, len(tokens) // TOKEN_BYTES,
                       SIX_TURN_ANSWER_TOKENS, answer, session_id="six-turn")
        )
        history = TokenBuffer(tokens + answer)
    return out


SIX_TURN_SCENARIO = Scenario(
    name="six-turn",
    summary="the six-turn chat: one conversation, 15,900 prefill tokens without cache, 2,400 "
    "with a radix tree, a few more with vLLM's 16-token blocks",
    params=SIX_TURN_PARAMS,
    runs=SIX_TURN_RUNS,
    requests=_six_turn_requests,
    fleet=_fleet(ReplicaConfig(pool_tokens=SIX_TURN_POOL, time_per_output_token_s=0.02,
                               block_size=SIX_TURN_BLOCK_SIZE)),
    expectations=SIX_TURN_EXPECTATIONS,
)

# ---------------------------------------------------------------------------- belgavi


def chat_requests(base: ChatWorkload) -> RequestsFactory:
    """Traffic of a chat scenario: ``scale`` stretches the measured window; the ``timestamp``
    variant stamps the second at token 200 of the system prompt from the start."""

    def build(seed: int, variant: str, scale: float) -> list[SimRequest]:
        workload = replace(base, duration_s=base.duration_s * scale)
        if variant == "timestamp":
            workload = replace(workload, volatile_at=200, volatile_from_s=0.0)
        return workload.generate(seed)

    return build


belgavi_fleet = _fleet(
    ReplicaConfig(pool_tokens=BELGAVI_POOL, prefill_tokens_per_s=10_000.0, overhead_s=0.015,
                  time_per_output_token_s=0.0),
    kv_event_lag_s=0.0,
)
"""Seed 001's replicas (see :data:`~kvreuse.sim.scenario_params.BELGAVI_PARAMS`)."""


BELGAVI_SCENARIO = Scenario(
    name="belgavi",
    summary="Belgavi's support chat: no cache vs round robin on 6 vs cache-aware on 3",
    params=BELGAVI_PARAMS,
    runs=BELGAVI_RUNS,
    requests=chat_requests(BELGAVI),
    fleet=belgavi_fleet,
    policy_options=CACHE_TREE_OPTIONS,
    expectations=BELGAVI_EXPECTATIONS,
)

# ---------------------------------------------------------------------------- contract library


def _contract_requests(seed: int, variant: str, scale: float) -> list[SimRequest]:
    return replace(CONTRACTS, duration_s=CONTRACTS.duration_s * scale).generate(seed)


CONTRACT_SCENARIO = Scenario(
    name="contract-library",
    summary="a library of 2,000 contracts on 8 replicas: round robin vs prefix affinity (+ bound)",
    params=CONTRACT_PARAMS,
    runs=CONTRACT_RUNS,
    requests=_contract_requests,
    fleet=_fleet(ReplicaConfig(pool_tokens=CONTRACT_POOL, prefill_tokens_per_s=10_000.0,
                               overhead_s=0.015, time_per_output_token_s=0.03)),
    expectations=CONTRACT_EXPECTATIONS,
)

# ---------------------------------------------------------------------------- long context


def _long_context_requests(seed: int, variant: str, scale: float) -> list[SimRequest]:
    return replace(LONG_CONTEXT, duration_s=LONG_CONTEXT.duration_s * scale).generate(seed)


LONG_CONTEXT_SCENARIO = Scenario(
    name="long-context",
    summary="stress: 12,000-token documents on 4 replicas, where a fixed 200 ms spill bound "
    "scatters the hot set",
    params=LONG_CONTEXT_PARAMS,
    runs=LONG_CONTEXT_RUNS,
    requests=_long_context_requests,
    fleet=_fleet(ReplicaConfig(pool_tokens=LONG_CONTEXT_POOL, time_per_output_token_s=0.02),
                 kv_event_lag_s=0.0),
    expectations=LONG_CONTEXT_EXPECTATIONS,
)

# ---------------------------------------------------------------------------- missions


def _mission(
    name: str,
    summary: str,
    runs: tuple[RunSpec, ...],
    expectations: tuple[Expectation, ...],
    extra: tuple[Param, ...] = (),
    workload: ChatWorkload = BELGAVI,
    sweep_option: str | None = None,
) -> Scenario:
    return Scenario(
        name=name,
        summary=summary,
        params=BELGAVI_PARAMS + extra,
        runs=runs,
        requests=chat_requests(workload),
        fleet=belgavi_fleet,
        expectations=expectations,
        policy_options=CACHE_TREE_OPTIONS,
        sweep_option=sweep_option,
    )


MISSION_1 = _mission(
    "mission-1",
    "cache off vs on, belgavi traffic on 6 replicas behind round robin",
    MISSION_1_RUNS,
    MISSION_1_EXPECTATIONS,
)
MISSION_2 = _mission(
    "mission-2",
    "a release puts the time to the second at token 200 of the system prompt",
    MISSION_2_RUNS,
    MISSION_2_EXPECTATIONS,
    MISSION_2_PARAMS,
)
MISSION_3 = _mission(
    "mission-3",
    "serve the same load on fewer replicas by routing on prefixes",
    MISSION_3_RUNS,
    MISSION_3_EXPECTATIONS,
)
MISSION_4 = _mission(
    "mission-4",
    "tenant surge and a burst on 4 replicas; sweep the spill threshold (best is neither 0 nor "
    "infinite)",
    MISSION_4_RUNS,
    (),
    MISSION_4_PARAMS,
    SURGE,
    sweep_option="spill_threshold_s",
)

# ---------------------------------------------------------------------------- multi-model


def _multi_model_requests(seed: int, variant: str, scale: float) -> list[SimRequest]:
    """Each model's chat traffic (its own arrivals: seeds ``seed`` and ``seed + 1``), merged."""
    build = [chat_requests(workload) for workload in MULTI_MODEL_WORKLOADS]
    return merge_workloads([make(seed + i, variant, scale) for i, make in enumerate(build)])


def multi_model_fleet(replicas: int, variant: str) -> FleetConfig:
    """Belgavi's replicas, each serving the models :func:`multi_model_serving` gives it."""
    return replace(belgavi_fleet(replicas, variant), models=multi_model_serving(replicas))


MULTI_MODEL = Scenario(
    name="multi-model",
    summary="two models on partly overlapping replicas (model-a on 3 of 4, model-b on 2): "
    "every policy routes among the replicas serving the request's model",
    params=MULTI_MODEL_PARAMS,
    runs=MULTI_MODEL_RUNS,
    requests=_multi_model_requests,
    fleet=multi_model_fleet,
    policy_options=CACHE_TREE_OPTIONS,
    expectations=MULTI_MODEL_EXPECTATIONS,
)

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        SIX_TURN_SCENARIO,
        BELGAVI_SCENARIO,
        CONTRACT_SCENARIO,
        MISSION_1,
        MISSION_2,
        MISSION_3,
        MISSION_4,
        LONG_CONTEXT_SCENARIO,
        MULTI_MODEL,
    )
}


def get_scenario(name: str) -> Scenario:
    scenario = SCENARIOS.get(name)
    if scenario is None:
        raise ConfigError(f"unknown scenario {name!r}; choose one of: {', '.join(SCENARIOS)}")
    return scenario
