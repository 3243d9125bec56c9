"""Seed 001's six-turn chat, replayed through both real indexes.

"Take a conversation with a 1,500-token system prompt, user messages of 150 tokens and answers
of 250 tokens": each turn's prompt is the system prompt, every earlier user message and answer,
then the new user message. At finish the prompt plus its answer is inserted, "so the next turn of a
chat matches through its own previous answer". The seed's totals: 15,900 prefill tokens without a
cache, 2,400 with a radix tree. The block index follows vLLM's rules (whole 16-token blocks, at
most ``prompt - 1`` tokens), so it recomputes a few more tokens each turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvreuse.index.base import PrefixIndex
from kvreuse.tokens import TokenBuffer, pack


@dataclass(frozen=True, slots=True)
class ChatShape:
    """Sizes of the seed's conversation."""

    system_tokens: int = 1500
    user_tokens: int = 150
    answer_tokens: int = 250
    turns: int = 6
    block_size: int = 16


@dataclass(frozen=True, slots=True)
class TurnRow:
    """One turn of the table."""

    turn: int
    prompt_tokens: int
    radix_prefilled: int
    block_prefilled: int


@dataclass(frozen=True, slots=True)
class SixTurnResult:
    rows: tuple[TurnRow, ...]

    @property
    def total_prompt_tokens(self) -> int:
        """Prefill tokens without any cache."""
        return sum(r.prompt_tokens for r in self.rows)

    @property
    def total_radix_prefilled(self) -> int:
        return sum(r.radix_prefilled for r in self.rows)

    @property
    def total_block_prefilled(self) -> int:
        return sum(r.block_prefilled for r in self.rows)


def _segment(start: int, length: int) -> list[int]:
    """Distinct token ids per segment so no two segments match by accident."""
    return list(range(start, start + length))


def conversation_turns(shape: ChatShape) -> list[tuple[TokenBuffer, TokenBuffer]]:
    """``(prompt, prompt + answer)`` token buffers for each turn, built once."""
    system = _segment(1_000, shape.system_tokens)
    history: list[int] = []
    turns = []
    next_id = 1_000 + shape.system_tokens
    for _ in range(shape.turns):
        user = _segment(next_id, shape.user_tokens)
        next_id += shape.user_tokens
        answer = _segment(next_id, shape.answer_tokens)
        next_id += shape.answer_tokens
        prompt = system + history + user
        turns.append((pack(prompt), pack(prompt + answer)))
        history += user + answer
    return turns


def replay(index: PrefixIndex, turns: list[tuple[TokenBuffer, TokenBuffer]]) -> list[int]:
    """Prefilled tokens per turn: match, lock while running, insert prompt + answer at finish."""
    prefilled = []
    for now, (prompt, finished) in enumerate(turns):
        hit = index.match(prompt, now=float(now))
        index.lock(hit.handle)
        prefilled.append(len(prompt) // 4 - hit.length)
        index.insert(finished, now=float(now) + 0.5)
        index.unlock(hit.handle)
    return prefilled


def run_six_turn(shape: ChatShape | None = None) -> SixTurnResult:
    """Replay the conversation through a RadixIndex and a vLLM-style BlockIndex."""
    from kvreuse.index import BlockIndex, RadixIndex

    shape = shape or ChatShape()
    turns = conversation_turns(shape)
    longest = len(turns[-1][1]) // 4
    radix = replay(RadixIndex(), turns)
    blocks = BlockIndex(num_blocks=longest // shape.block_size + 2, block_size=shape.block_size)
    block = replay(blocks, turns)
    rows = tuple(
        TurnRow(i + 1, len(prompt) // 4, radix[i], block[i])
        for i, (prompt, _) in enumerate(turns)
    )
    return SixTurnResult(rows)
