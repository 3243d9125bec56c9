"""A request, rendered through its chat template and tokenized: the unit every prompt tool uses.

A request is what a client sends to an OpenAI-compatible chat endpoint: ``messages`` and
optionally ``tools``, ``documents``, ``add_generation_prompt`` (default true, as vLLM's chat
endpoint) and ``chat_template_kwargs``. A request with a string ``prompt`` instead is a raw
completion prompt and is tokenized as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvreuse.errors import ConfigError, InputFormatError, KvreuseError
from kvreuse.tokenizers.chat_template import ChatTemplate
from kvreuse.tokenizers.contract import Encoded, Tokenizer


@dataclass(frozen=True, slots=True)
class Prompt:
    """One rendered, tokenized prompt. ``request`` is ``None`` for raw text prompts."""

    label: str
    text: str
    encoded: Encoded
    request: Mapping[str, Any] | None = None
    stable_end: int | None = None
    """Character offset where the last user message's content starts (chat prompts)."""

    @property
    def ids(self) -> tuple[int, ...]:
        return self.encoded.ids

    def __len__(self) -> int:
        return len(self.encoded.ids)

    def char_offset(self, token_index: int) -> int:
        """Where token ``token_index`` starts in :attr:`text` (end of text past the last)."""
        return self.encoded.char_offset(token_index, len(self.text))

    def line_col(self, char_offset: int) -> tuple[int, int]:
        """1-based line and column of a character offset (for raw-text locations and SARIF)."""
        before = self.text[:char_offset]
        line = before.count("\n") + 1
        return line, char_offset - (before.rfind("\n") + 1) + 1


def is_chat_request(request: Mapping[str, Any]) -> bool:
    return "messages" in request


def render_request(request: Mapping[str, Any], template: ChatTemplate | None, where: str) -> str:
    """The prompt text of ``request``; ``where`` names it in errors."""
    if not isinstance(request, Mapping):
        raise InputFormatError("a request must be a JSON object", where=where)
    if not is_chat_request(request):
        prompt = request.get("prompt")
        if isinstance(prompt, str):
            return prompt
        raise InputFormatError("a request needs 'messages' (chat) or a string 'prompt'", where)
    messages = request["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise InputFormatError("'messages' must be a list of objects", f"{where}: messages")
    if template is None:
        raise ConfigError(
            f"{where} is a chat request but no chat template is known: pass --template FILE or a "
            "tokenizer directory whose tokenizer_config.json has a chat_template"
        )
    tools = request.get("tools")
    documents = request.get("documents")
    for name, value in (("tools", tools), ("documents", documents)):
        if value is not None and not isinstance(value, list):
            raise InputFormatError(f"'{name}' must be a list", f"{where}: {name}")
    kwargs = request.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise InputFormatError("'chat_template_kwargs' must be an object", where)
    add_generation_prompt = bool(request.get("add_generation_prompt", True))
    try:
        return template.render(
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except InputFormatError as exc:
        raise type(exc)(str(exc), where=where) from None


TAIL_MARKER = "\ue000kvreuse-variable-tail\ue000"


def variable_tail_offset(
    request: Mapping[str, Any], template: ChatTemplate | None, text: str
) -> int | None:
    """Where the last user message's content begins in the rendered ``text``.

    Found by rendering once more with that content replaced by a private-use marker: exact
    whatever the template does around it (a search for the content itself would also match
    the same words elsewhere). ``None`` when there is no user text or the template hides it.
    """
    messages = request.get("messages")
    if not isinstance(messages, list):
        return None
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if isinstance(message, Mapping) and message.get("role") == "user":
            break
    else:
        return None
    content = message.get("content")
    marked = dict(message)
    if isinstance(content, str):
        marked["content"] = TAIL_MARKER + content
    elif isinstance(content, list):
        parts = [dict(p) if isinstance(p, Mapping) else p for p in content]
        text_part = next((p for p in parts if isinstance(p, dict) and "text" in p), None)
        if text_part is None:
            return None
        text_part["text"] = TAIL_MARKER + str(text_part["text"])
        marked["content"] = parts
    else:
        return None
    probe = dict(request)
    probe["messages"] = [*messages[:index], marked, *messages[index + 1 :]]
    try:
        rendered = render_request(probe, template, "variable tail probe")
    except KvreuseError:
        return None
    at = rendered.find(TAIL_MARKER)
    if at == -1 or rendered[:at] != text[:at]:
        return None
    return at


def build_prompt(
    request: Mapping[str, Any] | str,
    *,
    tokenizer: Tokenizer,
    template: ChatTemplate | None,
    label: str,
) -> Prompt:
    """Render (unless ``request`` is already text) and tokenize. O(prompt length)."""
    if isinstance(request, str):
        return Prompt(label, request, tokenizer.encode_with_offsets(request), None)
    text = render_request(request, template, label)
    if not is_chat_request(request):
        return Prompt(label, text, tokenizer.encode_with_offsets(text), None)
    stable_end = variable_tail_offset(request, template, text)
    return Prompt(label, text, tokenizer.encode_with_offsets(text), request, stable_end)
