"""Prompt-stability tools: render, tokenize, fingerprint, diff and audit prompts for prefix reuse.

Pure core: templates render with an injected clock, tokenizers are passed in (load them with
:func:`kvreuse.tokenizers.load_tokenizer`), nothing here reads files or the wall clock.
"""

from kvreuse.lint.diff import Divergence, PromptDiff, diff_prompts, shared_prefix
from kvreuse.lint.fingerprint import PrefixFingerprint, Revisions, fingerprint
from kvreuse.lint.prompt import Prompt, build_prompt, render_request
from kvreuse.lint.reuse import REUSE_RULES, Reuse, reuse_under_rules
from kvreuse.lint.template import ChatTemplate, TemplateRaised, template_revision
from kvreuse.lint.tokenizer import Encoded, Tokenizer

__all__ = [
    "REUSE_RULES",
    "ChatTemplate",
    "Divergence",
    "Encoded",
    "PrefixFingerprint",
    "Prompt",
    "PromptDiff",
    "Reuse",
    "Revisions",
    "TemplateRaised",
    "Tokenizer",
    "build_prompt",
    "diff_prompts",
    "fingerprint",
    "render_request",
    "reuse_under_rules",
    "shared_prefix",
    "template_revision",
]
