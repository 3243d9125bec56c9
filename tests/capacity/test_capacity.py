"""Capacity planning: KV bytes per token, idle budget, hot set and verdict; the seeds' numbers."""

from __future__ import annotations

import json

import pytest

from kvreuse.capacity import (
    GIB,
    MIB,
    build_report,
    cache_budget,
    kv_shape_from_config,
    parse_workload,
    trace_hot_set,
    verdict,
)
from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.trace.format import parse_trace_lines

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}
SEED_000_WORKLOAD = {
    "replicas": 8,
    "prefix_groups": [
        {"name": "contracts", "count": 2000, "tokens": 6000, "hot_count": 250,
         "hot_share": 0.8, "tail_tokens": 80},
    ],
}
SEED_001_WORKLOAD = {
    "prefix_groups": [{"name": "system prompts", "count": 6, "tokens": 1500}],
    "conversations": {"requests_per_second": 16, "think_time_seconds": [8, 10],
                      "history_tokens": [1000, 3000]},
}


def test_8b_gqa_model_takes_128_kib_per_token() -> None:
    """Seed 000: 2 x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB."""
    shape = kv_shape_from_config(LLAMA_8B)
    assert shape.head_dim == 128
    assert shape.bytes_per_token == 128 * 1024


def test_fp8_kv_cache_halves_it() -> None:
    """--kv-cache-dtype fp8 stores one byte per element."""
    assert kv_shape_from_config(LLAMA_8B, "fp8").bytes_per_token == 64 * 1024


def test_mla_models_cache_one_latent_per_layer() -> None:
    """DeepSeek-V3-style MLA: layers x (kv_lora_rank + rope dims) x dtype bytes."""
    config = {"num_hidden_layers": 61, "num_attention_heads": 128, "hidden_size": 7168,
              "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}
    assert kv_shape_from_config(config).bytes_per_token == 61 * 576 * 2


def test_multimodal_configs_use_their_text_config() -> None:
    """A VLM config's text_config decides the KV size."""
    config = {"model_type": "llava", "text_config": LLAMA_8B}
    assert kv_shape_from_config(config).bytes_per_token == 128 * 1024


def test_missing_layer_count_names_the_key() -> None:
    """A config without num_hidden_layers is an InputFormatError naming it."""
    with pytest.raises(InputFormatError, match="num_hidden_layers"):
        kv_shape_from_config({"num_attention_heads": 8})


@pytest.mark.parametrize(
    ("change", "needle"),
    [({"num_key_value_heads": 0}, "'num_key_value_heads'"),
     ({"num_key_value_heads": True}, "'num_key_value_heads'"),
     ({"num_hidden_layers": 10**30}, "at most 1,048,576"),
     ({"head_dim": 0}, "'head_dim'"),
     ({"hidden_size": 16}, "smaller than 'num_attention_heads'"),
     ({"kv_lora_rank": 512, "qk_rope_head_dim": "64"}, "'qk_rope_head_dim'"),
     ({"torch_dtype": 0}, "'torch_dtype' must be a dtype name"),
     ({"torch_dtype": []}, "'torch_dtype' must be a dtype name"),
     ({"torch_dtype": None, "dtype": ""}, "'dtype' must be a dtype name")],
)
def test_malformed_shapes_are_refused_not_guessed(change: dict[str, object], needle: str) -> None:
    """A zero, boolean or absurd size is an error naming the key, never a silent fallback."""
    with pytest.raises(InputFormatError, match=needle):
        kv_shape_from_config({**LLAMA_8B, **change})


def test_a_dtype_unset_or_null_is_bfloat16_and_dtype_stands_in_for_torch_dtype() -> None:
    """No dtype key, or null, is bfloat16 (2 bytes); newer configs' 'dtype' is read when
    'torch_dtype' is absent."""
    plain = {k: v for k, v in LLAMA_8B.items() if k != "torch_dtype"}
    assert kv_shape_from_config(plain) == kv_shape_from_config({**plain, "torch_dtype": None})
    assert kv_shape_from_config({**plain, "dtype": "float32"}).bytes_per_token == (
        2 * kv_shape_from_config(plain).bytes_per_token)


def test_null_kv_heads_and_head_dim_take_hf_defaults() -> None:
    """null num_key_value_heads is one per attention head; null head_dim is hidden / heads."""
    config = {**LLAMA_8B, "num_key_value_heads": None, "head_dim": None}
    assert kv_shape_from_config(config).bytes_per_token == 2 * 32 * 32 * 128 * 2


def test_budget_from_gpu_memory_weights_and_running_pin() -> None:
    """80 GiB x 0.9 - 15 GiB weights = 57 GiB pool; 64 requests x 2,048 tokens pin 16 GiB."""
    budget = cache_budget(
        bytes_per_token=128 * 1024, gpu_memory_gib=80, utilisation=0.9, weights_gib=15,
        running_requests=64, running_tokens=2048,
    )
    assert budget.pool_bytes == pytest.approx(57 * GIB)
    assert budget.pinned_bytes == 16 * GIB
    assert budget.idle_bytes == pytest.approx(41 * GIB)


def test_budget_needs_a_pool_or_the_memory_to_derive_it() -> None:
    """Neither --kv-pool-gib nor GPU memory and weights: a ConfigError naming the options."""
    with pytest.raises(ConfigError, match="--kv-pool-gib"):
        cache_budget(bytes_per_token=1)


def test_seed_000_contract_library() -> None:
    """750 MiB per contract, 33 per replica's 25 GiB, 264 across 8 replicas: route by prefix."""
    per_token = kv_shape_from_config(LLAMA_8B).bytes_per_token
    assert 6000 * per_token == 750 * MIB
    parts, replicas = parse_workload(SEED_000_WORKLOAD)
    assert replicas == 8
    budget = cache_budget(bytes_per_token=per_token, kv_pool_gib=40, pinned_gib=15)
    assert budget.idle_bytes == 25 * GIB
    report = build_report(per_token, budget, 8, parts)
    contracts = report.parts[0]
    assert report.entries_per_replica(contracts) == 33
    assert report.entries_per_replica(contracts) * 8 == 264
    assert contracts.entries is not None and contracts.entries / 8 <= 33
    assert report.verdict.decision == "route-by-prefix"


def test_seed_001_open_history_is_25_to_50_gib() -> None:
    """16 req/s, 8-10 s between turns, 1,000-3,000 tokens of history: within 25-50 GiB;
    six 1,500-token system prompts are about 1.1 GiB."""
    per_token = kv_shape_from_config(LLAMA_8B).bytes_per_token
    parts, _ = parse_workload(SEED_001_WORKLOAD)
    system, history = parts
    assert system.high_tokens * per_token / GIB == pytest.approx(1.1, abs=0.05)
    assert 25 <= history.low_tokens * per_token / GIB <= history.high_tokens * per_token / GIB <= 50
    budget = cache_budget(bytes_per_token=per_token, kv_pool_gib=6, pinned_gib=2)
    assert build_report(per_token, budget, 6, parts).verdict.decision == "add-replicas"


@pytest.mark.parametrize(
    ("hot_gib", "decision", "needed"),
    [(10, "round-robin", 4), (80, "route-by-prefix", 4), (200, "add-replicas", 8)],
)
def test_verdicts(hot_gib: float, decision: str, needed: int) -> None:
    """Fits one replica / fits the fleet / fits neither (25 GiB idle x 4 replicas)."""
    result = verdict(hot_gib * GIB, 25 * GIB, 4)
    assert result.decision == decision
    assert result.replicas_needed == needed


def test_workload_errors_name_the_field() -> None:
    """A bad prefix group names its index and key."""
    with pytest.raises(InputFormatError, match=r"prefix_groups\[0\].*'tokens'"):
        parse_workload({"prefix_groups": [{"count": 3}]})


@pytest.mark.parametrize("replicas", [True, 10**30, 0, 2.0, "8"])
def test_a_replica_count_that_is_no_fleet_is_refused(replicas: object) -> None:
    """``true`` (a JSON bool is a Python int) and 1e30 were taken as fleet sizes and printed
    as "the fleet of True"; they, zero, a float and a string are refused naming the key."""
    group = {"count": 6, "tokens": 1500}
    with pytest.raises(InputFormatError, match="'replicas' must be a whole number from 1"):
        parse_workload({"prefix_groups": [group], "replicas": replicas})


@pytest.mark.parametrize(("share", "needle"), [
    (2, "at most 1; got 2"), (-0.5, "non-negative"), ("80%", "non-negative"), (True, "non-neg"),
])
def test_a_hot_share_that_is_no_share_is_refused(share: object, needle: str) -> None:
    """'hot_share' is a share of the traffic: 2 printed "(200% of traffic)", and a string
    was left out without a word; each is now refused naming the group."""
    group = {"count": 6, "tokens": 1500, "hot_share": share}
    with pytest.raises(InputFormatError, match=needle) as refused:
        parse_workload({"prefix_groups": [group]})
    assert "prefix_groups[0]" in str(refused.value)


def test_a_hot_share_of_one_is_all_the_traffic() -> None:
    """The largest share is printed as 100%."""
    parts, _ = parse_workload({"prefix_groups": [{"count": 6, "tokens": 1500, "hot_share": 1}]})
    assert "(100% of traffic)" in parts[0].detail


def trace_lines() -> list[str]:
    rows = [
        {"timestamp": 0, "input_length": 1536, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 1000, "input_length": 2048, "output_length": 10, "hash_ids": [1, 2, 3, 4]},
        {"timestamp": 2000, "input_length": 1024, "output_length": 10, "hash_ids": [1, 9]},
        {"timestamp": 120_000, "input_length": 1024, "output_length": 10, "hash_ids": [7, 8]},
        {"timestamp": 121_000, "input_length": 512, "output_length": 10, "hash_ids": [7]},
    ]
    return [json.dumps(row) for row in rows]


def test_mooncake_hot_set_counts_blocks_reused_within_a_window() -> None:
    """Window 1 reuses blocks 1-3, window 2 block 7: hot set 3 blocks of 512 tokens."""
    hot = trace_hot_set(parse_trace_lines(trace_lines()), window_seconds=60)
    assert hot.windows == 2
    assert hot.max_hot_tokens == 3 * 512
    assert hot.median_hot_tokens == 2 * 512
    assert hot.distinct_tokens == 7 * 512


@pytest.mark.parametrize("window", [1e-320, 0.0009, 0.0, -1.0, float("nan")])
def test_a_window_under_a_millisecond_is_refused_naming_the_flag(window: float) -> None:
    """Windows finer than the trace's milliseconds are an error naming --window (1e-320 s made
    a window index of infinity, an OverflowError)."""
    with pytest.raises(InputFormatError, match=r"--window.*at least 0\.001 s"):
        trace_hot_set(parse_trace_lines(trace_lines()), window_seconds=window)


def test_a_one_millisecond_window_works() -> None:
    """The smallest window allowed puts each distinct timestamp in its own window."""
    assert trace_hot_set(parse_trace_lines(trace_lines()), window_seconds=0.001).windows == 5


def test_mooncake_errors_name_the_line() -> None:
    """A trace line without hash_ids names its line."""
    with pytest.raises(InputFormatError, match="trace:2"):
        parse_trace_lines([trace_lines()[0], '{"timestamp": 1, "input_length": 3}'])
