"""The peers' published rules (llm-d's scorer pipeline, Dynamo's KV router cost), each checked
against a small example worked by hand from its documentation."""

from __future__ import annotations

import random

import pytest

from kvreuse.errors import ConfigError
from kvreuse.routing import (
    CacheMirror,
    DynamoKvCost,
    FleetView,
    KvStored,
    LlmdScorers,
    ReplicaLoad,
    RequestView,
    RoutingDecision,
    build_policy,
)
from kvreuse.routing.peers import select_worker, softmax_sample
from kvreuse.tokens import pack


def request(tokens: list[int], request_id: str = "q") -> RequestView:
    return RequestView(request_id, pack(tokens), len(tokens))


def view(*loads: tuple[int, int], now: float = 0.0) -> FleetView:
    """Replicas r0, r1, ... with (queued prefill tokens, queued requests)."""
    return FleetView(
        tuple(ReplicaLoad(f"r{i}", tokens, queued, queued) for i, (tokens, queued) in
              enumerate(loads)),
        now,
    )


PROMPT = list(range(1000, 1016))  # 16 tokens: four Dynamo blocks of 4, two llm-d blocks of 8


# ---------------------------------------------------------------------------- Dynamo


def test_dynamo_selects_the_documented_worker() -> None:
    """Dynamo's docs example ("Routing Concepts", weight 1.0): costs 1*8+10=18, 1*5+5=10,
    1*2+9=11 pick worker 2."""
    logits = {"w1": 1.0 * 8 + 10, "w2": 1.0 * 5 + 5, "w3": 1.0 * 2 + 9}
    assert select_worker(logits, lambda rid: 0, 0.0, random.Random(0)) == "w2"


def test_dynamo_cost_counts_queued_and_uncached_prefill_blocks_plus_decode_blocks() -> None:
    """Worked by hand, block 4: r0 holds 3 of the prompt's 4 blocks but has 40 tokens queued,
    cost (40 + 16 - 12)/4 + 4 = 15; r1 holds nothing and is idle, cost 16/4 + 4 = 8."""
    policy = DynamoKvCost(estimator=CacheMirror(block_size=4), block_size=4)
    policy.on_kv_event(KvStored("r0", pack(PROMPT[:12])))
    logits, matched = policy.logits(request(PROMPT), view((40, 1), (0, 0)))
    assert logits == {"r0": 15.0, "r1": 8.0}
    assert matched == {"r0": 12, "r1": 0}
    assert policy.route(request(PROMPT), view((40, 1), (0, 0))).replica == "r1"  # type: ignore[union-attr]


def test_dynamo_overlap_weight_scales_only_the_prefill_term() -> None:
    """With overlap_score_weight 0.1 the same fleet costs 0.1*11 + 4 = 5.1 and 0.1*4 + 4 = 4.4."""
    policy = DynamoKvCost(estimator=CacheMirror(block_size=4), block_size=4,
                          overlap_score_weight=0.1)
    policy.on_kv_event(KvStored("r0", pack(PROMPT[:12])))
    logits, _ = policy.logits(request(PROMPT), view((40, 1), (0, 0)))
    assert logits == pytest.approx({"r0": 5.1, "r1": 4.4})


def test_dynamo_active_blocks_count_shared_blocks_once() -> None:
    """Two routed requests sharing 3 blocks hold 5 distinct blocks; a third request with the
    same first 3 blocks adds its 1 new block: decode blocks 5 + 1 = 6 on r0, 4 on r1."""
    policy = DynamoKvCost(estimator=CacheMirror(block_size=4), block_size=4)
    idle = view((0, 0), (0, 0))
    for i, tail in enumerate(([1, 2, 3, 4], [5, 6, 7, 8])):
        req = request(PROMPT[:12] + tail, f"a{i}")
        policy.on_routed(req, RoutingDecision("r0", "min_cost"), 0.0)
    third = request([*PROMPT[:12], 9, 9, 9, 9], "b")
    logits, _ = policy.logits(third, idle)
    assert logits == {"r0": 16 / 4 + 6, "r1": 16 / 4 + 4}
    policy.on_finished(request([*PROMPT[:12], 1, 2, 3, 4], "a0"), "r0", 1.0)
    logits, _ = policy.logits(third, idle)
    assert logits["r0"] == 16 / 4 + 4 + 1


def test_dynamo_ties_go_to_the_smallest_tree() -> None:
    """At temperature 0 equal costs go to the worker whose cache holds fewer blocks."""
    sizes = {"r0": 9, "r1": 2, "r2": 5}
    picks = {select_worker({"r0": 3.0, "r1": 3.0, "r2": 3.0}, sizes.__getitem__, 0.0,
                           random.Random(seed)) for seed in range(20)}
    assert picks == {"r1"}


def test_dynamo_softmax_follows_range_normalised_costs() -> None:
    """Costs 0, 3, 9 at temperature 1 weigh exp(0), exp(-1/3), exp(-1): the cumulative
    probabilities are 1/2.0844 = 0.4797, 1.7165/2.0844 = 0.8235 and 1 (worked by hand)."""
    logits = {"w1": 0.0, "w2": 3.0, "w3": 9.0}
    assert softmax_sample(logits, 1.0, 0.47) == "w1"
    assert softmax_sample(logits, 1.0, 0.48) == "w2"
    assert softmax_sample(logits, 1.0, 0.82) == "w2"
    assert softmax_sample(logits, 1.0, 0.83) == "w3"
    assert softmax_sample({"a": 2.0, "b": 2.0}, 0.5, 0.49) == "a"


def test_dynamo_rejects_bad_options() -> None:
    """Negative weight or temperature, or an unknown estimator, are configuration errors."""
    for options in ({"overlap_score_weight": -1.0}, {"router_temperature": -0.1},
                    {"estimator": "psychic"}, {"block_size": 0}):
        with pytest.raises(ConfigError):
            build_policy("dynamo_kv", **options)


# ---------------------------------------------------------------------------- llm-d


def test_llmd_weighted_scores_match_a_hand_worked_example() -> None:
    """Weights 3/2/2, blocks of 8. r0 holds both prompt blocks, 4 queued, 50 % KV used:
    3*1 + 2*0 + 2*0.5 = 4; r1 holds nothing, 0 queued, idle: 0 + 2*1 + 2*1 = 4;
    r2 holds the first block, 2 queued, idle: 3*0.5 + 2*0.5 + 2*1 = 4.5 (picked)."""
    policy = LlmdScorers(hash_block_size=8, kv_capacity_tokens=32)
    warm = request(PROMPT, "warm")
    policy.on_routed(warm, RoutingDecision("r0", "max_score"), 0.0)
    half = request(PROMPT[:8] + [7] * 8, "half")
    policy.on_routed(half, RoutingDecision("r2", "max_score"), 0.0)
    policy.on_finished(half, "r2", 0.5)
    fleet = view((0, 4), (0, 0), (0, 2), now=1.0)
    scores = policy.scores(request(PROMPT, "new"), fleet)
    assert scores == pytest.approx({"r0": 4.0, "r1": 4.0, "r2": 4.5})
    assert policy.route(request(PROMPT, "new2"), fleet).replica == "r2"  # type: ignore[union-attr]


def test_llmd_queue_scores_are_neutral_when_queues_are_equal() -> None:
    """Equal queues score 1 everywhere (GIE's rule), so an idle fleet ties and the seeded
    max-score picker spreads ties over every replica."""
    policy = LlmdScorers(rng=random.Random(3))
    fleet = view((0, 1), (0, 1), (0, 1))
    assert set(policy.scores(request([5] * 10), fleet).values()) == {4.0}
    picks = {policy.route(request([i] * 10), fleet).replica for i in range(40)}  # type: ignore[union-attr]
    assert picks == {"r0", "r1", "r2"}


def test_llmd_prefix_scorer_hashes_at_most_max_prefix_blocks() -> None:
    """Only the first max_prefix_blocks whole blocks count: a 20-token prompt with blocks of 4
    and a cap of 2 scores 1.0 on a replica holding its first 8 tokens."""
    policy = LlmdScorers(hash_block_size=4, max_prefix_blocks=2, queue_weight=0.0,
                         kv_cache_weight=0.0)
    first = request(list(range(8)) + [99] * 12, "a")
    policy.on_routed(first, RoutingDecision("r1", "max_score"), 0.0)
    scores = policy.scores(request(list(range(8)) + [5] * 12, "b"), view((0, 0), (0, 0)))
    assert scores == {"r0": 0.0, "r1": 3.0}


def test_llmd_prompt_shorter_than_a_block_scores_no_prefix() -> None:
    """A prompt under one hash block has no hashes: the prefix scorer gives 0 everywhere."""
    policy = LlmdScorers(queue_weight=0.0, kv_cache_weight=0.0)
    tiny = request([1, 2, 3], "t")
    assert policy.scores(tiny, view((0, 0), (0, 0))) == {"r0": 0.0, "r1": 0.0}


def test_peers_are_in_the_registry() -> None:
    """Both peers build by name with their documented defaults."""
    llmd = build_policy("llm_d")
    dynamo = build_policy("dynamo_kv")
    assert isinstance(llmd, LlmdScorers) and (llmd.prefix_weight, llmd.queue_weight,
                                              llmd.kv_cache_weight) == (3.0, 2.0, 2.0)
    assert isinstance(dynamo, DynamoKvCost) and dynamo.overlap_score_weight == 1.0
    assert dynamo.router_temperature == 0.0 and dynamo.uses_kv_events


def test_bookkeeping_survives_reused_request_ids_and_stray_finishes() -> None:
    """Two sends under one request id (a retry, or two clients reusing an id) each release
    what they added; a finish for a request never routed changes nothing."""
    dynamo = DynamoKvCost(estimator=CacheMirror(block_size=4), block_size=4)
    llmd = LlmdScorers(kv_capacity_tokens=64, queue_weight=0.0, prefix_weight=0.0)
    same = request(PROMPT, "dup")
    for policy in (dynamo, llmd):
        policy.on_routed(same, RoutingDecision("r0", "x"), 0.0)
        policy.on_routed(same, RoutingDecision("r1", "x"), 0.0)
        policy.on_finished(request([1, 2, 3], "stranger"), "r0", 1.0)
    idle = view((0, 0), (0, 0))
    other = request([9] * 16, "p")  # shares no block: decode = active 4 + its own 4
    assert dynamo.logits(other, idle)[0] == {"r0": 4 + 4 + 4.0, "r1": 4 + 4 + 4.0}
    assert llmd.scores(request(PROMPT, "p"), idle) == {"r0": 2 * 0.75, "r1": 2 * 0.75}
    for policy in (dynamo, llmd):
        policy.on_finished(same, "r1", 2.0)
        policy.on_finished(same, "r0", 2.0)
        policy.on_finished(same, "r0", 3.0)  # a duplicate finish takes nothing more back
    assert dynamo.logits(other, idle)[0] == {"r0": 4 + 0 + 4.0, "r1": 4 + 0 + 4.0}
    assert llmd.scores(request(PROMPT, "p"), idle) == {"r0": 2.0, "r1": 2.0}
