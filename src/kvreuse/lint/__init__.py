"""Prompt-stability tools: render, tokenize, fingerprint, diff and audit prompts for prefix reuse.

Pure core: templates render with an injected clock, tokenizers are passed in (load them with
:func:`kvreuse.tokenizers.load_tokenizer`), nothing here reads files or the wall clock.

Exports resolve lazily: rendering needs jinja2 (the ``lint`` extra), while fingerprints and reuse
rules do not, and the CLI must start on a core install.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Divergence": "kvreuse.lint.diff",
    "PromptDiff": "kvreuse.lint.diff",
    "diff_prompts": "kvreuse.lint.diff",
    "shared_prefix": "kvreuse.lint.diff",
    "PrefixFingerprint": "kvreuse.lint.fingerprint",
    "Revisions": "kvreuse.lint.fingerprint",
    "fingerprint": "kvreuse.lint.fingerprint",
    "Prompt": "kvreuse.lint.prompt",
    "build_prompt": "kvreuse.lint.prompt",
    "render_request": "kvreuse.lint.prompt",
    "REUSE_RULES": "kvreuse.lint.reuse",
    "Reuse": "kvreuse.lint.reuse",
    "reuse_under_rules": "kvreuse.lint.reuse",
    "ChatTemplate": "kvreuse.tokenizers.chat_template",
    "TemplateRaised": "kvreuse.tokenizers.chat_template",
    "template_revision": "kvreuse.tokenizers.chat_template",
    "Encoded": "kvreuse.tokenizers.contract",
    "Tokenizer": "kvreuse.tokenizers.contract",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvreuse.lint' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
