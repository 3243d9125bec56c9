"""The benchmark's workloads, at tiny sizes, replayed through kvreuse against a naive reference.

No timing here (speed targets live in benchmarks/index_ops.py): these tests check that the
workload generators build what they claim and that what the benchmark times is correct.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "index_ops.py"


def naive_match_lengths(requests: list[tuple[list[int], list[int]]]) -> list[int]:
    """For each (prompt, finished) in order: the longest prefix of the prompt equal to a prefix
    of some earlier finished sequence, then remember the finished one."""
    stored: list[list[int]] = []
    lengths = []
    for prompt, finished in requests:
        best = 0
        for seq in stored:
            n = 0
            for a, b in zip(prompt, seq, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        lengths.append(best)
        stored.append(finished)
    return lengths


def tiny_workloads(bench: ModuleType, vocab_bits: int) -> list[object]:
    """Both workloads at a few dozen requests; a tiny vocabulary forces partial matches."""
    return [
        bench.shared_system_workload(
            7, num_prompts=30, num_system_prompts=3, system_tokens=24, prompt_tokens=40,
            vocab_bits=vocab_bits,
        ),
        bench.chat_workload(
            8, num_conversations=6, turns=4, num_system_prompts=2, system_tokens=20,
            user_tokens=5, answer_tokens=7, vocab_bits=vocab_bits,
        ),
    ]


@pytest.mark.parametrize("vocab_bits", [2, 17])
@pytest.mark.parametrize("native", [True, False])
def test_kvreuse_match_lengths_equal_naive_reference(
    bench: ModuleType, vocab_bits: int, native: bool
) -> None:
    """kvreuse's timed replay (buffers or lists) hits exactly what a brute-force search finds."""
    for workload in tiny_workloads(bench, vocab_bits):
        expected = naive_match_lengths([bench.fresh_lists(r) for r in workload.requests])
        times = bench.run_kvreuse(workload, native=native)
        assert times.match_lengths == expected, workload.name


def test_replay_evicts_every_stored_token(bench: ModuleType) -> None:
    """The eviction phase drains exactly the tokens the workload stored, and no more."""
    workload = tiny_workloads(bench, 2)[1]
    stored: set[tuple[int, ...]] = set()
    for request in workload.requests:
        _, finished = bench.fresh_lists(request)
        for end in range(1, len(finished) + 1):
            stored.add(tuple(finished[:end]))
    times = bench.run_kvreuse(workload, native=True)
    assert times.evict_tokens == len(stored)  # a token-granular trie holds one token per prefix


def test_shared_system_prompts_have_the_stated_shape(bench: ModuleType) -> None:
    """Every prompt has the stated length and starts with one of the system prompts."""
    workload = bench.shared_system_workload(
        3, num_prompts=50, num_system_prompts=4, system_tokens=48, prompt_tokens=64
    )
    heads = {tuple(r.prompt[:48]) for r in workload.requests}
    assert len(workload.requests) == 50
    assert all(r.prompt_len == r.finished_len == 64 == len(r.tokens) for r in workload.requests)
    assert 1 < len(heads) <= 4
    assert all(max(r.prompt) < 2**bench.VOCAB_BITS for r in workload.requests)


def test_chat_turns_grow_by_their_own_answers(bench: ModuleType) -> None:
    """Turn t+1 of a conversation starts with turn t's prompt and answer, then a user message."""
    workload = bench.chat_workload(
        4, num_conversations=5, turns=3, num_system_prompts=2, system_tokens=30,
        user_tokens=4, answer_tokens=6,
    )
    by_conversation: dict[int, list[object]] = {}
    for request in workload.requests:
        by_conversation.setdefault(id(request.tokens), []).append(request)
    assert len(by_conversation) == 5
    for turns in by_conversation.values():
        assert [t.prompt_len for t in turns] == [34, 44, 54]
        assert all(t.finished_len == t.prompt_len + 6 for t in turns)
        for before, after in itertools.pairwise(turns):
            assert after.prompt[: before.finished_len] == before.finished
            assert after.prompt_len == before.finished_len + 4


def test_random_tokens_stay_inside_the_vocabulary(bench: ModuleType) -> None:
    """Token ids come from the stated vocabulary, both on the fast and the small-vocab path."""
    import random

    for bits in (2, 16, 17, 24):
        tokens = bench.random_tokens(random.Random(bits), 5000, bits)
        assert len(tokens) == 5000
        assert max(tokens) < 2**bits
        assert len(set(tokens)) > min(2**bits, 5000) // 2
