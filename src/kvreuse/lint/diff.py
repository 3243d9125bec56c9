"""Where two prompts part, and what that costs under each cache's rules.

The shared prefix is measured on the token ids of the two *full* prompts: tokenizing only the
stable part would miss a stable part ending in a space that merges with the next word. The field
responsible for the first difference is found by perturbation: for each request field that
differs, render the first request with only that field taken from the second; the field whose
swap moves the rendering earliest is the one the template put first. That follows the template's
real layout (tools before or after the system prompt, a system prompt moved into the last user
turn) without parsing the template.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any

from kvreuse.errors import KvreuseError
from kvreuse.lint.paths import common_prefix_chars, differing_paths, splice
from kvreuse.lint.prompt import Prompt, render_request
from kvreuse.lint.reuse import Reuse, ReuseRule, reuse_under_rules
from kvreuse.tokenizers.chat_template import ChatTemplate
from kvreuse.tokenizers.contract import Tokenizer
from kvreuse.tokens import common_prefix_tokens, pack

MAX_PROBED_FIELDS = 64
"""Renders spent on attribution before falling back to coarse paths (``messages[3]``)."""

CONTEXT_TOKENS = 8


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first token where two prompts differ.

    ``token_a``/``token_b`` are ``None`` when one prompt ends there (it is a prefix of the
    other). ``char_offset_*`` are where that token starts in each prompt's text.
    """

    token_index: int
    char_offset_a: int
    char_offset_b: int
    line: int
    column: int
    field_path: str | None
    token_a: int | None
    token_b: int | None
    piece_a: str
    piece_b: str
    context: str


@dataclass(frozen=True, slots=True)
class PromptDiff:
    """Two prompts compared token by token; ``reuse`` is what prompt B reuses of A's cache."""

    label_a: str
    label_b: str
    tokens_a: int
    tokens_b: int
    shared: int
    divergence: Divergence | None
    reuse: tuple[Reuse, ...]

    @property
    def identical(self) -> bool:
        return self.divergence is None

    def to_json(self) -> dict[str, Any]:
        divergence = self.divergence
        return {
            "a": self.label_a,
            "b": self.label_b,
            "tokens_a": self.tokens_a,
            "tokens_b": self.tokens_b,
            "shared_tokens": self.shared,
            "identical": self.identical,
            "first_divergent_token": None if divergence is None else divergence.token_index,
            "char_offset_a": None if divergence is None else divergence.char_offset_a,
            "char_offset_b": None if divergence is None else divergence.char_offset_b,
            "line": None if divergence is None else divergence.line,
            "column": None if divergence is None else divergence.column,
            "field_path": None if divergence is None else divergence.field_path,
            "token_a": None if divergence is None else divergence.token_a,
            "token_b": None if divergence is None else divergence.token_b,
            "reuse": {r.rule: {"reused": r.reused, "recomputed": r.recomputed} for r in self.reuse},
        }


def shared_prefix(a: Prompt, b: Prompt) -> int:
    """Tokens the two prompts share from the first token. O(n) at memcmp speed."""
    return common_prefix_tokens(pack(a.ids), pack(b.ids))


def attribute_field(
    template: ChatTemplate | None,
    request_a: Mapping[str, Any],
    request_b: Mapping[str, Any],
    text_a: str,
) -> str | None:
    """The request field whose difference shows up first in the rendered prompt.

    ``None`` when no single field's swap changes the rendering (the difference lies in fields
    the template ignores, or only appears when several fields change together).
    O(fields probed x render time).
    """
    probes = list(islice(differing_paths(request_a, request_b), MAX_PROBED_FIELDS + 1))
    if len(probes) > MAX_PROBED_FIELDS:
        probes = list(islice(differing_paths(request_a, request_b, max_depth=2), MAX_PROBED_FIELDS))
    best: tuple[int, str] | None = None
    for path in probes:
        try:
            mixed = splice(request_a, request_b, path)
            text = render_request(mixed, template, str(path))
        except (KvreuseError, KeyError, IndexError, TypeError):
            continue  # the template refuses this half-and-half request; other fields decide
        if text == text_a:
            continue
        offset = common_prefix_chars(text_a, text)
        if best is None or offset < best[0]:
            best = (offset, str(path))
    return None if best is None else best[1]


def diff_prompts(
    a: Prompt,
    b: Prompt,
    *,
    tokenizer: Tokenizer,
    template: ChatTemplate | None = None,
    rules: Mapping[str, ReuseRule] | None = None,
) -> PromptDiff:
    """Compare two prompts; B is the later request reusing what A left in the cache."""
    shared = shared_prefix(a, b)
    reuse = reuse_under_rules(shared, len(b), rules)
    if shared == len(a) == len(b):
        return PromptDiff(a.label, b.label, len(a), len(b), shared, None, reuse)
    offset_a, offset_b = a.char_offset(shared), b.char_offset(shared)
    line, column = a.line_col(offset_a)
    if a.request is not None and b.request is not None:
        field = attribute_field(template, a.request, b.request, a.text)
    else:
        field = f"prompt (line {line}, column {column})"
    token_a = a.ids[shared] if shared < len(a) else None
    token_b = b.ids[shared] if shared < len(b) else None
    divergence = Divergence(
        token_index=shared,
        char_offset_a=offset_a,
        char_offset_b=offset_b,
        line=line,
        column=column,
        field_path=field,
        token_a=token_a,
        token_b=token_b,
        piece_a="" if token_a is None else tokenizer.decode([token_a]),
        piece_b="" if token_b is None else tokenizer.decode([token_b]),
        context=tokenizer.decode(list(a.ids[max(0, shared - CONTEXT_TOKENS) : shared])),
    )
    return PromptDiff(a.label, b.label, len(a), len(b), shared, divergence, reuse)
