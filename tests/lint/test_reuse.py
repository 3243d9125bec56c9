"""Reuse rules: radix (every token), vLLM (whole blocks, at most n-1), OpenAI-style."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvreuse.errors import ConfigError
from kvreuse.lint.reuse import (
    REUSE_RULES,
    block_reuse,
    openai_reuse,
    radix_reuse,
    reuse_under_rules,
)


def test_seed_004_seventy_shared_tokens_reuse_sixty_four() -> None:
    """Seed 004: with 16-token blocks, 70 shared tokens reuse 64."""
    assert block_reuse(70, 200) == 64
    assert radix_reuse(70, 200) == 70


def test_vllm_never_reuses_the_last_prompt_token() -> None:
    """An identical 64-token prompt reuses 48: the last token is computed for logits."""
    assert block_reuse(64, 64) == 48
    assert block_reuse(65, 65) == 64


def test_openai_rule_minimum_and_increments() -> None:
    """Nothing below 1,024 tokens, then 128-token steps."""
    assert openai_reuse(1023, 5000) == 0
    assert openai_reuse(1000, 1000) == 0
    assert openai_reuse(1024, 5000) == 1024
    assert openai_reuse(1151, 5000) == 1024
    assert openai_reuse(1152, 5000) == 1152
    assert openai_reuse(1500, 1500) == 1408


def test_shared_beyond_prompt_is_a_caller_mistake() -> None:
    """Shared tokens larger than the prompt are refused."""
    with pytest.raises(ConfigError):
        block_reuse(10, 5)


def test_rules_report_reused_and_recomputed() -> None:
    """reuse_under_rules gives reused + recomputed = prompt tokens for every rule."""
    results = reuse_under_rules(1003, 2000)
    assert [r.rule for r in results] == list(REUSE_RULES)
    assert {r.rule: r.reused for r in results} == {"radix": 1003, "vllm": 992, "openai": 0}
    assert all(r.reused + r.recomputed == 2000 for r in results)


@given(st.integers(1, 10_000), st.data())
def test_rules_are_monotone_and_bounded(prompt: int, data: st.DataObject) -> None:
    """Property: every rule reuses at most the shared tokens and more sharing never reuses less."""
    shared = data.draw(st.integers(0, prompt))
    more = data.draw(st.integers(shared, prompt))
    for rule in REUSE_RULES.values():
        assert 0 <= rule(shared, prompt) <= shared
        assert rule(shared, prompt) <= rule(more, prompt)
    assert REUSE_RULES["vllm"](shared, prompt) % 16 == 0
