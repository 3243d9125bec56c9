"""Named scenarios: the seeds' worked examples and the lab's missions, every parameter sourced.

Each :class:`Scenario` lists its parameters with the seed sentence they come from (or, where a
seed is silent, why the value was chosen), the runs it compares, and the ranges the seeds state
for their results (:class:`Expectation`), which ``tests/sim`` checks on shortened runs.

Variants change the traffic or the replicas, not the policy: ``no_cache`` turns prefix caching
off, ``timestamp`` puts the current second into the system prompt (mission two).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvreuse.errors import ConfigError
from kvreuse.sim.fleet import FleetConfig
from kvreuse.sim.replica import ReplicaConfig
from kvreuse.sim.requests import SimRequest
from kvreuse.sim.workloads import ChatWorkload, DocumentWorkload, RateStep, Tenant, TokenSpace
from kvreuse.tokens import TOKEN_BYTES, TokenBuffer

GIB = 1 << 30
BYTES_PER_TOKEN = 128 * 1024
"""Seed 000/001: an 8B GQA model in 16-bit precision keeps 128 KiB of KV per token."""


def gib_to_tokens(gib: float, bytes_per_token: int = BYTES_PER_TOKEN) -> int:
    return int(gib * GIB) // bytes_per_token


@dataclass(frozen=True, slots=True)
class Param:
    """A scenario parameter and where its value comes from."""

    name: str
    value: Any
    source: str


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One comparison row: a policy on a fleet size, under a variant, with policy options."""

    policy: str
    replicas: int
    variant: str = ""
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        extra = ",".join(f"{k}={_fmt(v)}" for k, v in self.options)
        name = f"{self.policy}[{extra}]" if extra else self.policy
        return f"{name} ({self.variant})" if self.variant else name


def _fmt(value: Any) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return str(value)


@dataclass(frozen=True, slots=True)
class Expectation:
    """A stated result: ``metric`` of the run matching ``policy``/``replicas``/``variant``/
    ``options`` lies in ``[low, high]``."""

    policy: str
    replicas: int
    metric: str
    low: float
    high: float
    source: str
    variant: str = ""
    options: tuple[tuple[str, Any], ...] = ()

    def matches(self, spec: RunSpec) -> bool:
        return (spec.policy, spec.replicas, spec.variant, spec.options) == (
            self.policy,
            self.replicas,
            self.variant,
            self.options,
        )


RequestsFactory = Callable[[int, str, float], list[SimRequest]]
FleetFactory = Callable[[int, str], FleetConfig]


@dataclass(frozen=True, slots=True)
class Scenario:
    """A named comparison. ``requests(seed, variant, scale)`` builds the traffic (``scale``
    shortens the measured window for quick runs); ``fleet(replicas, variant)`` the replicas."""

    name: str
    summary: str
    params: tuple[Param, ...]
    runs: tuple[RunSpec, ...]
    requests: RequestsFactory
    fleet: FleetFactory
    expectations: tuple[Expectation, ...] = ()
    policy_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    sweep_option: str | None = None

    def parameters(self) -> dict[str, Any]:
        return {
            p.name: _fmt(p.value) if isinstance(p.value, float) and math.isinf(p.value) else p.value
            for p in self.params
        }

    def select(
        self, policies: Sequence[str] | None = None, replicas: Sequence[int] | None = None
    ) -> list[RunSpec]:
        """The scenario's runs, or the cross product of ``policies`` × ``replicas`` × the
        scenario's variants when either is given."""
        if not policies and not replicas:
            return list(self.runs)
        variants = list(dict.fromkeys(spec.variant for spec in self.runs))
        chosen_policies = list(policies) if policies else list(
            dict.fromkeys(spec.policy for spec in self.runs)
        )
        chosen_replicas = list(replicas) if replicas else list(
            dict.fromkeys(spec.replicas for spec in self.runs)
        )
        return [
            RunSpec(policy, n, variant)
            for variant in variants
            for policy in chosen_policies
            for n in chosen_replicas
        ]


# ---------------------------------------------------------------------------- six-turn

def _six_turn_requests(seed: int, variant: str, scale: float) -> list[SimRequest]:
    """One conversation, built directly: the table has no randomness."""
    space = TokenSpace()
    history = space.fresh(1500)
    out = []
    for turn in range(6):
        user, answer = space.fresh(150), space.fresh(250)
        tokens = TokenBuffer(history + user)
        out.append(
            SimRequest(turn, 10.0 * turn, tokens, len(tokens) // TOKEN_BYTES, 250, answer,
                       session_id="six-turn")
        )
        history = TokenBuffer(tokens + answer)
    return out


def _six_turn_fleet(replicas: int, variant: str) -> FleetConfig:
    return FleetConfig(
        replicas=replicas,
        replica=ReplicaConfig(
            pool_tokens=1 << 20, time_per_output_token_s=0.02, prefix_caching=variant != "no_cache"
        ),
    )


SIX_TURN_SCENARIO = Scenario(
    name="six-turn",
    summary="seed 001's table: one 6-turn chat, 15,900 prefill tokens without cache, 2,400 with",
    params=(
        Param("system_tokens", 1500, "seed 001: 'a conversation with a 1,500-token system prompt'"),
        Param("user_tokens", 150, "seed 001: 'user messages of 150 tokens'"),
        Param("answer_tokens", 250, "seed 001: 'answers of 250 tokens'"),
        Param("turns", 6, "seed 001's table has six turns"),
        Param("answers_inserted_at_finish", True,
              "seed 001: 'answer 1 was inserted into the tree'"),
        Param("pool_tokens", 1 << 20,
              "large enough that nothing is evicted (the table assumes so)"),
    ),
    runs=(RunSpec("round_robin", 1, "no_cache"), RunSpec("round_robin", 1)),
    requests=_six_turn_requests,
    fleet=_six_turn_fleet,
    expectations=(
        Expectation("round_robin", 1, "prefilled_tokens", 15_900, 15_900,
                    "seed 001: 'total 15,900 prefill tokens'", "no_cache"),
        Expectation("round_robin", 1, "prefilled_tokens", 2_400, 2_400,
                    "seed 001: '2,400 prefill tokens -> 85% less'"),
    ),
)

# ---------------------------------------------------------------------------- belgavi

BELGAVI_POOL = gib_to_tokens(1.0) + 1536
BELGAVI = ChatWorkload(
    tenants=(Tenant("belgavi", 30.0),),
    duration_s=60.0,
    warmup_s=20.0,
    system_prompts=6,
    system_tokens=1500,
    turns=(3, 3),
    user_tokens=(150, 150),
    answer_tokens=(250, 250),
    gap_s=(8.0, 10.0),
)

BELGAVI_PARAMS = (
    Param("rate_rps", 30.0, "seed 001: 'a support chat at 30 requests per second'"),
    Param("system_prompts", 6, "seed 001: 'one of six 1,500-token system prompts (one per help "
          "topic)'"),
    Param("system_tokens", 1500, "seed 001: 'six 1,500-token system prompts'"),
    Param("turns", 3, "seed 001: 'an average of about 550 tokens of history, so about 2,050 "
          "tokens per prompt': with 150-token messages and 250-token answers, three turns "
          "give prompts of 1,650 / 2,050 / 2,450, mean 2,050"),
    Param("user_tokens", 150, "seed 001's table: 'user messages of 150 tokens'"),
    Param("answer_tokens", 250, "seed 001's table: 'answers of 250 tokens'"),
    Param("gap_s", "8-10", "seed 001: '8 to 10 seconds between turns'"),
    Param("prefill_tokens_per_s", 10_000.0, "seed 001: 'each replica prefills about 10,000 "
          "tokens per second'"),
    Param("overhead_s", 0.015, "seed 001: 'a request costs 15 ms of overhead'"),
    Param("pool_tokens", BELGAVI_POOL, "seed 001: 'a radix cache of 1 GB per replica' at 128 "
          "KiB/token = 8,192 tokens, plus 2,048 tokens for the one ~2,050-token prompt being "
          "prefilled, whose KV the seed's cache does not have to hold"),
    Param("time_per_output_token_s", 0.0, "seed 001's lab accounts prefill only (TTFT and "
          "prefill GPU-seconds) and gives no decode speed; with 0 only the prefilling request "
          "pins KV, as in the seed. Raise it to watch decode KV squeeze the cache ('cache "
          "memory is borrowed')"),
    Param("duration_s", 60.0, "seed 001: 'The lab generates sixty seconds of synthetic "
          "multi-turn chats'"),
    Param("warmup_s", 20.0, "two turn gaps, so every turn position is populated when "
          "measuring starts (our choice; the seed does not say)"),
    Param("spill_threshold_s", 0.2, "seed 001: 'cache-aware routing on three replicas and a "
          "200 ms spill threshold'"),
)


def _chat_requests(base: ChatWorkload) -> RequestsFactory:
    def build(seed: int, variant: str, scale: float) -> list[SimRequest]:
        workload = replace(base, duration_s=base.duration_s * scale)
        if variant == "timestamp":
            workload = replace(workload, volatile_at=200, volatile_from_s=0.0)
        return workload.generate(seed)

    return build


def _belgavi_fleet(replicas: int, variant: str) -> FleetConfig:
    return FleetConfig(
        replicas=replicas,
        replica=ReplicaConfig(
            pool_tokens=BELGAVI_POOL,
            prefill_tokens_per_s=10_000.0,
            overhead_s=0.015,
            time_per_output_token_s=0.0,
            prefix_caching=variant != "no_cache",
        ),
        kv_event_lag_s=0.0,
    )


_CACHE_TREE = {"cache_aware": {"tree_capacity_tokens": gib_to_tokens(1.0)}}

BELGAVI_SCENARIO = Scenario(
    name="belgavi",
    summary="seed 001's support chat: no cache vs round robin on 6 vs cache-aware on 3",
    params=BELGAVI_PARAMS,
    runs=(
        RunSpec("round_robin", 7, "no_cache"),
        RunSpec("round_robin", 6),
        RunSpec("cache_aware", 3),
        RunSpec("exact", 3),
        RunSpec("cache_aware_sglang", 3),
    ),
    requests=_chat_requests(BELGAVI),
    fleet=_belgavi_fleet,
    policy_options=_CACHE_TREE,
    expectations=(
        Expectation("round_robin", 7, "prefill_gpu_s_per_1k", 210, 230,
                    "seed 001: 'a request costs 15 ms of overhead plus about 205 ms of "
                    "prefill'", "no_cache"),
        Expectation("round_robin", 6, "token_hit_rate", 0.40, 0.50,
                    "seed 001: 'just under half the prompt tokens come from cache'"),
        Expectation("round_robin", 6, "prefill_gpu_s_per_1k", 110, 135,
                    "seed 001: 'prefill costs about 120 GPU-seconds per thousand requests'"),
        Expectation("cache_aware", 3, "token_hit_rate", 0.62, 0.72,
                    "seed 001: 'about two thirds of prompt tokens hit'"),
        Expectation("cache_aware", 3, "prefill_gpu_s_per_1k", 75, 92,
                    "seed 001: 'prefill falls to roughly 83 GPU-seconds per thousand requests'"),
        Expectation("cache_aware", 3, "ttft_p95_s", 0.0, 0.4,
                    "seed 001: 'while p95 TTFT stays under 0.4 s'"),
    ),
)

# ---------------------------------------------------------------------------- contract library

CONTRACT_POOL = gib_to_tokens(40.0)
CONTRACTS = DocumentWorkload(
    rate_rps=12.0,
    duration_s=300.0,
    warmup_s=120.0,
    documents=2000,
    document_tokens=6000,
    hot_docs=250,
    hot_fraction=0.8,
    question_tokens=(60, 100),
    answer_tokens=(400, 400),
)


def _contract_requests(seed: int, variant: str, scale: float) -> list[SimRequest]:
    return replace(CONTRACTS, duration_s=CONTRACTS.duration_s * scale).generate(seed)


def _contract_fleet(replicas: int, variant: str) -> FleetConfig:
    return FleetConfig(
        replicas=replicas,
        replica=ReplicaConfig(
            pool_tokens=CONTRACT_POOL,
            prefill_tokens_per_s=10_000.0,
            overhead_s=0.015,
            time_per_output_token_s=0.03,
        ),
    )


CONTRACT_SCENARIO = Scenario(
    name="contract-library",
    summary="seed 000's 2,000 contracts on 8 replicas: round robin vs prefix affinity (+ bound)",
    params=(
        Param("documents", 2000, "seed 000: 'a library of 2,000 contracts'"),
        Param("document_tokens", 6000, "seed 000: 'each about 6,000 tokens'"),
        Param("replicas", 8, "seed 000: 'on eight replicas of an 8-billion-parameter model'"),
        Param("pool_tokens", CONTRACT_POOL, "seed 000: 'Each replica has roughly 40 GiB of KV "
              "pool' at 128 KiB/token"),
        Param("hot_docs", 250, "seed 000: 'the 250 most active contracts receive 80 percent "
              "of questions'"),
        Param("hot_fraction", 0.8, "seed 000, same sentence"),
        Param("question_tokens", "60-100", "seed 000: 'prefill only the 60 to 100 tokens of the "
              "question'"),
        Param("answer_tokens", 400, "not in the seed; with 30 ms per token (12 s of decode) and "
              "12 req/s the running requests pin ~15 GiB per replica, seed 000's 'running "
              "requests pin about 15 GiB of it, which leaves about 25 GiB'"),
        Param("time_per_output_token_s", 0.03, "see answer_tokens"),
        Param("rate_rps", 12.0, "not in the seed; chosen so round robin's misses (6,000 tokens "
              "each at 10,000 tok/s) stay below the fleet's prefill capacity"),
        Param("prefill_tokens_per_s", 10_000.0, "seed 001's illustrative figure (seed 000 "
              "gives none)"),
        Param("k", 1024, "seed 000's choose(): k=1024"),
        Param("overload", 1.25, "seed 000's choose(): overload=1.25"),
        Param("warmup_s", 120.0, "long enough to fill 8 x 25 GiB of cache before measuring"),
    ),
    runs=(
        RunSpec("round_robin", 8),
        RunSpec("prefix_hash", 8, "", (("overload", None),)),
        RunSpec("prefix_hash", 8),
        RunSpec("prefix_hash", 8, "", (("load_metric", "in_flight"),)),
    ),
    requests=_contract_requests,
    fleet=_contract_fleet,
    expectations=(
        Expectation("round_robin", 8, "token_hit_rate", 0.0, 0.45,
                    "seed 000: 'most hot questions miss and every miss prefills 6,000 tokens'"),
        Expectation("prefix_hash", 8, "token_hit_rate", 0.7, 1.0,
                    "seed 000: 'Under prefix affinity ... hot questions mostly hit'",
                    "", (("overload", None),)),
        Expectation("prefix_hash", 8, "token_hit_rate", 0.5, 1.0,
                    "seed 000: 'route by affinity until a replica exceeds its share by a "
                    "margin, then spill' (spilled questions each prefill their contract once "
                    "more, so the bound costs some hits)", "", (("load_metric", "in_flight"),)),
    ),
)

# ---------------------------------------------------------------------------- missions


def _mission(name: str, summary: str, runs: tuple[RunSpec, ...],
             expectations: tuple[Expectation, ...], extra: tuple[Param, ...] = (),
             workload: ChatWorkload = BELGAVI, sweep_option: str | None = None) -> Scenario:
    return Scenario(
        name=name,
        summary=summary,
        params=BELGAVI_PARAMS + extra,
        runs=runs,
        requests=_chat_requests(workload),
        fleet=_belgavi_fleet,
        expectations=expectations,
        policy_options=_CACHE_TREE,
        sweep_option=sweep_option,
    )


MISSION_1 = _mission(
    "mission-1",
    "cache off vs on, belgavi traffic on 6 replicas behind round robin",
    (RunSpec("round_robin", 6, "no_cache"), RunSpec("round_robin", 6)),
    (
        Expectation("round_robin", 6, "token_hit_rate", 0.0, 0.0,
                    "cache off: nothing is reused", "no_cache"),
        Expectation("round_robin", 6, "token_hit_rate", 0.40, 0.50,
                    "seed 001: 'just under half the prompt tokens come from cache'"),
    ),
)

MISSION_2 = _mission(
    "mission-2",
    "a release puts the time to the second at token 200 of the system prompt",
    (RunSpec("exact", 6), RunSpec("exact", 6, "timestamp")),
    (
        Expectation("exact", 6, "token_hit_rate", 0.70, 0.80,
                    "seed 001: 'falls from the mid-70s'"),
        Expectation("exact", 6, "token_hit_rate", 0.38, 0.48,
                    "seed 001: '... to the low 40s in percent'", "timestamp"),
    ),
    (
        Param("volatile_at", 200, "seed 001: 'with 200 tokens before it and 1,300 after'"),
        Param("volatile_tokens", 4, "a time to the second, e.g. '12:34:56', is a few tokens"),
    ),
)

MISSION_3 = _mission(
    "mission-3",
    "serve the same load on fewer replicas by routing on prefixes",
    (RunSpec("round_robin", 6), RunSpec("round_robin", 3), RunSpec("cache_aware", 3)),
    (
        Expectation("cache_aware", 3, "ttft_p95_s", 0.0, 0.4,
                    "seed 001: 'Same traffic, less than half the prefill capacity'"),
        Expectation("round_robin", 3, "ttft_p95_s", 1.0, math.inf,
                    "round robin on 3 cannot keep up (seed 001: 'seven replicas just to keep "
                    "up' without cache)"),
    ),
)

SURGE = replace(
    BELGAVI,
    system_prompts=3,
    tenants=(Tenant("acme", 18.0, template_revision="acme-v1"),
             Tenant("globex", 12.0, template_revision="globex-v1")),
    steps=(RateStep(35.0, 55.0, 1.5, "acme"), RateStep(60.0, 62.0, 2.0)),
)
SPILLS = (0.0, 0.05, 0.1, 0.2, 0.4, 0.8, math.inf)
MISSION_4 = _mission(
    "mission-4",
    "tenant surge and a burst on 4 replicas; sweep the spill threshold (best is neither 0 nor "
    "infinite)",
    tuple(RunSpec("exact", 4, "", (("spill_threshold_s", s),)) for s in SPILLS),
    (),
    (
        Param("tenants", "acme 18 req/s, globex 12 req/s, 3 system prompts each",
              "seed 001: 'mission four adds a tenant surge and a burst'; the split is ours and "
              "keeps belgavi's 30 req/s and six system prompts"),
        Param("surge", "acme x1.5 from 35 s to 55 s", "ours: 20 s of 50 % more traffic"),
        Param("burst", "everyone x2 from 60 s to 62 s", "ours: a 2 s burst"),
        Param("replicas", 4, "ours: enough capacity that the surge is survivable"),
        Param("spill_threshold_s", "0 .. inf", "seed 001: 'the right spill threshold is "
              "neither zero nor infinite'"),
    ),
    SURGE,
    sweep_option="spill_threshold_s",
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
    )
}


def get_scenario(name: str) -> Scenario:
    scenario = SCENARIOS.get(name)
    if scenario is None:
        raise ConfigError(f"unknown scenario {name!r}; choose one of: {', '.join(SCENARIOS)}")
    return scenario
