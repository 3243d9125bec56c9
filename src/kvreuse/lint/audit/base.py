"""What audit rules see, what they report, and the measurements they share.

Every rule gets the same :class:`AuditInput`: the rendered, tokenized samples (fixtures for one
template, or logged requests), the template, the tokenizer and two clocks. The *stable part* of a
chat prompt is everything before the content of its last user message; a rule prices a finding
in the stable tokens it stops the cache from reusing.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import IntEnum
from typing import Any, Protocol

from kvreuse.errors import ConfigError
from kvreuse.lint.paths import common_prefix_chars
from kvreuse.lint.prompt import Prompt
from kvreuse.tokenizers.chat_template import ChatTemplate, DateClock
from kvreuse.tokenizers.contract import Tokenizer


class Severity(IntEnum):
    """Finding severities, ordered; names match SARIF levels."""

    NOTE = 1
    WARNING = 2
    ERROR = 3

    @classmethod
    def parse(cls, name: str) -> Severity:
        try:
            return cls[name.upper()]
        except KeyError:
            raise ConfigError(
                f"unknown severity {name!r}; use one of {', '.join(s.name.lower() for s in cls)}"
            ) from None

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem: which rule, how bad, where, what it costs in tokens, and the fix."""

    rule_id: str
    rule_name: str
    severity: Severity
    sample: str
    location: str
    message: str
    fix: str
    tokens_cost: int
    token_index: int | None = None
    char_offset: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule_id,
            "name": self.rule_name,
            "severity": self.severity.label,
            "sample": self.sample,
            "location": self.location,
            "token_index": self.token_index,
            "char_offset": self.char_offset,
            "tokens_cost": self.tokens_cost,
            "message": self.message,
            "fix": self.fix,
        }


@dataclass(frozen=True, slots=True)
class TextEnds:
    """The two lexicographically smallest and the two largest prompt texts, to find in O(1)
    how much of a prompt's text every other prompt shares.

    In sorted order the common prefix of two texts is the shortest of the common prefixes of
    the adjacent pairs between them, so it can only shrink with distance: a text's shortest
    common prefix with any other is the one with the smallest or the largest of the others.
    Two of each, so that a prompt is never compared with itself. O(n) comparisons to build.
    Asking every one of n others instead made an audit of raw prompts O(n^2): 231 s for 4,000.
    """

    smallest: tuple[Prompt, ...]
    largest: tuple[Prompt, ...]

    @classmethod
    def of(cls, prompts: Sequence[Prompt]) -> TextEnds:
        def text(prompt: Prompt) -> str:
            return prompt.text

        return cls(tuple(heapq.nsmallest(2, prompts, key=text)),
                   tuple(heapq.nlargest(2, prompts, key=text)))

    def shared_by_all_others(self, prompt: Prompt) -> int | None:
        """Characters of ``prompt``'s text that every other prompt's text begins with;
        ``None`` when there is no other prompt."""
        low = next((other for other in self.smallest if other is not prompt), None)
        high = next((other for other in self.largest if other is not prompt), None)
        if low is None or high is None:
            return None
        return min(common_prefix_chars(prompt.text, low.text),
                   common_prefix_chars(prompt.text, high.text))


@dataclass(frozen=True, slots=True)
class AuditInput:
    """Everything a rule may look at. ``clocks`` are two instants more than a day apart (with
    different hours, minutes and seconds) used to see whether rendering depends on the time."""

    prompts: tuple[Prompt, ...]
    tokenizer: Tokenizer
    template: ChatTemplate | None = None
    clocks: tuple[DateClock, DateClock] | None = None
    block_size: int = 16
    template_label: str = "template"
    text_ends: TextEnds = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "text_ends", TextEnds.of(self.prompts))


class AuditRule(Protocol):
    """An audit rule. ``check`` is called once per audit with all samples and returns its
    findings (possibly none); it must not mutate the input."""

    id: str
    name: str
    summary: str

    def check(self, audit: AuditInput) -> list[Finding]: ...


def fixed_clocks() -> tuple[DateClock, DateClock]:
    """Two deterministic instants (a day, an hour, a minute and a second apart)."""
    first = datetime(2024, 7, 26, 9, 15, 30)
    second = datetime(2024, 7, 27, 10, 16, 31)
    return (lambda: first), (lambda: second)


def token_at(prompt: Prompt, char_offset: int) -> int:
    """Index of the token that contains ``char_offset``. O(log n)."""
    starts = prompt.encoded.starts
    if not starts:
        return 0
    return max(0, bisect.bisect_right(starts, char_offset) - 1)


def stable_end_char(prompt: Prompt, ends: TextEnds | None = None) -> int:
    """Where the variable tail begins, in characters.

    Chat prompts: the start of the last user message's content (located when the prompt was
    built). Raw prompts: the text all samples share (``ends``: those of every sample; the whole
    text with a single sample or without ``ends``). O(prompt length).
    """
    if prompt.stable_end is not None:
        return prompt.stable_end
    if prompt.request is None and ends is not None:
        shared = ends.shared_by_all_others(prompt)
        if shared is not None:
            return shared
    return len(prompt.text)


def stable_end_token(prompt: Prompt, ends: TextEnds | None = None) -> int:
    """:func:`stable_end_char` as a token index (the token holding that character)."""
    char = stable_end_char(prompt, ends)
    if char >= len(prompt.text):
        return len(prompt)
    return token_at(prompt, char)


def cost_from(prompt: Prompt, token_index: int, ends: TextEnds | None = None) -> int:
    """Stable tokens from ``token_index`` to the end of the stable part: what a volatile value
    at ``token_index`` stops every later request from reusing."""
    return max(0, stable_end_token(prompt, ends) - token_index)


def location(prompt: Prompt, field: str | None) -> str:
    """``label: field`` or ``label: line L, column C`` for raw prompts."""
    return f"{prompt.label}: {field}" if field else prompt.label


def rule_finding(rule: Any, severity: Severity, prompt: Prompt, field: str, token: int,
                 cost: int, message: str) -> Finding:
    """A finding of ``rule`` (its id, name and fix) in ``prompt`` at ``field``, pricing the
    ``cost`` stable tokens from ``token`` on."""
    return Finding(
        rule_id=rule.id,
        rule_name=rule.name,
        severity=severity,
        sample=prompt.label,
        location=location(prompt, field),
        message=message,
        fix=rule.fix,
        tokens_cost=cost,
        token_index=token,
        char_offset=prompt.char_offset(token),
    )


def pairs(prompts: Sequence[Prompt]) -> list[tuple[Prompt, Prompt]]:
    """Sample pairs worth comparing: each sample against the next (O(n) pairs, not O(n^2))."""
    return list(itertools.pairwise(prompts))
