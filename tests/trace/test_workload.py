"""Traces as simulator traffic: block granularity (one id = one unit) against token granularity."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import pytest

from kvreuse.errors import ConfigError, InputFormatError, PoolTooSmallError
from kvreuse.sim import FleetConfig, ReplicaConfig, summarize
from kvreuse.sim.runner import simulate
from kvreuse.sim.units import TraceUnits
from kvreuse.trace import parse_trace_lines, trace_requests
from kvreuse.trace import workload as trace_workload

TRACE = Path(__file__).resolve().parents[2] / "../shared/data/mooncake_synthetic_trace.jsonl"
needs_trace = pytest.mark.skipif(not TRACE.exists(), reason="shared Mooncake trace not present")


def line(stamp: int, length: int, ids: list[int], output: int = 10) -> str:
    return (f'{{"timestamp": {stamp}, "input_length": {length}, "output_length": {output}, '
            f'"hash_ids": {ids}}}')


def test_block_granularity_is_one_unit_per_id() -> None:
    """Ids become dense unit tokens; lengths round to the nearest block; exact lengths kept."""
    records = parse_trace_lines([
        line(0, 1000, [2**40, 5], output=300),  # 1000 / 512 = 1.95 -> 2 units
        line(1, 600, [2**40, 6], output=100),  # 600 / 512 = 1.17 -> 1 unit, the tail dropped
        line(2, 100, [9]),  # at least one unit
    ])
    requests, units = trace_requests(records, 512, "block")
    assert [r.prompt_len for r in requests] == [2, 1, 1]
    assert [r.output_len for r in requests] == [1, 0, 0]
    assert requests[0].tokens[:4] == requests[1].tokens[:4] == b"\0\0\0\0"
    assert units.tokens_per_unit == 512 and units.prompt_tokens == {1: 1000, 2: 600, 3: 100}


def test_token_granularity_refuses_64_bit_ids() -> None:
    """Token granularity packs ids as 32-bit tokens, so larger ids name the fix."""
    records = parse_trace_lines([line(0, 512, [2**40])], "t.jsonl")
    with pytest.raises(InputFormatError, match=r"t\.jsonl:1.*block granularity"):
        trace_requests(records, 512, "token", "t.jsonl")


def test_token_granularity_refuses_a_trace_past_its_memory_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trace whose expanded prompts exceed the bound names block granularity, before any
    prompt is built; one at the bound is expanded."""
    records = parse_trace_lines([line(0, 1000, [1, 2]), line(1, 600, [1, 3])], "t.jsonl")
    held = (1000 + 600) * 4  # bytes of prompt tokens token granularity would hold
    monkeypatch.setattr(trace_workload, "MAX_TOKEN_GRANULARITY_BYTES", held - 1)
    with pytest.raises(ConfigError, match=r"t\.jsonl: token granularity would hold 1,600 .*"
                       r"block granularity"):
        trace_requests(records, 512, "token", "t.jsonl")
    monkeypatch.setattr(trace_workload, "MAX_TOKEN_GRANULARITY_BYTES", held)
    requests, _ = trace_requests(records, 512, "token", "t.jsonl")
    assert [r.prompt_len for r in requests] == [1000, 600]


def test_a_request_too_large_for_the_pool_is_told_in_tokens_at_block_granularity() -> None:
    """At block granularity the refusal counts tokens (and names the blocks), not units."""
    records = parse_trace_lines([line(0, 5000, list(range(10)), output=0)])
    requests, units = trace_requests(records, 512, "block")
    config = FleetConfig(1, ReplicaConfig(pool_tokens=2048))
    with pytest.raises(PoolTooSmallError) as refused:
        simulate("round_robin", {}, config, requests, units=units)
    assert str(refused.value) == (
        "request 1 needs 5,120 tokens of KV (prompt + output, 10 blocks of 512 tokens at "
        "block granularity) but a replica's pool holds 2,048; raise the cache size"
    )


def test_units_scale_fleet_cost_and_token_options() -> None:
    """Pools and rates become per unit; token-sized policy options too, given or default."""
    units = TraceUnits(512)
    fleet = units.fleet(FleetConfig(2, ReplicaConfig(pool_tokens=200_000, block_size=16)))
    assert fleet.replica.pool_tokens == 390 and fleet.replica.block_size == 1
    assert fleet.replica.prefill_tokens_per_s == pytest.approx(10_000 / 512)
    assert fleet.replica.time_per_output_token_s == pytest.approx(0.02 * 512)
    options = units.policy_options("prefix_hash", {"k": 2048})
    assert options == {"k": 4}
    assert units.policy_options("cache_aware", {})["block_size"] == 1
    assert TraceUnits(1).policy_options("prefix_hash", {}) == {}


def test_run_counts_come_back_in_tokens() -> None:
    """A block-granular run reports exact prompt tokens and cached tokens capped by them."""
    records = parse_trace_lines([line(0, 1000, [1, 2]), line(5000, 1000, [1, 2])])
    requests, units = trace_requests(records, 512, "block")
    config = FleetConfig(1, ReplicaConfig(pool_tokens=100_000))
    run = simulate("round_robin", {}, config, requests, units=units)
    assert run.config == config
    assert [(r.prompt_tokens, r.cached_tokens) for r in run.records] == [(1000, 0), (1000, 1000)]


@needs_trace
@pytest.mark.parametrize("policy", ["round_robin", "cache_aware", "prefix_hash"])
def test_block_and_token_granularity_agree_on_the_real_trace(policy: str) -> None:
    """On the Mooncake trace the two granularities agree: hit rate within 1.5 points, prefill
    GPU time within 2 %, TTFT p95 within 25 %."""
    with TRACE.open("rb") as lines:
        records = parse_trace_lines(islice(lines, 2000), str(TRACE))
    config = FleetConfig(8, ReplicaConfig(pool_tokens=200_000), kv_event_lag_s=0.0)
    figures = []
    for granularity in ("token", "block"):
        requests, units = trace_requests(records, 512, granularity)
        figures.append(summarize(simulate(policy, {}, config, requests, units=units)))
    token, block = figures
    assert abs(token.token_hit_rate - block.token_hit_rate) <= 0.015
    assert block.prefill_gpu_s_per_1k == pytest.approx(token.prefill_gpu_s_per_1k, rel=0.02)
    assert block.ttft_p95_s == pytest.approx(token.ttft_p95_s, rel=0.25)
    assert block.prompt_tokens == token.prompt_tokens
