"""How many tokens of a shared prefix each kind of cache actually reuses.

Two prompts share ``shared`` leading tokens; the second has ``prompt_tokens`` tokens. What a
cache serves from that depends on its granularity:

* ``radix`` (SGLang RadixAttention, page size 1): every shared token.
* ``vllm`` (automatic prefix caching, 16-token blocks): whole blocks only, and at most
  ``prompt_tokens - 1`` tokens, because the last prompt token must be computed to produce logits
  (seed 004: 70 shared tokens reuse 64). This is the rule ``kvreuse.index.BlockIndex`` applies:
  ``min(shared, prompt_tokens - 1) // block * block``; it is restated here so the prompt tools do
  not depend on the index package.
* ``openai`` (hosted prompt caching): nothing below 1,024 prompt tokens, then hits in 128-token
  increments from 1,024 (1,024, 1,152, 1,280, ...).

Rules register in :data:`REUSE_RULES`; the CLI and reports iterate over it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvreuse.errors import ConfigError

ReuseRule = Callable[[int, int], int]
"""``(shared_tokens, prompt_tokens) -> reused_tokens``."""

VLLM_BLOCK_SIZE = 16
OPENAI_MINIMUM = 1024
OPENAI_INCREMENT = 128


def _check(shared: int, prompt_tokens: int) -> None:
    if not 0 <= shared <= prompt_tokens:
        raise ConfigError(
            f"shared tokens ({shared}) must lie between 0 and the prompt length ({prompt_tokens})"
        )


def radix_reuse(shared: int, prompt_tokens: int) -> int:
    """Token-granular: every shared token is reused."""
    _check(shared, prompt_tokens)
    return shared


def block_reuse(shared: int, prompt_tokens: int, block_size: int = VLLM_BLOCK_SIZE) -> int:
    """vLLM's rule: whole blocks of at most ``prompt_tokens - 1`` shared tokens."""
    _check(shared, prompt_tokens)
    if block_size <= 0:
        raise ConfigError(f"block size must be positive, got {block_size}")
    return max(0, min(shared, prompt_tokens - 1)) // block_size * block_size


def openai_reuse(shared: int, prompt_tokens: int) -> int:
    """Hosted-API style: cached only from 1,024 tokens, in 128-token increments after that."""
    _check(shared, prompt_tokens)
    if prompt_tokens < OPENAI_MINIMUM or shared < OPENAI_MINIMUM:
        return 0
    return OPENAI_MINIMUM + (shared - OPENAI_MINIMUM) // OPENAI_INCREMENT * OPENAI_INCREMENT


def vllm_rule(block_size: int) -> ReuseRule:
    """The vLLM rule for another block size (``--block-size``)."""
    return lambda shared, prompt_tokens: block_reuse(shared, prompt_tokens, block_size)


REUSE_RULES: dict[str, ReuseRule] = {
    "radix": radix_reuse,
    "vllm": vllm_rule(VLLM_BLOCK_SIZE),
    "openai": openai_reuse,
}
"""Cache granularity rules by name."""


@dataclass(frozen=True, slots=True)
class Reuse:
    """What one rule reuses and recomputes of a prompt."""

    rule: str
    reused: int
    recomputed: int


def reuse_under_rules(
    shared: int, prompt_tokens: int, rules: Mapping[str, ReuseRule] | None = None
) -> tuple[Reuse, ...]:
    """Reused and recomputed tokens of one prompt under every rule, in registry order."""
    chosen = REUSE_RULES if rules is None else rules
    results = []
    for name, rule in chosen.items():
        reused = rule(shared, prompt_tokens)
        assert 0 <= reused <= shared, f"rule {name} reused {reused} of {shared} shared tokens"
        results.append(Reuse(rule=name, reused=reused, recomputed=prompt_tokens - reused))
    return tuple(results)


def rules_with_block_size(block_size: int) -> dict[str, ReuseRule]:
    """The registry with the vLLM rule at another block size."""
    rules = dict(REUSE_RULES)
    rules["vllm"] = vllm_rule(block_size)
    return rules
